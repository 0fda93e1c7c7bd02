"""`tlt config show` and `tlt config check` (config_show.py, config_check.py): what a preset sets, and every knob
there is, without reading the source.

    tlt config show [--preset P] [--set section.field=value ...] [SECTION ...]
    tlt config check FILE

`show` prints every field of the named sections (default: all of them) as valid TOML, resolved through the
layers the services use (model defaults -> preset -> TLT_<SECTION>__<FIELD> environment -> --set), each field
after a comment with its description and, when the value is not the default, where it comes from. The output is
itself a preset: `tlt config show > my.toml`, edit, `tlt run --preset my.toml`. TOML has no null, so a field that
is unset (None) is printed commented out as `# field = (unset)`; leaving it out keeps it unset.

`check` loads every section of a preset file with its config class (unknown sections, unknown fields, bad
values), the environment left out, and starts nothing.

SECTION_CLASSES is the one map of a preset's sections to their config classes (the sections `tlt run` reads,
launcher.SECTIONS). Classes are named as strings: the parser imports the command modules, and the services'
configs import more than argparse needs.
"""

from __future__ import annotations

import importlib
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tlt.services.common.config import SECRET_FIELDS

if TYPE_CHECKING:
    from tlt.services.common.config import ServiceConfig

# section -> "module:Class"; nested sections ([rollout.engine], [rollout.spec]) are fields of their parent's class
SECTION_CLASSES: dict[str, str] = {
    "run": "tlt.services.trainer.run_config:RunConfig",
    "rollout": "tlt.services.rollout.config:RolloutConfig",
    "sglang": "tlt.services.rollout.sglang_backend.config:SGLangBackendConfig",
    "reward": "tlt.services.reward.config:RewardConfig",
    "drafter": "tlt.services.drafter.config:DrafterServiceConfig",
    "trainer": "tlt.services.trainer.config:TrainerConfig",
}

UNSET = "(unset)"
ORIGINS = ("preset {preset}", "environment {var}", "--set")  # the comment of a value from each layer, in order
WIDTH = 116  # comment lines wrap here


def unknown_section(name: str, bracket: bool = False, note: str = "") -> str:
    """"unknown section 'x'; the sections are run, ... (note); did you mean 'rollout'?" (`bracket`: [x], [rollout]),
    the guess only where a section is close: what every refusal of a section name says."""
    from tlt.services.common.config import closest

    shown = (lambda s: f"[{s}]") if bracket else repr
    guess = f"; did you mean {shown(close)}?" if (close := closest(name, SECTION_CLASSES)) else ""
    return (f"unknown section {shown(name)}; the sections are {', '.join(SECTION_CLASSES)}"
            f"{f' ({note})' if note else ''}{guess}")


def config_class(section: str) -> type[ServiceConfig]:
    module, name = SECTION_CLASSES[section].split(":")
    return getattr(importlib.import_module(module), name)


