"""Typed, frozen service configs loaded from TOML presets with overrides.

Each service owns one pydantic model (e.g. `RolloutConfig` in
`services/rollout/config.py`) built on `ServiceConfig`: frozen, no unknown
keys, a docstring per field. Values are resolved in this order, later wins:

    model defaults -> preset TOML section -> environment -> CLI overrides

- preset: `deploy/configs/<name>.toml` (or any path), section = the service name;
- environment: `TLT_<SECTION>__<FIELD>=value` (e.g. `TLT_ROLLOUT__REPLICAS=2`); a nested section's
  field with one more `__` (`TLT_ROLLOUT__SPEC__THRESHOLD=8` sets `[rollout.spec] threshold`), and one
  key of a dict-valued field likewise (`TLT_SGLANG__ADAPTIVE_STEPS__1='[1, 3]'` sets that key and keeps
  the others, where `TLT_SGLANG__ADAPTIVE_STEPS='{"1": [1, 3]}'` replaces the whole map);
- CLI: `--set field=value` pairs (values parsed as TOML literals, else JSON objects, else strings).

Each layer updates the one before it: a nested section field by field, a dict-valued field key by key
where its keys are given one by one, and any other value (a whole map included) replaces what was there.

A bad value raises `ConfigError` naming the field, the source of the value and
how to fix it.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

# The presets: deploy/configs in a checkout (and an editable install); tlt/presets in a wheel or any other non-editable
# install, where setup.py ships the same files (without it `pip install .` knew no preset at all)
_SOURCE_PRESETS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
PRESETS_DIR = _SOURCE_PRESETS if _SOURCE_PRESETS.is_dir() else Path(__file__).resolve().parents[2] / "presets"

T = TypeVar("T", bound="ServiceConfig")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid. The message says how to fix it."""


_UNIONS = (typing.Union, types.UnionType)


