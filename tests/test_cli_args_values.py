"""What tlt/cli_args.py's argparse `type`s hand on once a value is accepted: the number or the text as given.

tests/test_cli_errors.py and tests/test_bench_args.py pin what is refused and that the limits parse; here the
accepted values themselves are read back from the real `tlt` parser. Surviving mutants of a mutation audit:
positive_float / non_negative_float returning int(value) (a 0.5 s time budget run as 0, a 0.7 temperature as 0,
a 1e-3 learning rate as 0) and non_empty returning text.strip() (a name or path with a space at an end rewritten).
"""

from __future__ import annotations

from pathlib import Path

from tlt.cli import build_parser


def test_numbers_are_handed_on_as_given(tmp_path: Path) -> None:
    parser = build_parser()
    ns = parser.parse_args(["model", "build", "--out", str(tmp_path / "new"), "--time-budget", "0.5"])
    assert ns.time_budget == 0.5
    ns = parser.parse_args(["drafter", "warmup", "--model", str(tmp_path), "--out", str(tmp_path),
                            "--temperature", "0.7", "--noise", "0.25", "--lr", "1e-3"])
    assert (ns.temperature, ns.noise, ns.lr) == (0.7, 0.25, 1e-3)


def test_a_name_or_path_is_handed_on_as_typed(tmp_path: Path) -> None:
    """Only a blank value is refused; one with spaces at its ends is somebody's name or path, kept as typed."""
    parser = build_parser()
    assert parser.parse_args(["run", "--model", " my model "]).model == " my model "
    out = str(tmp_path / "run 1 ")
    assert parser.parse_args(["model", "build", "--out", out]).out == out
