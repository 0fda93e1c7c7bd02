"""The drafter package's module docstrings name only things the code has: services/drafter/collect.py sent a reader
to `features_from_hidden`, which no module defines (the trainer's path builds its sequences with collect's own
`features_message`). Every backquoted snake_case or CamelCase name in a services/drafter module docstring must occur
in the code of services/, tlt/, kernels/ or deploy/: an identifier it defines or uses, or a word of a string
constant, docstrings and comments left out (a comment naming it does not make it exist)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = {"set_embed_and_head"}  # names of other projects a docstring cites (SGLang's EAGLE worker)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (of the module, a class or a function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def _names(tree: ast.AST) -> set[str]:
    """The identifiers the code has: names, attributes, definitions, arguments, imports, keywords and the words of its
    string constants (a config key, a JSON field), leaving out docstrings and comments (not in the tree)."""
    docs, names = _docstrings(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.update(re.findall(r"\w+", f"{node.name} {node.asname or ''}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            names.update(re.findall(r"\w+", node.value))
    return names


def _code_and_docs() -> tuple[set[str], dict[Path, str]]:
    code: set[str] = set()
    docs = {}
    for p in sorted(q for d in ("services", "tlt", "kernels", "deploy") for q in (ROOT / d).rglob("*.py")):
        tree = ast.parse(p.read_text())
        code |= _names(tree)
        code.add(p.stem)  # a module is named by its file
        if p.parent == ROOT / "services" / "drafter":
            docs[p] = ast.get_docstring(tree, clean=False) or ""
    return code, docs


def test_drafter_module_docstrings_name_existing_code() -> None:
    code, docs = _code_and_docs()
    assert len(docs) > 10
    missing = []
    for path, doc in docs.items():
        for name in set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?`", doc)):
            if ("_" in name.strip("_") or name[0].isupper()) and name not in code | UPSTREAM:
                missing.append(f"{path.relative_to(ROOT)}: `{name}`")
    assert not missing, missing
