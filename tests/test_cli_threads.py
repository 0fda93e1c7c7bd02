"""Which commands let OpenMP threads spin: the ones that own the cores (tlt/cli.py `owns_cores`).

The policy must be in the environment before torch is imported, so `main` decides it from the raw
arguments; these tests run `main` itself (up to `--help`) and read what it left in the environment.
"""

from __future__ import annotations

import os

import pytest

from tlt import cli


@pytest.mark.parametrize(
    "argv, path",
    [
        (["model", "build", "--out", "x"], ("model", "build")),
        (["--log-json", "rollout", "serve", "--model", "m"], ("rollout", "serve")),
        (["--log-level", "debug", "model", "build"], ("model", "build")),
        (["--log-level=debug", "drafter", "warmup"], ("drafter", "warmup")),
        (["run", "--steps", "3"], ("run",)),
        (["bench", "e2e"], ("bench", "e2e")),
    ],
)
def test_command_for_reads_the_positional_words(argv, path):
    cmd = cli.command_for(argv)
    assert cmd is not None and cmd.path == path


def test_unknown_command_is_none():
    assert cli.command_for(["nonsense"]) is None
    assert cli.command_for([]) is None


def test_only_standalone_compute_commands_own_the_cores():
    owners = {c.path for c in cli.COMMANDS if c.owns_cores}
    assert owners == {("model", "build"), ("model", "eval"), ("drafter", "warmup")}


@pytest.mark.parametrize(
    "argv, want",
    [
        (["model", "build", "--help"], None),  # libgomp's default: spin briefly, then sleep
        (["drafter", "warmup", "--help"], None),
        (["rollout", "serve", "--help"], "PASSIVE"),
        (["run", "--help"], "PASSIVE"),
        (["bench", "rollout", "--help"], "PASSIVE"),
    ],
)
def test_main_sets_the_wait_policy_before_anything_imports_torch(monkeypatch, capsys, argv, want):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    assert os.environ.get("OMP_WAIT_POLICY") == want


def test_the_callers_setting_wins(monkeypatch):
    build = cli.command_for(["model", "build"])
    serve = cli.command_for(["rollout", "serve"])
    assert cli.omp_wait_policy(build, {"OMP_WAIT_POLICY": "PASSIVE"}) is None  # left as the caller set it
    assert cli.omp_wait_policy(serve, {"OMP_WAIT_POLICY": "ACTIVE"}) is None
    assert cli.omp_wait_policy(serve, {"GOMP_SPINCOUNT": "10000"}) is None
    assert cli.omp_wait_policy(serve, {}) == "PASSIVE"
    assert cli.omp_wait_policy(None, {}) == "PASSIVE"


def test_a_replica_can_spin_only_if_torch_is_not_loaded_yet():
    """`spin_at_barriers` (the rollout replica's `spin_wait`) in a fresh interpreter, as a spawned replica
    runs it: it sets GOMP_SPINCOUNT, which libgomp lets override the OMP_WAIT_POLICY=PASSIVE that the CLI
    gives services, and refuses once torch (and so libgomp) is loaded."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from tlt.services.common.cpus import spin_at_barriers, SPIN_COUNT\n"
        "before = spin_at_barriers()\n"
        "import torch\n"
        "after = spin_at_barriers()\n"
        "print(before, after, os.environ['GOMP_SPINCOUNT'] == SPIN_COUNT)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True"]
    env["GOMP_SPINCOUNT"] = "1000"  # the caller's own spin count is kept
    code2 = "import os\nfrom tlt.services.common.cpus import spin_at_barriers\nspin_at_barriers()\nprint(os.environ['GOMP_SPINCOUNT'])\n"
    out = subprocess.run([sys.executable, "-c", code2], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1000", out.stderr


def _makefile_in(tmp_path, files: tuple[str, ...]):  # noqa: ANN001, ANN202
    """The repository's Makefile in `tmp_path` beside empty `files` (written oldest first, so all up to date), and a
    function returning `make -n ARGS`' output there."""
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("make") is None:
        pytest.skip("no make")
    shutil.copy(Path(__file__).resolve().parents[1] / "Makefile", tmp_path / "Makefile")
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")

    def dry(*args: str) -> str:
        out = subprocess.run(["make", "-n", *args], cwd=tmp_path, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout
    return dry


def test_make_model_is_not_rebuilt_by_a_reinstall(tmp_path):
    """`make model` builds the tiny model only when it is missing: a newer pyproject.toml reinstalls the venv,
    and the install must not make the cached model look out of date (a rebuild is minutes of CPU)."""
    dry = _makefile_in(tmp_path, ("pyproject.toml", "setup.py", "deploy/constraints-cpu.txt", ".venv/bin/python",
                                  ".venv/.tlt-installed", "artifacts/tiny/.complete"))
    assert "model build" not in dry("model")
    out = dry("-W", "pyproject.toml", "model")  # as if pyproject.toml were just edited
    assert "pip install" in out and "model build" not in out, out
    (tmp_path / "artifacts/tiny/.complete").unlink()
    assert "model build" in dry("model")  # missing: built


def test_make_run_installs_without_the_test_tools(tmp_path):
    """On a fresh clone `make run` installs the product alone (`-e .`); `make test` adds the `dev` extra (pytest,
    scipy, pyarrow, grpcio-tools: ~30 s of a 2-core VM's install) and regenerates the gRPC modules."""
    dry = _makefile_in(tmp_path, ("pyproject.toml", "setup.py", "deploy/constraints-cpu.txt"))
    run, test = dry("run"), dry("test")
    assert "deepspeed==0.19.8" in run and "-e ." in run and "[dev]" not in run and "protogen" not in run, run
    assert "deepspeed==0.19.8" in test and "-e '.[dev]'" in test and "tlt.protogen" in test and "pytest" in test, test
