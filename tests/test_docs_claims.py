"""README.md and docs/*.md name only things the code has.

The project promises docs that match the code, and names drift: a flag renamed, a config field
moved, a test split. Each check below reads the pages the way a reader would copy from them and asks
the code itself, so a stale name fails here instead of in a user's shell:

- every `tlt ...` command line (inline or in a code block) names a real command, and its options are
  options of that command (with a valid value where the option has a type or choices); code-block
  lines, which readers paste whole, parse with the real argument parser; BENCHMARKS.md's command lines
  too (its reproduce commands), though none of its other names;
- every `--set KEY=VALUE` key, `[section] field` (and the fields listed after one) and
  `TLT_<SECTION>__<FIELD>` variable names a field of the typed config it sets (nested sections
  included), and "`[section] field`, default X" quotes the config's default;
- every repository path, `path/module.function(...)`, `tlt.x.y` Python name, `OurClass.method`,
  `test_x.py::test_y`,
  `tlt.v1.Service/Method` (proto) and Prometheus metric with a `_total` / `_seconds` suffix, a label
  set or a `_*` wildcard exists; every `make X` is a Makefile target.

docs/design/ is a verbatim copy of the design documents (the paper's view, not this code's), so it is
not checked. `test_the_checks_catch_broken_lines` feeds each check a deliberately wrong line: a check
that cannot fail would pass every page.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import shlex
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_deploy_docs import SECTIONS, config_class  # preset section -> its config class

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]
# BENCHMARKS.md records what each session ran and read, under that session's names (a class or test renamed since
# stays as it was then), so only its `tlt ...` commands are checked: a reader copies those to reproduce a figure,
# and one that no longer parses says in place which command is today's equivalent.
COMMAND_PAGES = [*PAGES, ROOT / "BENCHMARKS.md"]

TOP_DIRS = ("services", "tlt", "kernels", "deploy", "docs", "tests", "proto")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|<|\*|^\.\.\.$")  # FILE, N, runs/<id>, ...: a value the reader fills in


# -- reading a page ---------------------------------------------------------------------------------


def code_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of fenced (```) and indented (4 spaces after a blank line) code blocks,
    with `\\` continuations joined onto the first line."""
    fenced = indented = False
    prev_blank = True
    pending: tuple[int, str] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            prev_blank = False
            continue
        if not fenced:
            if line.startswith("    ") and (prev_blank or indented):
                indented = True
            elif line.strip():
                indented = False
        prev_blank = not line.strip()
        if not (fenced or indented) or not line.strip():
            continue
        if pending is not None:
            n, line = pending[0], pending[1] + " " + line.strip()
        if line.rstrip().endswith("\\"):
            pending = (n, line.rstrip()[:-1])
            continue
        pending = None
        yield n, line.strip()


