"""`tlt <command> --help` says what an option does when it is left out: an option with a default shows it
(`tlt model eval --help` said only "--n N  held-out problems", and a user had to read the source to learn it was 200).
"""

from __future__ import annotations

import argparse

from tlt.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + (name,), sub
                yield from _subparsers(sub, path + (name,))


def test_every_option_with_a_default_shows_it_in_its_help() -> None:
    missing = []
    for path, sub in _subparsers(build_parser()):
        text = "".join(sub.format_help().split())  # argparse wraps lines at spaces and after hyphens
        for a in sub._actions:
            if not a.option_strings or a.help in (None, argparse.SUPPRESS) or "default" in a.help:
                continue
            if a.default is None or a.default is False or a.default is argparse.SUPPRESS or a.default in ("", []):
                continue  # nothing to show: off, unset, or the help says what leaving it out means
            default = " ".join(map(str, a.default)) if isinstance(a.default, (list, tuple)) else a.default
            shown = "".join(f"{a.help} (default: {default})".replace("%%", "%").split())
            if shown not in text:
                missing.append(f"tlt {' '.join(path)} {a.option_strings[-1]}")
    assert not missing, missing


def test_model_eval_help_names_its_defaults() -> None:
    sub = dict(_subparsers(build_parser()))[("model", "eval")]
    text = " ".join(sub.format_help().split())
    assert "--n N held-out problems (default: 200)" in text, text
    assert "--model MODEL Hugging Face checkpoint folder (e.g. artifacts/tiny) --n" in text  # required: no default
    # a flag (store_true) shows no "(default: False)": off is what leaving it out means
    assert "--json print the report as one JSON object" in text and "(default: False)" not in text


def test_version_prints_the_installed_version(capsys) -> None:
    # `tlt --version` answered "the following arguments are required: COMMAND", exit 2
    from importlib.metadata import version

    from tlt.cli import main

    import pytest

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tlt {version('tlt')}"


def test_rollout_serve_help_names_the_ports_and_replicas_it_uses_by_default() -> None:
    # their default is the preset's (None in argparse), so the help said only "(0: a free one)"
    sub = dict(_subparsers(build_parser()))[("rollout", "serve")]
    text = " ".join(sub.format_help().split())
    for words in ("replicas, one process each (default: the preset's; 1 in cpu-tiny)",
                  "(0: a free one; default: the preset's, 8000)", "(0: a free one; default: the preset's, 50051)"):
        assert words in text, words


def test_every_option_says_what_it_does() -> None:
    """`tlt drafter warmup --help` listed a bare `--seed SEED`, with neither what it seeds nor its default."""
    bare = [f"tlt {' '.join(path)} {a.option_strings[-1]}" for path, sub in _subparsers(build_parser())
            for a in sub._actions if a.option_strings and a.help is None]
    assert not bare, bare
