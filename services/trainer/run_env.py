"""The environment layer of `tlt run`'s services: TLT_<SECTION>__* variables folded into the run's config.toml.

The README's order is preset, environment, command line. `tlt run` writes each service's resolved sections to
`runs/<id>/config.toml` (the preset with --set, --steps and the run's own paths and ports in it); a child that read
that file as its preset and the environment over it let TLT_TRAINER__STEPS beat --steps. So the launcher applies the
environment to the preset under --set (`environment_layer`) and takes those variables out of its children's
environment (`child_unset_env`); a secret set there stays out of the file and reaches them as it was set.
"""

from __future__ import annotations

import os
from typing import Any

from tlt.services.common.config import KeyedTable, env_overrides, env_prefix
from tlt.services.common.config_cmd import SECRET_FIELDS, SECTION_CLASSES

# SECRET_FIELDS are kept out of config.toml (a file in the run folder): they reach the services in the environment
# as the user set them, unless this launch's --set names them
SERVICE_SECTIONS = tuple(s for s in SECTION_CLASSES if s != "run")  # [run] is the launcher's own (RunConfig)


def _env_key(variable: str, section: str) -> str:
    """'TLT_ROLLOUT__SPEC__THRESHOLD' -> 'rollout.spec.threshold' (as env_overrides reads it)."""
    return ".".join([section, *variable[len(env_prefix(section)):].lower().split("__")])


def _flat(key: str, value: Any):  # noqa: ANN202 - Iterator[tuple[str, Any]]
    """env_overrides' nested tables as (dotted key, value); a table given whole stays one value."""
    if isinstance(value, KeyedTable):
        for k, v in value.items():
            yield from _flat(f"{key}.{k}", v)
    else:
        yield key, value


def environment_layer() -> list[tuple[str, Any]]:
    """The services' TLT_<SECTION>__* settings as (dotted key, value), secrets left out. `tlt run` applies them to
    the preset under --set (README: preset, environment, command line) and writes the result to config.toml; its
    children do not read them again (`child_unset_env`). They used to, over config.toml, where --set, --steps and
    the run's own paths already were: TLT_TRAINER__STEPS beat --steps, TLT_TRAINER__OUTPUT_DIR moved the run's
    checkpoints and metrics out of its folder."""
    layer = []
    for section in SERVICE_SECTIONS:
        for key, value in _flat(section, KeyedTable(env_overrides(section))):
            if key not in SECRET_FIELDS:
                layer.append((key, value))
    return layer


def child_unset_env(overrides: dict[str, Any]) -> tuple[str, ...]:
    """The TLT_<SECTION>__* variables to take out of the children's environment: all the services' variables but a
    secret's (not in config.toml) that this launch's --set does not name."""
    keys = {k: _env_key(k, s) for s in SERVICE_SECTIONS for k in os.environ if k.startswith(env_prefix(s))}
    return tuple(sorted(k for k, key in keys.items() if key not in SECRET_FIELDS or key in overrides))
