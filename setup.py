"""Package discovery for the mapped layout (see pyproject.toml).

`services/` is imported as `tlt.services` and `kernels/` as `tlt.kernels`.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"tlt": "tlt", "tlt.services": "services", "tlt.kernels": "kernels"}
# Data only: the preset TOMLs as tlt/presets in a non-editable install (services/common/config.py looks there when
# the checkout's deploy/configs is not beside the code).
# Only where the folder is there: deploy/Dockerfile's first, dependency-only install runs on a stub tree without it.
DATA = {"tlt.presets": "deploy/configs"} if Path("deploy/configs").is_dir() else {}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder).parts
            found.append(".".join((name, *rel)))
    return found


setup(packages=packages() + list(DATA), package_dir={**ROOTS, **DATA},
      package_data={"tlt": ["py.typed"], **({"tlt.presets": ["*.toml"]} if DATA else {})})