def section_overrides(pairs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """`--set section.field=value` pairs as {section: {field: value}}, a dotted field nested
    (`rollout.engine.max_num_seqs=32` -> {"rollout": {"engine": {"max_num_seqs": 32}}}) in a KeyedTable: a nested
    section's field, or one key of a dict-valued field (`sglang.adaptive_steps.1=[1, 3]`, the other keys kept)."""
    from tlt.services.common.config import ConfigError, KeyedTable, cli_overrides

    out: dict[str, dict[str, Any]] = {}
    for key, value in cli_overrides(pairs).items():
        section, _, field = key.partition(".")
        if not field:
            raise ConfigError(f"--set {key}=...: name the section, SECTION.FIELD=VALUE (e.g. trainer.lr=3e-5)")
        if section not in SECTION_CLASSES:
            raise ConfigError(f"--set {key}=...: "
                              + unknown_section(section, note="nested: rollout.engine.FIELD, rollout.spec.FIELD"))
        *path, leaf = field.split(".")
        node = out.setdefault(section, {})
        for part in path:
            node = node.setdefault(part, KeyedTable())
            if not isinstance(node, KeyedTable):
                raise ConfigError(f"--set {key}=...: {part!r} is given whole by another --set; give it whole or "
                                  "key by key")
        if isinstance(node.get(leaf), KeyedTable):
            raise ConfigError(f"--set {key}=...: {leaf!r} is given key by key by another --set; give it whole or "
                              "key by key")
        node[leaf] = value
    return out


def origins(cls: type[ServiceConfig], layers: Sequence[Mapping[str, Any]],
            path: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Field path -> the index of the last of `layers` (this section's tables, in load_config's order) that sets
    it; a field no layer sets is the default, and absent."""
    from tlt.services.common.config import nested_section

    out: dict[tuple[str, ...], int] = {}
    for name, field in cls.model_fields.items():
        if (nested := nested_section(field)) is not None:  # each layer's [section.name] table, or nothing
            sub = [layer[name] if isinstance(layer.get(name), Mapping) else {} for layer in layers]
            out.update(origins(nested, sub, (*path, name)))
            continue
        for i, layer in enumerate(layers):
            if name in layer:
                out[(*path, name)] = i
    return out


def _toml_string(s: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
    return '"' + "".join(escapes.get(c, c if c >= " " and c != "\x7f" else f"\\u{ord(c):04x}") for c in s) + '"'


def toml_value(v: Any) -> str:
    """A config value as a TOML literal (scalars, arrays, and inline tables for dict-valued fields)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # floats: 1e-06, 0.5, inf, nan are TOML as Python writes them
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_string(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as a TOML value")


def _comment(text: str) -> list[str]:
    """`text` as comment lines; wrapped at spaces only, so the lines joined by a space are the text again."""
    lines = textwrap.wrap(" ".join(text.split()), WIDTH, break_long_words=False, break_on_hyphens=False)
    return [f"# {line}" for line in lines]


def render(cfg: ServiceConfig, table: str, where: Mapping[tuple[str, ...], str], path: tuple[str, ...] = ()) -> str:
    """`cfg` as the TOML table [table]: every field after its description comment (and origin, unless it is the
    default); nested config fields follow as [table.field]."""
    from tlt.services.common.config import nested_section

    lines = [f"[{table}]"]
    nested: list[str] = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        if nested_section(field) is not None:
            nested.append("\n\n" + "\n".join(_comment(field.description or "")) + "\n"
                          + render(value, f"{table}.{name}", where, (*path, name)))
            continue
        lines += ["", *_comment(field.description or "")] if len(lines) > 1 else _comment(field.description or "")
        if (*path, name) in where:
            lines.append(f"# from {where[(*path, name)]}")
        if value and ".".join((table, name)) in SECRET_FIELDS:  # a terminal, CI log or pasted issue is no place for it
            lines.append(f"# {name} = (set, {len(str(value))} characters; not shown)")
        else:
            lines.append(f"# {name} = {UNSET}" if value is None else f"{name} = {toml_value(value)}")
    return "\n".join(lines) + "\n" + "".join(nested)


def show(preset: str, overrides: Sequence[str], sections: Sequence[str]) -> str:
    """The TOML text of `tlt config show` (ConfigError: a bad preset, --set or environment value)."""
    from tlt.services.common.config import env_overrides, env_prefix, load_config, read_preset

    sets = section_overrides(overrides)
    whole = read_preset(preset)
    head = (f"tlt config show --preset {preset}: every field, after its description; a value that is not the "
            f"default says where it comes from. A field that is unset (None) is commented out: `# field = {UNSET}`.")
    out = ["\n".join(_comment(head))]
    for section in dict.fromkeys(sections or SECTION_CLASSES):  # a section named twice is one TOML table
        cls = config_class(section)
        cfg = load_config(cls, section, preset, sets.get(section, {}))
        layers = [whole.get(section, {}), env_overrides(section), sets.get(section, {})]  # load_config's order
        where = {path: ORIGINS[i].format(preset=preset, var=env_prefix(section) + "__".join(path).upper())
                 for path, i in origins(cls, layers).items()}
        out.append(render(cfg, section, where))
    return "\n\n".join(out)


def context_problem(trainer: Any, rollout: Any, limit: int | None = None) -> str | None:
    """Why no prompt can be rolled out with these [trainer] and [rollout] configs, or None: max_tokens at or above
    the native engine's max_model_len leaves no room for a prompt, and the rollout refuses every request of the
    first step (context_length_exceeded), after every service has started. max_model_len 0 (the model's own) and
    other backends are known only once the model is loaded: `limit` is then the context length the caller read
    from the model."""
    if limit is None:
        limit = rollout.engine.max_model_len if rollout.backend == "native" else 0
    if limit <= 0 or trainer.max_tokens < limit:
        return None
    return (f"[trainer] max_tokens={trainer.max_tokens} leaves no room for a prompt under [rollout.engine] "
            f"max_model_len={limit}: the rollout would refuse every request; lower max_tokens or raise max_model_len")


def push_dtype_problem(trainer: Any, rollout: Any) -> str | None:
    """Why the trainer's weight pushes would be refused by the native engine, or None: the pushed dtype (push_dtype,
    "auto" following [trainer] bf16) must be the engine's own; each tensor of another dtype is refused at the first
    push, after every service has started. bf16 unset ("auto" then follows the trainer's device) is not known here."""
    if trainer.weight_push == "none" or rollout.backend != "native":
        return None
    if trainer.push_dtype != "auto":
        pushed = trainer.push_dtype
    elif trainer.bf16 is None:
        return None
    else:
        pushed = "bfloat16" if trainer.bf16 else "float32"
    served = rollout.engine.dtype
    if pushed == served:
        return None
    why = f" (bf16 = {str(trainer.bf16).lower()})" if trainer.push_dtype == "auto" else ""
    return (f'[trainer] push_dtype="{trainer.push_dtype}" pushes {pushed} weights{why} but [rollout.engine] '
            f'dtype="{served}": the rollout would refuse every weight push; set trainer.push_dtype = "{served}" or '
            f'rollout.engine.dtype = "{pushed}"')


def check(file: str) -> int:
    """The number of sections in `file`, every one valid; ConfigError naming every problem otherwise."""
    from tlt.services.common.config import ConfigError, load_config, preset_path, read_preset

    whole = read_preset(file)
    problems = [unknown_section(s, bracket=True) for s in whole if s not in SECTION_CLASSES]
    loaded: dict[str, Any] = {}
    for section in (s for s in whole if s in SECTION_CLASSES):
        try:
            loaded[section] = load_config(config_class(section), section, file, environ={})
        except ConfigError as e:
            problems.append(str(e))
    if not problems and ("trainer" in whole or "rollout" in whole):
        trainer = loaded.get("trainer") or load_config(config_class("trainer"), "trainer", None, environ={})
        rollout = loaded.get("rollout") or load_config(config_class("rollout"), "rollout", None, environ={})
        problems += [p for p in (context_problem(trainer, rollout), push_dtype_problem(trainer, rollout)) if p]
    if problems:
        raise ConfigError("\n".join(f"{preset_path(file)}: {p}" for p in problems))
    return len(whole)