def prose(text: str) -> str:
    """The page without its fenced code blocks (indented blocks stay: they hold no backticks)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)


def spans(text: str) -> Iterator[tuple[int, str]]:
    """(line number, content) of inline code spans, a span broken over two lines joined by one space."""
    body = prose(text)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", body):
        yield body.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())


# -- config fields -----------------------------------------------------------------------------------


def field_problem(section: str, path: list[str]) -> str | None:
    """None when [section] has the (nested) field `path`, else what is wrong."""
    if section not in SECTIONS:
        return f"no preset section [{section}] (known: {', '.join(sorted(SECTIONS))})"
    cls, where = config_class(section), section
    for i, part in enumerate(path):
        if part not in cls.model_fields:
            return f"[{where}] has no field {part!r}"
        if i < len(path) - 1:
            annotation = cls.model_fields[part].annotation
            if typing.get_origin(annotation) is dict and i == len(path) - 2:
                return None  # one key of a map field (`TLT_SGLANG__ADAPTIVE_STEPS__1`: config.py's env rules)
            cls = annotation
            if not hasattr(cls, "model_fields"):
                return f"[{where}] {part!r} is a value, not a section"
            where += f".{part}"
    return None


def set_problem(key: str, section: str | None) -> str | None:
    """A `--set` key: SECTION.FIELD... (`tlt run`, section None) or a field of `section`."""
    if key.lower() in ("field", "section.field") or PLACEHOLDER.search(key):
        return None
    parts = key.split(".")
    if section is None:
        if len(parts) < 2:
            return f"--set {key}: `tlt run` overrides name SECTION.FIELD"
        return field_problem(parts[0], parts[1:])
    return field_problem(section, parts)


# -- tlt command lines -------------------------------------------------------------------------------


def tlt_args(line: str) -> list[str] | None:
    """The arguments after `tlt` (or `deepspeed ... --module tlt.cli`) in a shell line; None if no tlt."""
    line = re.sub(r"\[(--[^\]]*)\]", r"\1", line)  # [--problems 64]: optional, still an option to check
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return None
    for i, t in enumerate(tokens):
        if t in ("tlt", ".venv/bin/tlt"):
            return [x for x in tokens[i + 1 :] if x != "..."]
        if t == "--module" and tokens[i + 1 : i + 2] == ["tlt.cli"]:
            return [x for x in tokens[i + 2 :] if x != "..."]
    return None


@functools.cache
def command_parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    from tlt.cli import COMMANDS

    (cmd,) = [c for c in COMMANDS if c.path == path]
    parser = argparse.ArgumentParser(prog="tlt " + " ".join(path), exit_on_error=False)
    # every command also takes --log-json after its name (tlt.cli.build_parser), unlisted in its help
    parser.add_argument("--log-json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    importlib.import_module(cmd.module).add_arguments(parser)
    return parser


@functools.cache
def top_options() -> dict[str, argparse.Action]:
    """`tlt`'s own options, given before the command (`tlt --log-level debug run`)."""
    from tlt.cli import build_parser

    return dict(build_parser(())._option_string_actions)


def _strip_top_options(args: list[str]) -> list[str]:
    """The arguments from the command on: `tlt --log-json --log-level debug run ...` -> `run ...`."""
    top = top_options()
    while args and args[0] not in ("-h", "--help", "--version") and args[0].split("=", 1)[0] in top:
        takes_value = top[args[0].split("=", 1)[0]].nargs != 0 and "=" not in args[0]
        args = args[2 if takes_value else 1 :]
    return args


def override_section(action: argparse.Action) -> str | None:
    """What a `--set`-like option overrides: None for SECTION.FIELD keys, else the [section] its help names."""
    if str(action.metavar).startswith("SECTION."):
        return None
    m = re.search(r"\[(\w+)\]", action.help or "")
    assert m, f"{action.option_strings}: its help names no [section]"
    return m.group(1)


def command_problems(args: list[str], whole: bool) -> list[str]:
    """What is wrong with `tlt <args>`; `whole`: the line is meant to run as written (parse it all)."""
    from tlt.cli import COMMANDS

    given, args = args, _strip_top_options(args)
    if args and args != given and PLACEHOLDER.search(args[0]):  # `tlt --log-json COMMAND`: any command
        return []
    if not args or args[0].startswith("-"):
        return [] if args in (["--help"], ["-h"]) else [f"tlt {' '.join(given)}: no command"]
    if "/" in args:  # `tlt drafter warmup / serve / worker / export`: a list of subcommands
        group, names = args[0], args[1::2]
        known = {c.path for c in COMMANDS}
        return [f"tlt {group} {n}: no such command" for n in names if (group, n) not in known]
    paths = [c.path for c in COMMANDS if tuple(args[: len(c.path)]) == c.path]
    if not paths:
        return [f"tlt {' '.join(args[:2])}: no such command"]
    path = max(paths, key=len)
    parser = command_parser(path)
    options = parser._option_string_actions
    problems = []
    rest = args[len(path) :]
    for i, tok in enumerate(rest):
        if not tok.startswith("--"):
            continue
        name, _, inline = tok.partition("=")
        action = options.get(name)
        if action is None:
            problems.append(f"tlt {' '.join(path)}: no option {name}")
            continue
        if action.nargs == 0:
            continue
        value = inline or (rest[i + 1] if i + 1 < len(rest) and not rest[i + 1].startswith("--") else None)
        if value is None or PLACEHOLDER.search(value):
            continue
        if action.choices is not None and value not in action.choices:
            problems.append(f"tlt {' '.join(path)} {name} {value}: not one of {sorted(action.choices)}")
        elif action.type is not None and callable(action.type):
            try:
                action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                problems.append(f"tlt {' '.join(path)} {name} {value}: not a valid value")
        if (name == "--set" or name.endswith("-set")) and (p := set_problem(value.split("=", 1)[0], override_section(action))):
            problems.append(p)
    if whole and not problems:
        try:
            parser.parse_args(rest)
        except (argparse.ArgumentError, SystemExit) as e:
            problems.append(f"tlt {' '.join(args)}: does not parse ({e})")
    return problems


