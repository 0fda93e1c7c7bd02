"""Package discovery for the mapped layout (see pyproject.toml).

`services/` is imported as `tlt.services` and `kernels/` as `tlt.kernels`.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"tlt": "tlt", "tlt.services": "services", "tlt.kernels": "kernels"}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder).parts
            found.append(".".join((name, *rel)))
    return found


setup(packages=packages(), package_dir=ROOTS, package_data={"tlt": ["py.typed"]})
