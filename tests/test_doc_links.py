"""Relative links in README.md and docs/ must name files inside the repository.

The README linked the design document as ../shared/design/TLT.md, a folder next to the checkout that a
fresh clone does not have: the link was dead for every reader but the authors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _relative_targets(page: Path) -> list[str]:
    targets = [t.split("#", 1)[0] for t in LINK.findall(page.read_text())]
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_stay_inside_the_repository(page: Path) -> None:
    for target in _relative_targets(page):
        path = (page.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{page.relative_to(ROOT)} links {target}, outside the repository"
        assert path.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"


def test_design_documents_are_in_the_repository() -> None:
    for name in ("TLT.md", "ARCHITECTURE.md", "STYLE.md"):
        assert (ROOT / "docs" / "design" / name).is_file(), f"docs/design/{name} is missing"