def page_command_problems(text: str) -> list[str]:
    out = []
    for n, line in code_lines(text):
        if (args := tlt_args(line)) is not None:
            out += [f"line {n}: {p}" for p in command_problems(args, whole=True)]
    for n, span in spans(text):
        if span.startswith(("tlt ", ".venv/bin/tlt ")) or "--module tlt.cli" in span:
            args = tlt_args(span)
            out += [f"line {n}: {p}" for p in command_problems(args or [], whole=False)]
        elif span.startswith("--set "):  # prose example of `tlt run --set` (or of a service's --set field=value)
            key = span.split(None, 1)[1].split("=", 1)[0]
            p = set_problem(key, None) if "." in key else None
            out += [f"line {n}: `{span}`: {p}"] if p else []
        elif span.startswith("--") and (p := option_problem(span)):  # `--pairs K`, `--clock cpu` in prose
            out.append(f"line {n}: `{span}`: {p}")
    return out


# options of other tools that the pages quote: DeepSpeed's launcher, docker compose, docker run, pytest
FOREIGN_OPTIONS = {"--master_addr", "--module", "--no_ssh", "--node_rank", "--num_gpus", "--env-file", "--cpus",
                   "--junitxml"}


def option_problem(span: str) -> str | None:
    """A lone option in prose (its command is somewhere in the sentence): some tlt command has it, and
    takes the value shown when it has choices."""
    from tlt.cli import COMMANDS, _available

    name, *value = span.split()
    name = name.split("=", 1)[0]
    if name in FOREIGN_OPTIONS:
        return None
    actions = [a for c in COMMANDS if _available(c)
               for o, a in command_parser(c.path)._option_string_actions.items() if o == name]
    actions += [a for o, a in top_options().items() if o == name]  # `--log-level`: tlt's own
    if not actions:
        return f"no tlt command has an option {name}"
    if value and not PLACEHOLDER.search(value[0]) and all(a.choices is not None and value[0] not in a.choices
                                                          for a in actions):
        return f"{name} {value[0]}: not one of its choices"
    return None


# -- config mentions -------------------------------------------------------------------------------


def _literal(text: str):
    """A value as the page writes it, read the way --set reads one (a TOML literal; on/off as booleans)."""
    from tlt.services.common.config import _parse_literal

    return {"on": True, "off": False}.get(text, _parse_literal(text))


