"""Every `tlt bench` refuses a count that would crash it later (0, negative, too small) at argument parsing:
an argparse usage error naming the option, exit status 2, before any model is built or server started.

`tlt bench drafter-drift --updates 0` ended in an IndexError after the whole run and `--length 1` in a
ZeroDivisionError; the other benches had the same class of late crash (e.g. `--threads 0`: torch
refuses 0 threads; `--pairs 0`: ValueError; `--preemptions 0`: the max of no latencies). The real
`tlt` parser is used (the one `tlt bench ...` builds), nothing runs past parsing.
"""

from __future__ import annotations

import pytest

from tlt.cli import COMMANDS, build_parser

# (bench, option, refused values, the smallest accepted value)
BAD = [
    ("drafter-drift", "--updates", ["0", "-1"], "1"),
    ("drafter-drift", "--length", ["1", "0", "-5"], "2"),
    ("drafter-drift", "--rollouts", ["0"], "1"),
    ("drafter-drift", "--depth", ["0"], "1"),
    ("drafter-drift", "--policy-steps", ["-1"], "0"),
    ("drafter-drift", "--drafter-steps", ["-1"], "0"),
    ("drafter-drift", "--warmup-steps", ["-1"], "0"),
    ("engine", "--batch-sizes", ["0", "1,0", "4,-2", "", "1,x"], "1"),
    ("engine", "--max-tokens", ["0"], "1"),
    ("engine", "--prompt-len", ["0"], "1"),
    ("engine", "--threads", ["0", "-1"], "1"),
    ("rollout", "--prompts", ["0"], "1"),
    ("rollout", "--n", ["0"], "1"),
    ("rollout", "--prompt-len", ["0"], "1"),
    ("rollout", "--median-tokens", ["0"], "1"),
    ("rollout", "--max-tokens", ["0", "-3"], "1"),
    ("rollout", "--threshold", ["0"], "1"),
    ("rollout", "--threads", ["0"], "1"),
    ("e2e", "--steps", ["0", "-2"], "1"),
    ("e2e", "--pairs", ["0"], "1"),
    ("e2e", "--noise-seed", ["-2", "-100", "x"], "-1"),  # -1 skips the noise run; -2 was taken for -1 too
    ("kernels", "--arch", ["12", "0", "75", "100", "x"], "80"),  # CUDA capabilities the compile check cannot do
    ("drafter-preemption", "--preemptions", ["0"], "1"),
    ("drafter-preemption", "--batch-rows", ["0"], "1"),
    ("drafter-preemption", "--batch-tokens", ["7", "0"], "8"),  # the drafter service's smallest packed row
]


def _parser(bench: str):
    cmd = next(c for c in COMMANDS if c.path == ("bench", bench))
    return build_parser((cmd,))


@pytest.mark.parametrize("bench,option,values,smallest", BAD, ids=[f"{b}{o}" for b, o, _, _ in BAD])
def test_bench_refuses_bad_counts_at_parsing(bench, option, values, smallest, capsys):
    parser = _parser(bench)
    for value in values:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["bench", bench, f"{option}={value}"])
        assert e.value.code == 2, (option, value)
        err = capsys.readouterr().err
        assert f"argument {option}" in err and "must be" in err, err
    ns = parser.parse_args(["bench", bench, f"{option}={smallest}"])  # the limit itself is accepted
    assert getattr(ns, option.lstrip("-").replace("-", "_")) in (int(smallest), [int(smallest)])


def test_e2e_noise_seed_help_and_error_say_minus_one_skips(capsys):
    """`--noise-seed -1` skips the repeated baseline run; any other negative value did too, silently."""
    parser = _parser("e2e")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "e2e", "--noise-seed=-2"])
    assert "-1 to skip" in capsys.readouterr().err
    assert parser.parse_args(["bench", "e2e", "--noise-seed", "0"]).noise_seed == 0
    assert parser.parse_args(["bench", "e2e"]).noise_seed == 1


def test_kernels_compile_only_arch_is_checked_at_parsing(capsys):
    """`tlt bench kernels --compile-only --arch 12` aborted inside LLVM (and 100 or 120 ended in a ptxas traceback:
    the compile check runs the wheel's pre-Blackwell ptxas): refused at parsing now, naming the supported ones."""
    from tlt.kernels.bench import COMPILE_ARCHS

    parser = _parser("kernels")
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["bench", "kernels", "--compile-only", "--arch", "12"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --arch" in err and all(str(a) in err for a in COMPILE_ARCHS), err
    assert {80, 90} <= set(COMPILE_ARCHS)
    for arch in COMPILE_ARCHS:
        assert parser.parse_args(["bench", "kernels", "--compile-only", "--arch", str(arch)]).arch == arch
    assert parser.parse_args(["bench", "kernels"]).arch == 90