def _bool_for_number(annotation: Any, value: Any) -> tuple[bool] | None:
    """(the bool,) where `value` holds true or false at a place `annotation` wants a number (a field, an item of a
    list or tuple field, a value of a dict field), else None."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in _UNIONS:
        if isinstance(value, bool) and bool in args:
            return None
        return next((b for a in args if a is not type(None) and (b := _bool_for_number(a, value))), None)
    if isinstance(value, bool):
        return (value,) if annotation in (int, float) else None
    if origin in (list, tuple, set, frozenset) and isinstance(value, (list, tuple)):
        items = args[:1] * len(value) if origin is not tuple or (len(args) == 2 and args[1] is Ellipsis) else args
        return next((b for a, x in zip(items, value) if (b := _bool_for_number(a, x))), None)
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return next((b for x in value.values() if (b := _bool_for_number(args[1], x))), None)
    return None


class ServiceConfig(BaseModel):
    """Base of every service config: immutable and strict about unknown keys."""

    # coerce_numbers_to_str: an override is parsed as a TOML literal, so a string field set to `2024` (a
    # served model name, a token) arrives as an int; it is the string the user typed.
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, coerce_numbers_to_str=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic reads true as 1 for an int field: `steps = true` loaded as one step, without a word
        if info.field_name is not None and (b := _bool_for_number(cls.model_fields[info.field_name].annotation, v)):
            raise ValueError(f"{str(b[0]).lower()} is not a number")
        return v

    @field_validator("*", mode="after")
    @classmethod
    def _finite(cls, v: Any) -> Any:
        # `gt=0` lets inf through (NaN fails the comparison): `--set trainer.lr=inf` trained every weight to NaN
        values = v if isinstance(v, (list, tuple)) else (v,)
        if any(isinstance(x, float) and not math.isfinite(x) for x in values):
            raise ValueError(f"must be a finite number, got {v!r}")
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _text_for_a_string(cls, v: Any, info: ValidationInfo) -> Any:
        # an override's number, for a string field, is the text typed (coerce_numbers_to_str wrote 1.10 as "1.1")
        return v if info.field_name is None else as_field_takes(cls.model_fields[info.field_name], v)


def preset_path(preset: str | os.PathLike[str]) -> Path:
    """Resolve a preset name (`cpu-tiny`) or a path to a TOML file."""
    if not str(preset).strip():
        raise ConfigError("the config name is empty; give a preset name or a path to a .toml file")
    p = Path(preset)
    if p.suffix == ".toml" or p.exists():
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        if p.is_dir():
            raise ConfigError(f"config file {p} is a folder; give the path to a .toml file")
        return p
    candidate = PRESETS_DIR / f"{preset}.toml"
    if not candidate.exists():
        names = sorted(x.stem for x in PRESETS_DIR.glob("*.toml"))
        raise ConfigError(f"unknown preset {preset!r}; choose one of {names} or pass a path to a .toml file")
    return candidate


def read_preset(preset: str | os.PathLike[str] | None) -> dict[str, Any]:
    if preset is None:
        return {}
    path = preset_path(preset)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text, as TOML must be ({e.reason} at byte {e.start}); save it as UTF-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from e


class _IntText(int):
    """A number an override gave as text, with that text: a string field takes the text (`_text_for_a_string`)."""

    text: str


class _FloatText(float):
    __doc__ = _IntText.__doc__
    text: str


def _with_text(value: Any, text: str) -> Any:
    """`value` (a parsed literal) carrying `text` if it is a number; anything else as it is."""
    kind = {int: _IntText, float: _FloatText}.get(type(value))
    if kind is None:
        return value
    out = kind(value)
    out.text = text
    return out


def _wants_text(annotation: Any) -> bool:
    """Whether a field of this annotation is a string (str, or str in a union: `str | None`)."""
    return annotation is str or (typing.get_origin(annotation) in _UNIONS and str in typing.get_args(annotation))


def as_field_takes(field: FieldInfo | None, value: Any) -> Any:
    """`value` as `field` takes it: an override's number the text it was typed as where the field is a string
    (what the configs' validator does; for a value written to a file before any config reads it)."""
    if isinstance(value, (_IntText, _FloatText)) and field is not None and _wants_text(field.annotation):
        return value.text
    return value


def _parse_literal(text: str) -> Any:
    """A TOML literal (`2`, `[1, 3]`, `{"1" = [1]}`), else a JSON object (`{"1": [1]}`, as compose and
    Kubernetes files write a map), else the text itself. A number keeps the text it was read from, for a string
    field (`1.10` is the name "1.10", not "1.1")."""
    try:
        return _with_text(tomllib.loads(f"v = {text}")["v"], text.strip())
    except tomllib.TOMLDecodeError:
        pass
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text
        if isinstance(value, dict):
            return value
    return text


class KeyedTable(dict):
    """Keys that one layer gives under a field one by one (`TLT_S__FIELD__KEY=v`, `tlt config show --set
    s.field.key=v`): each sets its key and keeps the others. A table given whole as the value (`TLT_S__FIELD=
    '{...}'`, a preset's `field = {...}`) replaces a dict-valued field instead (`_merged`)."""


def env_prefix(section: str) -> str:
    """`TLT_<SECTION>__`, with dashes in the section name turned into underscores."""
    return f"TLT_{section.upper().replace('-', '_')}__"


def env_overrides(section: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`TLT_<SECTION>__<FIELD>` values; `TLT_<SECTION>__<SUB>__<FIELD>` nests (`{"sub": {"field": v}}`, the inner
    table a KeyedTable: a nested section's field, or one key of a dict-valued field)."""
    prefix = env_prefix(section)
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for k in sorted(env):  # sorted: which of two clashing variables is named does not depend on their order
        if not k.startswith(prefix):
            continue
        *path, leaf = k[len(prefix):].lower().split("__")
        node = out
        for part in path:
            node = node.setdefault(part, KeyedTable())
            if not isinstance(node, KeyedTable):
                raise ConfigError(f"{k}: {part!r} is given whole by another variable; give it whole or key by key")
        if isinstance(node.get(leaf), KeyedTable):
            raise ConfigError(f"{k}: {leaf!r} is given key by key by other variables; give it whole or key by key")
        node[leaf] = _parse_literal(env[k].strip())  # as --set: an env file's stray space is no part of the value
    return out


def nested_section(field: FieldInfo | None) -> type[ServiceConfig] | None:
    """The config class of a nested section field ([rollout.engine]), else None (a dict-valued field is a value)."""
    a = None if field is None else field.annotation
    return a if isinstance(a, type) and issubclass(a, ServiceConfig) else None


_MISSING = object()  # no earlier layer set the field


def _merged(field: FieldInfo | None, base: Any, value: Any) -> Any:
    """One layer's `value` of `field` over `base`, what the earlier layers gave it (_MISSING: none did).

    A nested section's table updates it field by field (a nested override keeps the rest, the defaults included);
    keys given one by one (KeyedTable) update a dict-valued field, starting from its default when no earlier
    layer set it; any other value, a whole table included, replaces it."""
    section = nested_section(field)
    if section is not None and isinstance(value, Mapping):
        out = dict(base) if isinstance(base, Mapping) else {}
        for k, v in value.items():
            if v is not None:
                out[k] = _merged(section.model_fields.get(k), out.get(k, _MISSING), v)
        return out
    if isinstance(value, KeyedTable):
        if base is _MISSING and field is not None:
            base = field.get_default(call_default_factory=True)
        out = dict(base) if isinstance(base, Mapping) else {}
        for k, v in value.items():
            out[k] = _merged(None, out.get(k, _MISSING), v)
        return out
    return value


def cli_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"override {pair!r} must look like field=value")
        key, value = pair.split("=", 1)
        if not key.strip():
            raise ConfigError(f"override {pair!r} has no field name; it must look like field=value")
        out[key.strip()] = _parse_literal(value.strip())
    return out


# TLT_* variables read as they are, not as config fields (services/common/auth.py, logging.py, tlt/cli.py,
# procs.py; TLT_IMAGE is docker compose's image tag)
# fields that hold a secret: `tlt config show` never prints their value, `tlt run` keeps them out of config.toml,
# a config error names them without their value
SECRET_FIELDS = frozenset({"rollout.control_token", "rollout.api_key", "drafter.control_token", "trainer.rollout_token"})

PLAIN_ENVIRONMENT = ("TLT_PRESET", "TLT_AUTH_TOKEN", "TLT_AUTH_TOKEN_FILE", "TLT_API_KEY", "TLT_LOG_JSON",
                     "TLT_LOG_LEVEL", "TLT_DIE_WITH_PARENT", "TLT_IMAGE",
                     "TLT_DRAFTER_WORKER_CONFIG")  # drafter serve -> its workers (services/drafter/serve.py)


def unknown_environment(environ: Mapping[str, str], sections: Sequence[str] | None = None) -> list[str]:
    """The TLT_* variables nothing reads, each with what was likely meant: a misspelt section (TLT_ROLOUT__X) or
    one underscore after it (TLT_ROLLOUT_X) configured nothing, silently. `sections`: the config sections
    (default: the preset's, config_cmd.SECTION_CLASSES)."""
    if sections is None:
        from tlt.services.common.config_cmd import SECTION_CLASSES

        sections = list(SECTION_CLASSES)
    prefixes = tuple(env_prefix(s) for s in sections)
    problems = []
    for key in sorted(environ):
        if not key.startswith("TLT_") or key in PLAIN_ENVIRONMENT or key.startswith(prefixes):
            continue
        head = key[len("TLT_"):]
        if "__" in head:
            section, rest = head.split("__", 1)
            close = closest(section.lower(), sections)
            hint = f"; did you mean {env_prefix(close)}{rest}?" if close else ""
            problems.append(f"{key}: no config section [{section.lower()}] (sections: {', '.join(sections)}){hint}")
            continue
        section = next((s for s in sections if head.lower().startswith(f"{s.replace('-', '_')}_")), None)
        if section is not None:
            field = head[len(section) + 1:]
            problems.append(f"{key}: a config variable has two underscores after its section: "
                            f"{env_prefix(section)}{field}")
        else:
            problems.append(f"{key}: not a variable TLT reads (config: TLT_<SECTION>__<FIELD>; others: "
                            f"{', '.join(PLAIN_ENVIRONMENT)})")
    return problems


def own_section_hint(section: str, key: str, value: Any) -> str:
    """A command's `--set section.field=value` naming its own section (the form `tlt run --set` takes): what to
    type instead."""
    field = key.removeprefix(f"{section}.")
    shown = json.dumps(value) if isinstance(value, (bool, dict, list)) else getattr(value, "text", None) or str(value)
    return (f"--set {key}=...: this command's --set takes [{section}] fields, named without the section: "
            f"--set {field}={shown} (`tlt run --set` is the one that takes {section}.{field})")


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name a misspelt `name` most likely meant (difflib's closest, None when none is close): the
    'did you mean' of an unknown section, field or variable."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1)
    return close[0] if close else None


def _known_fields(cls: type[BaseModel], section: str, loc: Sequence[Any]) -> str:
    """'did you mean ...? known fields of [section.sub]: ...' for the unknown field at `loc`: a typo in a nested
    section ([rollout.engine]) is named among that section's fields, not the outer one's."""
    owner, names = cls, [section]
    for part in loc[:-1]:
        inner = nested_section(owner.model_fields.get(str(part)))
        if inner is None:
            break
        owner, names = inner, [*names, str(part)]
    known = sorted(owner.model_fields)
    close = closest(str(loc[-1]), known)
    hint = f"did you mean {close!r}? " if close else ""
    return f"{hint}known fields of [{'.'.join(names)}]: {', '.join(known)}"


def load_config(
    cls: type[T],
    section: str,
    preset: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    require_section: bool = False,
    overrides_origin: str | Mapping[str, str] = "command line",
) -> T:
    """Build `cls` from a preset section, the environment and explicit overrides. `require_section`: the
    preset file must have [section] (a command's own --config / --preset: a file without it, e.g. a typo in the
    header, would otherwise configure nothing and leave every default, silently). `overrides_origin`: where an
    error says the overrides came from, one for all or by field (a flag's name; "command line" for the rest)."""
    sources: dict[str, str] = {}
    values: dict[str, Any] = {}
    whole = read_preset(preset)
    if require_section and preset is not None and section not in whole:
        raise ConfigError(f"{preset_path(preset)} has no [{section}] section (its sections: "
                          f"{', '.join(sorted(whole)) or 'none'}); add [{section}], or give a file that has it")
    from_preset = whole.get(section, {})
    if not isinstance(from_preset, dict):
        raise ConfigError(f"preset {preset}: [{section}] must be a table of field = value, not {from_preset!r}")
    layers = [
        (f"preset {preset} [{section}]", from_preset),
        (f"environment {env_prefix(section)}*", env_overrides(section, environ)),
        (overrides_origin, dict(overrides or {})),
    ]
    for origin, layer in layers:
        for key, value in layer.items():
            if value is None:
                continue
            values[key] = _merged(cls.model_fields.get(key), values.get(key, _MISSING), value)
            sources[key] = origin if isinstance(origin, str) else origin.get(key, "command line")
    try:
        return cls(**values)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            if not err["loc"]:  # a rule across fields (a model validator): its input is the whole section
                given = ", ".join(dict.fromkeys(sources.values())) or "defaults"
                message = err["msg"].removeprefix("Value error, ")
                problems.append(f"{message} (this section's values from: {given})")
                continue
            field = ".".join(str(x) for x in err["loc"])
            origin = sources.get(str(err["loc"][0]) if err["loc"] else "", "defaults")
            if err["type"] == "extra_forbidden" and origin == "command line" and field.startswith(f"{section}."):
                problems.append(own_section_hint(section, field, err.get("input")))
            elif err["type"] == "extra_forbidden":
                problems.append(f"unknown field {field!r} (from {origin}); " + _known_fields(cls, section, err["loc"]))
            elif err["type"] == "value_error" and isinstance(err.get("input"), dict):
                # a rule across a nested section's fields ([rollout.spec]): its input is that whole section, which
                # was printed as a dict before the rule's own words
                message = err["msg"].removeprefix("Value error, ")
                problems.append(f"[{section}.{field}] (from {origin}): {message}")
            else:
                desc = cls.model_fields[field].description if field in cls.model_fields else None
                hint = f" — {desc}" if desc else ""
                given = err.get("input")
                shown = (f"<a {type(given).__name__}, not shown: a secret>" if f"{section}.{field}" in SECRET_FIELDS
                         else repr(given))
                problems.append(f"{field}={shown} (from {origin}): {err['msg']}{hint}")
        raise ConfigError(f"invalid [{section}] config:\n  " + "\n  ".join(problems)) from None