def page_config_problems(text: str) -> list[str]:
    out = []
    for n, span in spans(text):
        m = re.match(r"^\[([a-z]+(?:\.[a-z]+)*)\](?:\s+([a-z_][a-z0-9_]*))?", span)
        if m and m.group(1) != "section":  # `[section]`: the word, not a section
            section, *nested = m.group(1).split(".")
            path = nested + ([m.group(2)] if m.group(2) else [])
            if p := (field_problem(section, path) if path else field_problem(section, [])):
                out.append(f"line {n}: `{span}`: {p}")
    body = prose(text)
    # `[trainer] eval_problems`, `eval_interval`, `eval_samples`: the fields listed after one are of its section
    for m in re.finditer(r"`\[([a-z]+(?:\.[a-z]+)*)\]\s+[a-z_]+[^`]*`((?:\s*(?:,|/|or|and)\s*`[a-z_]+`)+)", body):
        section, *nested = m.group(1).split(".")
        for field in re.findall(r"`([a-z_]+)`", m.group(2)):
            if p := field_problem(section, [*nested, field]):
                out.append(f"line {body.count(chr(10), 0, m.start()) + 1}: `{field}` (after `[{m.group(1)}]`): {p}")
    # `[rollout] max_restarts`, default 5 / `[reward] max_unsent_per_stream` (default 1024): the model's default
    for m in re.finditer(r"`\[([a-z]+(?:\.[a-z]+)*)\]\s+([a-z_]+)`\s*[,(]\s*default\s+([\w.+-]+)", body):
        section, *nested = m.group(1).split(".")
        if field_problem(section, [*nested, m.group(2)]) is None:
            cls = config_class(section)
            for part in nested:
                cls = cls.model_fields[part].annotation
            default = cls.model_fields[m.group(2)].get_default(call_default_factory=True)
            if _literal(m.group(3)) != default:
                out.append(f"line {body.count(chr(10), 0, m.start()) + 1}: [{m.group(1)}] {m.group(2)}: the page "
                           f"says default {m.group(3)}, the config {default!r}")
    for m in re.finditer(r"\bTLT_([A-Z]+)__([A-Z0-9_]*[A-Z0-9])\b(?!\*)", body):
        n = body.count("\n", 0, m.start()) + 1
        if p := field_problem(m.group(1).lower(), m.group(2).lower().split("__")):
            out.append(f"line {n}: {m.group(0)}: {p}")
    return out


# -- names of files, code, tests, protos, metrics, make targets --------------------------------------


def _proto_names() -> tuple[set[str], dict[str, set[str]]]:
    messages, services = set(), {}
    for path in (ROOT / "proto" / "tlt" / "v1").glob("*.proto"):
        src = path.read_text()
        messages |= set(re.findall(r"^\s*(?:message|enum)\s+(\w+)", src, flags=re.M))
        for m in re.finditer(r"^service\s+(\w+)\s*\{(.*?)^\}", src, flags=re.M | re.S):
            services[m.group(1)] = set(re.findall(r"rpc\s+(\w+)\s*\(", m.group(2)))
    return messages, services


def _metric_names() -> tuple[set[str], set[str]]:
    """(namespaces, metric names) registered through services/common/metrics.Metrics anywhere in the code."""
    spaces, names = set(), set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "tlt").rglob("*.py")]:
        src = path.read_text()
        spaces |= set(re.findall(r"Metrics\(\"(\w+)\"\)", src))
        names |= set(re.findall(r"\.(?:counter|gauge|histogram)\(\s*\"(\w+)\"", src))
    return spaces, names


def _metric_exists(name: str, tail: str | None, spaces: set[str], names: set[str]) -> bool:
    """`rollout_rejected_total{reason}`: namespace + a registered name (a counter's `_total` is optional);
    `rollout_spec_*` (tail "_*"): some metric's full name starts with `rollout_spec`."""
    for ns in spaces:
        rest = name[len(ns) + 1 :] if name.startswith(ns + "_") else None
        if tail == "_*":
            if ns.startswith(name) or rest is not None and any(x.startswith(rest) for x in names):
                return True
        elif rest is not None and (rest in names or rest.removesuffix("_total") in names):
            return True
    return False


def _python_name_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts if rel.parts[0] == "tlt" else ("tlt", *rel.parts))


@functools.cache
def _classes() -> dict[str, list[str]]:
    """Class name -> the modules of this repository that define it (services/ and kernels/ import as tlt.*)."""
    out: dict[str, list[str]] = {}
    for folder in ("services", "tlt", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r"^class (\w+)", path.read_text(), flags=re.M):
                out.setdefault(name, []).append(_module_of(path))
    return out


# class names ours share with code the pages quote: SGLang's `Scheduler.flush_cache` (docs/DEPLOY.md)
FOREIGN_CLASSES = {"Scheduler"}


