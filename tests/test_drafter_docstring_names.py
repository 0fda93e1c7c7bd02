"""The drafter package's module docstrings name only things the code has: services/drafter/collect.py sent a reader
to `features_from_hidden`, which no module defines (the trainer's path builds its sequences with collect's own
`features_message`). Every backquoted snake_case or CamelCase name in a services/drafter module docstring must occur
in the code (docstrings left out) of services/, tlt/, kernels/ or deploy/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _code_and_docs() -> tuple[str, dict[Path, str]]:
    code, docs = [], {}
    for p in sorted(q for d in ("services", "tlt", "kernels", "deploy") for q in (ROOT / d).rglob("*.py")):
        src = p.read_text()
        doc = ast.get_docstring(ast.parse(src), clean=False) or ""
        code.append(src.replace(doc, "") if doc else src)
        if p.parent == ROOT / "services" / "drafter":
            docs[p] = doc
    return "\n".join(code), docs


def test_drafter_module_docstrings_name_existing_code() -> None:
    code, docs = _code_and_docs()
    assert len(docs) > 10
    missing = []
    for path, doc in docs.items():
        for name in set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?`", doc)):
            if ("_" in name.strip("_") or name[0].isupper()) and not re.search(rf"\b{re.escape(name)}\b", code):
                missing.append(f"{path.relative_to(ROOT)}: `{name}`")
    assert not missing, missing