def _method_problem(cls_name: str, attr: str) -> str | None:
    """`SpecDecoder.forget`: None when a class of ours by that name has the attribute (inherited ones too);
    a class we do not define (SGLang's `Scheduler`) is not ours to check."""
    modules = _classes().get(cls_name)
    if not modules or cls_name in FOREIGN_CLASSES:
        return None
    for module in modules:
        if hasattr(getattr(importlib.import_module(module), cls_name), attr):
            return None
    return f"{cls_name} ({', '.join(modules)}) has no attribute {attr!r}"


def _test_exists(file: str, name: str) -> bool:
    for folder in (ROOT / "tests", ROOT / "tests" / "reliability"):
        path = folder / Path(file).name
        if path.is_file() and re.search(rf"^(?:async )?def {name}\(", path.read_text(), flags=re.M):
            return True
    return False


def page_name_problems(text: str) -> list[str]:
    out = []
    body = prose(text)
    messages, services = _proto_names()
    spaces, metric_names = _metric_names()
    makefile = (ROOT / "Makefile").read_text()
    for m in re.finditer(rf"(?<![\w/.$-])((?:{'|'.join(TOP_DIRS)})/[A-Za-z0-9_./*<>{{}}-]*)", body):
        n, rel = body.count("\n", 0, m.start()) + 1, m.group(1).rstrip(".-")
        if re.search(r"[*<{]", rel):  # services/<name>/config.py, tests/test_kernels_*.py: a pattern
            continue
        fn = re.match(r"(.+)\.(\w+)\($", rel + body[m.end() : m.end() + 1])  # services/x/y.func(...)
        if fn:
            src = ROOT / f"{fn.group(1)}.py"
            if not src.is_file() or not re.search(rf"^def {fn.group(2)}\(", src.read_text(), flags=re.M):
                out.append(f"line {n}: {rel}(...): no function {fn.group(2)} in {fn.group(1)}.py")
        elif not (ROOT / rel.rstrip("/")).exists():
            out.append(f"line {n}: {rel} does not exist")
    for m in re.finditer(r"(?:tests/(?:reliability/)?)?(test_\w+\.py)::(\w+)", body):
        if not _test_exists(m.group(1), m.group(2)):
            out.append(f"line {body.count(chr(10), 0, m.start()) + 1}: no test {m.group(0)}")
    for n, span in spans(text):
        if re.fullmatch(r"tlt(?:\.(?!v1\.)\w+)+", span) and not _python_name_exists(span):
            out.append(f"line {n}: `{span}` is no Python name")
        if m := re.fullmatch(r"tlt\.v1\.(\w+)(?:/(\w+))?", span):
            svc, rpc = m.groups()
            if svc not in services and (rpc or svc not in messages):
                out.append(f"line {n}: `{span}`: no service or message {svc} in proto/tlt/v1/")
            elif rpc and rpc not in services.get(svc, ()):
                out.append(f"line {n}: `{span}`: service {svc} has no rpc {rpc}")
        if (m := re.fullmatch(r"([A-Z]\w+)\.([A-Z]\w+)", span)) and m.group(1) in services:
            if m.group(2) not in services[m.group(1)]:
                out.append(f"line {n}: `{span}`: service {m.group(1)} has no rpc {m.group(2)}")
        elif (m := re.fullmatch(r"([A-Z]\w+)\.([a-z_]\w*)(?:\(.*\))?", span)) and (p := _method_problem(*m.groups())):
            out.append(f"line {n}: `{span}`: {p}")
        if m := re.fullmatch(r"([a-z][a-z0-9_]*?)(_\*|\{[^}]*\})?", span):
            if (m.group(2) or m.group(1).endswith(("_total", "_seconds"))) and not _metric_exists(*m.groups(), spaces,
                                                                                                  metric_names):
                out.append(f"line {n}: `{span}`: no such metric (namespaces {sorted(spaces)})")
        if m := re.fullmatch(r"make ([a-z][a-z-]*)", span):
            if not re.search(rf"^{re.escape(m.group(1))}:", makefile, flags=re.M):
                out.append(f"line {n}: `{span}`: no Makefile target {m.group(1)}")
    for n, line in code_lines(text):
        if (m := re.match(r"make ([a-z][a-z-]*)", line)) and not re.search(rf"^{m.group(1)}:", makefile, flags=re.M):
            out.append(f"line {n}: `{line}`: no Makefile target {m.group(1)}")
    return out


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=[str(p.relative_to(ROOT)) for p in COMMAND_PAGES])
def test_tlt_command_lines_match_the_cli(page: Path) -> None:
    problems = page_command_problems(page.read_text())
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_config_sections_fields_and_env_variables_exist(page: Path) -> None:
    problems = page_config_problems(page.read_text())
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_named_files_code_tests_protos_metrics_and_targets_exist(page: Path) -> None:
    problems = page_name_problems(page.read_text())
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


BROKEN = [  # (checker, a wrong line): each must be reported
    (page_command_problems, "`tlt rollout serve --model DIR --replica 2`"),  # option misspelt
    (page_command_problems, "`tlt drafter warmup / serve / train`"),  # no `tlt drafter train`
    (page_command_problems, "`tlt bench rollout --clock gpu`"),  # not a choice
    (page_command_problems, "`tlt drafter warmup --model M --out D --epochs 0`"),  # its type's ArgumentTypeError
    (page_command_problems, "`tlt --log-level debug rollout serve --replica 2`"),  # after tlt's own options
    (page_command_problems, "`tlt --log-json`"),  # tlt's own option, no command
    (page_command_problems, "`--log-levels`"),
    (page_command_problems, "`tlt run --set trainer.learning_rate=3e-5`"),  # no such field
    (page_command_problems, "`tlt rollout serve --set spec.treshold=8`"),  # nested field misspelt
    (page_command_problems, "`--set rollout.spec.thresold=8`"),  # prose example of tlt run --set
    (page_command_problems, "`tlt bench e2e` ... `--pair K`"),  # a lone option no command has
    (page_command_problems, "`--clock gpu`"),  # a lone option's value outside its choices
    (page_command_problems, "    tlt drafter worker --model M --replica 1\n"),  # code line: --coordinator missing
    (page_config_problems, "`[trainer] eval_problem`"),
    (page_config_problems, "`[rollout.spec] arms`"),
    (page_config_problems, "`[drafter]\nworker_niceness`"),  # a span broken over two lines
    (page_config_problems, "set TLT_ROLLOUT__SPEC__THRESHHOLD=8"),
    (page_config_problems, "at most `[rollout] max_restarts`, default 3)"),  # a default that is not the config's
    (page_config_problems, "`[trainer] eval_problems`, `eval_interval`,\n`eval_sample`"),  # a listed field
    (page_name_problems, "see `services/common/cpu.py`"),
    (page_name_problems, "(see services/common/cpus.py and docs/DEPLOYMENT.md)."),  # a path in prose
    (page_name_problems, "`services/common/cpus.cpu_groups(i, threads)`"),
    (page_name_problems, "`test_auth.py::test_update_weights_needs_a_token`"),
    (page_name_problems, "`tlt.services.rollout.client.RolloutClients`"),
    (page_name_problems, "`tlt.v1.Rollout/PushWeights`"),
    (page_name_problems, "`Reward.Scores`"),
    (page_name_problems, "`SpecDecoder.forgets`"),  # a method of one of our classes
    (page_name_problems, "`rollout_refused_total{reason}`"),
    (page_name_problems, "`rollout_speculation_*`"),
    (page_name_problems, "`make tests`"),
]


@pytest.mark.parametrize("check,line", BROKEN, ids=[line.strip()[:50] for _, line in BROKEN])
def test_the_checks_catch_broken_lines(check, line: str) -> None:
    assert check("Some text.\n\n" + line + "\n"), f"{check.__name__} let a wrong line through: {line!r}"
