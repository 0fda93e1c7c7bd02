"""Every `tlt` command refuses a user's mistake the way the CLI promises: one line saying what is wrong, exit
status 2, no traceback, nothing half-written left behind; a value that would be misread (a negative count run
as zero, an empty path taken for "the default" or the current folder) is refused too.

Parsing cases use the real `tlt` parser (nothing runs past parsing). The other cases run `tlt.cli.main` in this
process or, for servers and the top-level options, `python -m tlt.cli` in a subprocess with a bounded timeout.
Models are random tiny checkpoints built here (tlt.model.testing); nothing loads artifacts/tiny.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tlt.cli import build_parser, main

# (argv, the option the error names). {file}: an existing file, {dir}: an existing folder holding a file,
# {new}: a path that does not exist yet, {ckpt}: a folder holding a config.json (a model checkpoint).
REFUSED_AT_PARSING = [
    (["model", "build", "--preset", "nope", "--out", "{new}"], "--preset"),
    (["model", "build", "--out", "{file}"], "--out"),
    (["model", "build", "--out", "{file}/model"], "--out"),  # a folder under a file cannot be made
    (["model", "build", "--out", ""], "--out"),
    (["model", "build", "--out", "{new}", "--max-steps", "0"], "--max-steps"),
    (["model", "build", "--out", "{new}", "--max-steps", "-1"], "--max-steps"),
    (["model", "build", "--out", "{new}", "--max-steps", "1.5"], "--max-steps"),  # not read as 1
    (["model", "build", "--out", " "], "--out"),  # blank: no folder anyone meant
    (["model", "build", "--out", "{file}/a/model"], "--out"),  # a file two folders up
    (["model", "build", "--out", "/dev/null"], "--out"),  # an existing file that is not a regular one
    (["model", "build", "--out", "{new}", "--eval-n", "-3"], "--eval-n"),
    (["model", "build", "--out", "{new}", "--threads", "0"], "--threads"),
    (["model", "build", "--out", "{new}", "--time-budget", "0"], "--time-budget"),
    (["model", "build", "--out", "{new}", "--time-budget", "nan"], "--time-budget"),
    (["model", "eval", "--model", "{dir}", "--batch-size", "0"], "--batch-size"),
    (["model", "eval", "--model", "{dir}", "--threads", "0"], "--threads"),
    # checked only after parsing: "error: --n and --samples must be >= 1", unlike every other count
    (["model", "eval", "--model", "{dir}", "--n", "0"], "--n"),
    (["model", "eval", "--model", "{dir}", "--samples", "-1"], "--samples"),
    (["task", "export", "--n", "-3", "--out", "-"], "--n"),
    (["task", "export", "--n", "2", "--out", "{dir}"], "--out"),
    (["task", "export", "--n", "2", "--out", ""], "--out"),
    (["task", "export", "--n", "2", "--out", "{file}/x.jsonl"], "--out"),
    (["task", "export", "--n", "2", "--out", "{file}/a/x.jsonl"], "--out"),
    (["task", "export", "--n", "2", "--out", "/dev/null/x.jsonl"], "--out"),
    (["task", "export", "--n", "2", "--out", " "], "--out"),
    (["rollout", "serve", "--model", "{dir}", "--ready-file", "{dir}"], "--ready-file"),
    (["reward", "serve", "--ready-file", ""], "--ready-file"),
    (["drafter", "serve", "--model", "{dir}", "--workers", "-1"], "--workers"),
    (["drafter", "serve", "--model", "{dir}", "--ready-file", "{file}/r.json"], "--ready-file"),
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "tcp://127.0.0.1:1", "--replica", "-1"], "--replica"),
    # an empty endpoint: the worker started and retried its capacity snapshot forever, joining nothing
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "", "--replica", "0"], "--coordinator"),
    (["drafter", "worker", "--model", "{dir}", "--coordinator", " ", "--replica", "0"], "--coordinator"),
    # not a ZeroMQ endpoint: the worker started and waited forever, and failed only once the rollout was up
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "foo", "--replica", "0"], "--coordinator"),
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "127.0.0.1:5704", "--replica", "0"], "--coordinator"),
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "tcp://127.0.0.1", "--replica", "0"], "--coordinator"),
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "tcp://:5704", "--replica", "0"], "--coordinator"),
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "tcp://127.0.0.1:*", "--replica", "0"],
     "--coordinator"),  # a wildcard port is for a bind; a worker connects
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "tcp://127.0.0.1:70000", "--replica", "0"],
     "--coordinator"),
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "ipc://", "--replica", "0"], "--coordinator"),
    # inproc:// reaches only sockets of the same process: the worker (its own process) waited forever
    (["drafter", "worker", "--model", "{dir}", "--coordinator", "inproc://coordinator", "--replica", "0"],
     "--coordinator"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{file}"], "--out"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--problems", "0"], "--problems"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--problems", "7"], "--problems"),  # no held-out set
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--ttt-steps", "0"], "--ttt-steps"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--epochs", "0"], "--epochs"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--rows", "0"], "--rows"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--row-tokens", "1"], "--row-tokens"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--depth", "0"], "--depth"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--temperature", "-1"], "--temperature"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--temperature", "nan"], "--temperature"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--lr", "0"], "--lr"),
    (["drafter", "warmup", "--model", "{dir}", "--out", "{new}", "--noise", "-0.1"], "--noise"),
    (["drafter", "export", "--drafter", "{dir}", "--model", "{dir}", "--out", ""], "--out"),
    (["drafter", "export", "--drafter", "{dir}", "--model", "{dir}", "--out", "{file}"], "--out"),
    (["run", "--run-id", ""], "--run-id"),
    (["run", "--run-id", "../escaped"], "--run-id"),
    (["run", "--run-id", "a/b"], "--run-id"),
    (["run", "--resume", ""], "--resume"),
    (["run", "--model", ""], "--model"),
    (["run", "--model", " "], "--model"),
    (["bench", "engine", "--repeats", "0"], "--repeats"),
    (["bench", "rollout", "--min-tokens", "-1"], "--min-tokens"),
    (["bench", "drafter-drift", "--out", "{dir}"], "--out"),
    (["bench", "drafter-preemption", "--out", "{file}/x.json"], "--out"),
    (["bench", "e2e", "--out", "{file}"], "--out"),
    (["bench", "e2e", "--out", ""], "--out"),
]

# The limits themselves, and paths that are fine, still parse.
ACCEPTED = [
    ["model", "build", "--out", "{new}", "--max-steps", "1", "--eval-n", "0", "--time-budget", "0.5"],
    ["model", "build", "--out", "{ckpt}"],  # a rebuild replaces an older model
    ["task", "export", "--n", "0", "--out", "{new}/sub/task.jsonl"],
    ["rollout", "serve", "--model", "{dir}", "--ready-file", "{new}/sub/ready.json"],
    ["drafter", "serve", "--model", "{dir}", "--workers", "0"],
    ["drafter", "worker", "--model", "{dir}", "--coordinator", "tcp://127.0.0.1:5704", "--replica", "0"],
    ["drafter", "worker", "--model", "{dir}", "--coordinator", "tcp://drafter.svc:5704", "--replica", "0"],
    ["drafter", "worker", "--model", "{dir}", "--coordinator", "tcp://[::1]:5704", "--replica", "0"],
    ["drafter", "worker", "--model", "{dir}", "--coordinator", "ipc:///tmp/tlt-coordinator", "--replica", "0"],
    ["drafter", "warmup", "--model", "{dir}", "--out", "{dir}", "--temperature", "0", "--noise", "0"],
    ["run", "--run-id", "my-run_2"],
    ["bench", "e2e", "--out", "{dir}"],
]


def test_a_value_that_is_not_a_number_is_refused_saying_so(capsys) -> None:
    """argparse's own words for a `type` that raised ValueError ("invalid positive_float value") named a function of
    ours; the refusal says what the option takes."""
    parser = build_parser()
    for argv, said in ((["model", "build", "--out", "m", "--time-budget", "soon"], "must be a number, got 'soon'"),
                       (["model", "build", "--out", "m", "--max-steps", "many"], "must be an integer >= 1, got 'many'")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err, err


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "kept").write_text("x")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    return {k: str(tmp_path / k) for k in ("file", "dir", "new", "ckpt")}


def _fill(argv: list[str], paths: dict[str, str]) -> list[str]:
    return [a.format(**paths) for a in argv]


def test_bad_arguments_are_usage_errors_naming_the_option(paths, capsys) -> None:
    parser = build_parser()
    wrong = []
    for argv, option in REFUSED_AT_PARSING:
        try:
            parser.parse_args(_fill(argv, paths))
        except SystemExit as e:
            err = capsys.readouterr().err
            if e.code != 2 or f"argument {option}" not in err:
                wrong.append((argv, e.code, err.strip().splitlines()[-1:]))
        else:
            wrong.append((argv, "accepted"))
    for argv in ACCEPTED:
        parser.parse_args(_fill(argv, paths))
    assert not wrong, wrong
    assert sorted(os.listdir(Path(paths["dir"]))) == ["kept"] and not Path(paths["new"]).exists()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A random qwen2 target and its drafter, a qwen3 target and its drafter, a folder with config.json only."""
    from tlt.model.testing import random_checkpoint
    from tlt.services.drafter.training import new_drafter

    root = tmp_path_factory.mktemp("models")
    out = {}
    for family in ("qwen2", "qwen3"):
        model = random_checkpoint(root / family, family=family, num_hidden_layers=2)
        new_drafter(model, seed=1).save(root / f"{family}-drafter")
        out[family], out[f"{family}-drafter"] = str(model), str(root / f"{family}-drafter")
    (root / "cfgonly").mkdir()
    (root / "cfgonly" / "config.json").write_text((root / "qwen2" / "config.json").read_text())
    out["cfgonly"] = str(root / "cfgonly")
    (root / "notok").mkdir()  # config and weights, no tokenizer files
    for name in ("config.json", "model.safetensors"):
        (root / "notok" / name).write_bytes((root / "qwen2" / name).read_bytes())
    out["notok"] = str(root / "notok")
    (root / "novocab").mkdir()  # tokenizer_config.json without a vocabulary: loaded as 3 special tokens
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (root / "novocab" / name).write_bytes((root / "qwen2" / name).read_bytes())
    out["novocab"] = str(root / "novocab")
    return out


def test_bad_folders_are_refused_before_any_work(models, tmp_path, capfd) -> None:
    """main() returns 2 (one log line) instead of a traceback, before loading or writing anything."""
    new = str(tmp_path / "new")
    cases = [
        ["model", "eval", "--model", models["cfgonly"], "--n", "1"],  # no weights: was an OSError from transformers
        ["model", "eval", "--model", new, "--n", "1"],
        # no tokenizer files: eval died in transformers, serve after loading the weights in every replica, and data
        # check counted 0 tokens in every prompt and said "ok"
        ["model", "eval", "--model", models["notok"], "--n", "1"],
        ["rollout", "serve", "--model", models["notok"], "--http-port", "0", "--grpc-port", "0"],
        ["data", "check", "--model", models["notok"], "--set", "trainer.eval_problems=0"],
        ["data", "check", "--model", models["novocab"], "--set", "trainer.eval_problems=0"],
        ["model", "eval", "--model", models["novocab"], "--n", "1"],
        ["bench", "engine", "--model", models["cfgonly"], "--batch-sizes", "1", "--max-tokens", "2"],
        ["bench", "drafter-drift", "--model", new],
        ["bench", "drafter-preemption", "--model", new],
        ["bench", "rollout", "--modes", " , ", "--prompts", "1", "--n", "1", "--max-tokens", "4"],  # ran no mode
        ["bench", "e2e", "--out", new, "--preset", "nope", "--steps", "1"],  # was found by the first run: --out made
        # an unsupported target for SGLang: was a ValueError after model.safetensors was written
        ["drafter", "export", "--drafter", models["qwen3-drafter"], "--model", models["qwen3"], "--out", new],
        # the drafter's init folder is checked before the target samples anything
        ["drafter", "warmup", "--model", models["qwen2"], "--out", new, "--init", str(tmp_path / "nope"),
         "--data", "reference", "--problems", "8"],
        # a drafter_config.json that is not JSON, or not a drafter's fields: a traceback in all but rollout serve
        *(["drafter", cmd, "--model", models["qwen2"], "--out", new, "--init", bad, "--data", "reference",
           "--problems", "8"] if cmd == "warmup" else ["drafter", cmd, "--drafter", bad, "--model", models["qwen2"],
                                                       "--out", new]
          for bad in (str(tmp_path / "notjson"), str(tmp_path / "otherfields")) for cmd in ("warmup", "export")),
        *(["bench", "rollout", "--model", models["qwen2"], "--modes", "learned", "--drafter", bad, "--prompts", "1",
           "--n", "1", "--max-tokens", "4"] for bad in (str(tmp_path / "notjson"), str(tmp_path / "otherfields"))),
    ]
    for name, text in (("notjson", "{bad"), ("otherfields", '{"foo": 1}')):
        shutil.copytree(models["qwen2-drafter"], tmp_path / name)
        (tmp_path / name / "drafter_config.json").write_text(text)
    # weights cut short by a copy: a SafetensorError traceback from the engine's loader and the drafter's
    for source, name in ((models["qwen2"], "cutmodel"), (models["qwen2-drafter"], "cutdrafter")):
        shutil.copytree(source, tmp_path / name)
        weights = tmp_path / name / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:5000])
    cases += [["bench", "engine", "--model", str(tmp_path / "cutmodel"), "--batch-sizes", "1", "--max-tokens", "2"],
              ["bench", "rollout", "--model", models["qwen2"], "--modes", "learned", "--drafter",
               str(tmp_path / "cutdrafter"), "--prompts", "1", "--n", "1", "--max-tokens", "4"]]
    wrong = []
    for argv in cases:
        try:
            rc = main(argv)
        except Exception as e:  # noqa: BLE001 - what the user would have seen as a traceback
            rc = f"{type(e).__name__}: {e}"
        err = capfd.readouterr().err
        if rc != 2 or "features" in err:
            wrong.append((argv[:2], rc, err.strip().splitlines()[-1:]))
    assert not wrong, wrong
    assert not Path(new).exists()


def test_an_export_never_overwrites_the_target_or_the_drafter(models, tmp_path) -> None:
    """`--out` naming the target (or the drafter) folder wrote config.json and model.safetensors over its own; a
    folder of other files (a model.safetensors and no config.json) had its model.safetensors replaced. An earlier
    export is written again."""
    target, drafter, other = tmp_path / "target", tmp_path / "drafter", tmp_path / "other"
    shutil.copytree(models["qwen2"], target)
    shutil.copytree(models["qwen2-drafter"], drafter)
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"someone else's")
    (other / "README").write_text("n")
    before = {p: p.read_bytes() for d in (target, drafter, other) for p in d.iterdir()}
    for out in (target, drafter, other):
        rc = main(["drafter", "export", "--drafter", str(drafter), "--model", str(target), "--out", str(out)])
        assert rc == 2, out
    assert {p: p.read_bytes() for d in (target, drafter, other) for p in d.iterdir()} == before
    export = tmp_path / "export"
    for _ in range(2):
        assert main(["drafter", "export", "--drafter", str(drafter), "--model", str(target), "--out", str(export)]) == 0


def test_bench_e2e_never_deletes_a_folder_that_is_not_its_run(tmp_path) -> None:
    """`--out .` in the repository removed ./tlt (the package) as the stale "tlt" run folder."""
    (tmp_path / "tlt").mkdir()
    (tmp_path / "tlt" / "keep.py").write_text("x")
    # (a missing --model: had the bench gone on, its first `tlt run` would have stopped at once)
    assert main(["bench", "e2e", "--out", str(tmp_path), "--steps", "1", "--noise-seed", "-1",
                 "--model", str(tmp_path / "missing")]) == 2
    assert (tmp_path / "tlt" / "keep.py").read_text() == "x"


def test_model_build_never_replaces_a_folder_that_is_not_a_model(tmp_path) -> None:
    """The build swaps its result in place of --out, deleting what was there: only an older model may go."""
    keep = tmp_path / "notes"
    keep.mkdir()
    (keep / "a.txt").write_text("x")
    assert main(["model", "build", "--out", str(keep), "--max-steps", "1", "--eval-n", "0"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"] and (keep / "a.txt").read_text() == "x"
    empty = tmp_path / "empty"  # an empty folder is as good as a new one (the refusal's own advice)
    empty.mkdir()
    assert main(["model", "build", "--out", str(empty), "--max-steps", "1", "--eval-n", "0", "--threads", "1"]) == 0
    assert (empty / "model.safetensors").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["empty", "notes"]


def test_a_stale_ready_file_is_removed_before_the_command_runs(tmp_path, capfd) -> None:
    """A ready file left by an earlier run names its dead ports and pids: a server's --ready-file is deleted at start,
    so a waiter never takes the old one for this run's, even when this run then refuses its arguments."""
    ready = tmp_path / "ready.json"
    ready.write_text('{"pid": 1, "ports": {"http": 1}}')
    assert main(["rollout", "serve", "--model", str(tmp_path / "nope"), "--ready-file", str(ready)]) == 2
    assert not ready.exists() and str(tmp_path / "nope") in capfd.readouterr().err


def test_drafter_warmup_refuses_to_write_into_the_model_folder(models, capfd) -> None:
    """--out the target's own folder: the drafter's model.safetensors would replace the model's weights."""
    weights = Path(models["qwen2"]) / "model.safetensors"
    before = weights.read_bytes()
    assert main(["drafter", "warmup", "--model", models["qwen2"], "--out", models["qwen2"]]) == 2
    assert "is a model checkpoint folder" in capfd.readouterr().err and weights.read_bytes() == before


def test_drafter_warmup_refuses_a_folder_of_other_files_and_takes_an_earlier_drafters(models, tmp_path, capfd) -> None:
    """--out a run folder (or any folder of other files): the drafter's two files and warmup.json were written among
    them after minutes of sampling. Refused before any work; a folder holding only a drafter's files is taken."""
    from tlt.services.common.config import ConfigError
    from tlt.services.drafter.warmup import check_out

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    assert main(["drafter", "warmup", "--model", models["qwen2"], "--out", str(run)]) == 2
    assert "holds other files than a drafter's (checkpoints, metrics.jsonl)" in capfd.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.jsonl"]
    earlier = tmp_path / "d"
    earlier.mkdir()
    for name in ("drafter_config.json", "model.safetensors", "warmup.json"):
        (earlier / name).write_text("x")
    check_out(earlier)
    check_out(tmp_path / "new")
    (earlier / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"\(notes.txt\)"):
        check_out(earlier)


def _tlt(*argv: str, env: dict | None = None, timeout: float = 60, cwd: str | None = None):
    return subprocess.run([sys.executable, "-m", "tlt.cli", *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=cwd)


def _one_line_refusal(p: subprocess.CompletedProcess) -> str:
    return "" if p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.strip() else \
        f"rc={p.returncode} {p.stderr.strip().splitlines()[-1:]}"


def _main_refusal(argv: list[str], env: dict | None, monkeypatch, capfd) -> str:
    """`_one_line_refusal` of `tlt.cli.main` run in this process: exit status 2 (a usage error's SystemExit too), no
    exception, something said on stderr and no traceback printed there."""
    with monkeypatch.context() as m:
        for key, value in (env or {}).items():
            m.setenv(key, value)
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except Exception as e:  # noqa: BLE001 - what the user would have seen as a traceback
            rc = f"{type(e).__name__}: {e}"
    err = capfd.readouterr().err
    return "" if rc == 2 and "Traceback" not in err and err.strip() else f"rc={rc} {err.strip().splitlines()[-1:]}"


def test_whole_commands_refuse_with_one_line(models, tmp_path, monkeypatch, capfd) -> None:
    """End to end, as a user runs them: servers refuse before starting replicas (ports 0: nothing is taken). One
    case runs the real `tlt` process (exit status, stderr, no traceback); the others run the same `main` in this
    process, each a subprocess of seconds of imports that showed nothing more."""
    ports = ["--http-port", "0", "--grpc-port", "0"]
    cases = {
        "unknown model preset": (["model", "build", "--preset", "nope", "--out", str(tmp_path / "m")], None),
        "unknown --log-level": (["--log-level", "nope", "task", "export", "--n", "1", "--out", "-"], None),
        "unknown TLT_LOG_LEVEL": (["task", "export", "--n", "1", "--out", "-"], {"TLT_LOG_LEVEL": "nope"}),
        "checkpoint without weights": (["rollout", "serve", "--model", models["cfgonly"], *ports], None),
        "unknown backend": (["rollout", "serve", "--model", models["qwen2"], "--backend", "nope", *ports], None),
        "missing drafter": (["rollout", "serve", "--model", models["qwen2"], "--drafter", str(tmp_path / "d"),
                             *ports], None),
        # RoPE past the trained length: the replicas loaded and served it silently
        "max_model_len past the model's": (["rollout", "serve", "--model", models["qwen2"], *ports],
                                           {"TLT_ROLLOUT__ENGINE__MAX_MODEL_LEN": "1000000"}),
        # a worker took any device and failed in torch once its replica first turned idle (or waited for it forever)
        "unknown drafter device": (["drafter", "worker", "--model", models["qwen2"], "--coordinator",
                                    "tcp://127.0.0.1:5704", "--replica", "0", "--set", "device=gpu"], None),
    }
    wrong = {}
    for name, (argv, env) in cases.items():
        if name == "max_model_len past the model's":  # a server, configured from the environment: the real process
            p = _tlt(*argv, env=env)
            problem = _one_line_refusal(p) or ("" if len(p.stderr.strip().splitlines()) == 1 else p.stderr[-2000:])
        else:
            problem = _main_refusal(argv, env, monkeypatch, capfd)
        if problem:
            wrong[name] = problem
    assert not wrong, wrong
    assert sorted(os.listdir(tmp_path)) == []


def test_a_ready_file_in_a_new_folder_is_written(tmp_path) -> None:
    """`--ready-file runs/x/ready.json` with runs/x missing: the server ran, then died writing the file."""
    ready = tmp_path / "sub" / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "tlt.cli", "reward", "serve", "--port", "0", "--ready-file",
                             str(ready)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "no ready file in 30 s"
        assert json.loads(ready.read_text())["pid"] == proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_the_rollout_checks_the_architecture_only_for_the_native_engine(tmp_path: Path, monkeypatch) -> None:
    """The check before start must not refuse what SGLang serves: an architecture the native engine lacks is
    the native engine's error, not the SGLang backend's."""
    from tlt.model.loader import CheckpointError

    monkeypatch.setenv("TLT_SGLANG__SPECULATIVE_ALGORITHM", "none")  # no drafter to check (test_sglang_serve_flags)
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.rollout.serve import check_before_start

    model = tmp_path / "mistral"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")  # the front tokenizes for either backend (only the name is checked)
    check_before_start(str(model), RolloutConfig(backend="sglang"))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        check_before_start(str(model), RolloutConfig(backend="native"))
    (model / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        check_before_start(str(model), RolloutConfig(backend="sglang"))


def test_a_push_limit_under_the_models_weights_is_warned_at_start(models, capfd) -> None:
    """Every policy push would be refused once a trainer sends one, after the server started and served a rollout;
    a server that only serves inference takes no push, so it is a warning, not a refusal."""
    from tlt.model.folder import read_model_config
    from tlt.services.rollout.serve import check_push_limit

    cfg = read_model_config(models["qwen2"])
    assert not check_push_limit(cfg, 1000)
    assert "weights_over_push_limit" in "".join(capfd.readouterr())
    assert check_push_limit(cfg, 16 << 30)


def test_the_push_limit_warning_is_at_the_bf16_size_of_the_weights(models) -> None:
    """The smallest push is bf16, 2 bytes a weight (the elements counted here from the checkpoint's own safetensors
    header): a limit of exactly that is enough, a byte less is not."""
    import math

    from safetensors import safe_open

    from tlt.model.folder import read_model_config
    from tlt.services.rollout.serve import check_push_limit

    with safe_open(str(Path(models["qwen2"], "model.safetensors")), "pt") as f:
        elements = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    cfg = read_model_config(models["qwen2"])
    assert check_push_limit(cfg, 2 * elements)
    assert not check_push_limit(cfg, 2 * elements - 1)


def test_a_static_mode_drafter_is_checked_before_start_too(models, tmp_path) -> None:
    """--spec static runs the learned drafter as adaptive does: a folder that is not one is refused before any
    replica starts, not found by each replica after it loaded the model."""
    from tlt.model.drafter import DrafterError
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.rollout.serve import check_before_start

    for mode in ("static", "adaptive"):
        config = RolloutConfig(engine={"max_model_len": 0},
                               spec={"mode": mode, "drafter": "learned", "drafter_path": str(tmp_path / "none")})
        with pytest.raises(DrafterError, match="not a drafter folder"):
            check_before_start(models["qwen2"], config)

NOT_A_CHECKPOINT = [
    ["model", "eval", "--model", "{missing}"],
    ["rollout", "serve", "--model", "{missing}"],
    ["drafter", "warmup", "--model", "{missing}", "--out", "{out}"],
    ["drafter", "serve", "--model", "{missing}"],
    ["bench", "engine", "--model", "{missing}"],
    ["bench", "rollout", "--model", "{missing}"],
    ["bench", "drafter-drift", "--model", "{missing}"],
]


def test_a_folder_that_is_not_a_checkpoint_is_refused_before_torch_loads(tmp_path):
    """Checking the folder needs no torch (tlt.model.folder): `tlt drafter warmup --model typo` answered after
    7.6 s of imports, now in half a second. One subprocess runs each command's `main` and says, for each, its
    exit status and whether torch had been imported by then."""
    cmds = [[a.format(missing=str(tmp_path / "nope"), out=str(tmp_path / "out")) for a in c] for c in NOT_A_CHECKPOINT]
    script = (
        "import json, sys\n"
        "from tlt.cli import main\n"
        "seen = []\n"
        f"for argv in {cmds!r}:\n"
        "    seen.append((main(argv), 'torch' in sys.modules))\n"
        "print(json.dumps(seen))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert [tuple(s) for s in seen] == [(2, False)] * len(cmds), list(zip([c[:2] for c in cmds], seen))
    assert r.stderr.count(str(tmp_path / "nope")) == len(cmds) and "Traceback" not in r.stderr  # one line each


def _drafter_variants(models: dict[str, str], root: Path) -> dict[str, Path]:
    """Drafter folders that do not fit the qwen2 target: another vocabulary, another width, an unreadable config."""
    import shutil
    from dataclasses import replace

    import torch

    from tlt.model.drafter import CONFIG_FILE, Drafter, DrafterConfig
    from tlt.model.folder import read_model_config

    cfg = DrafterConfig.from_model_config(read_model_config(models["qwen2"]))
    out = {}
    for name, bad in (("vocab", replace(cfg, vocab_size=cfg.vocab_size + 8)),
                      ("hidden", replace(cfg, hidden_size=2 * cfg.hidden_size))):
        shared = torch.zeros(bad.vocab_size, bad.hidden_size)
        Drafter(bad, shared, shared.clone()).save(root / name)
        out[name] = root / name
    for name, text in (("garbled", "{"), ("not-an-object", "[]")):
        shutil.copytree(models["qwen2-drafter"], root / name)
        (root / name / CONFIG_FILE).write_text(text)
        out[name] = root / name
    return out


def test_a_drafter_that_does_not_fit_the_model_is_refused_naming_it(models, tmp_path, capfd) -> None:
    """A drafter of another vocabulary or hidden size (or an unreadable drafter_config.json) passed the folder check,
    loaded in every replica after the model and failed there: two tracebacks, exit 1, headed 'replica 0 failed to
    load <the model>'. Refused before any replica starts, one line naming the drafter's folder."""
    from tlt.model.drafter import DrafterError
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.rollout.serve import check_before_start

    drafters = _drafter_variants(models, tmp_path)
    for d in drafters.values():  # each variant, as the server checks it before start
        config = RolloutConfig(engine={"max_model_len": 0}, spec={"drafter": "learned", "drafter_path": str(d)})
        with pytest.raises(DrafterError, match=str(d)):
            check_before_start(models["qwen2"], config)
    # the whole command, as a user runs it (ports 0: nothing is taken), in this process: the real process's one-line
    # refusal is test_whole_commands_refuse_with_one_line's
    assert main(["rollout", "serve", "--model", models["qwen2"], "--drafter", str(drafters["vocab"]), "--http-port",
                 "0", "--grpc-port", "0"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and "replicas_starting" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "bad_checkpoint" in last and str(drafters["vocab"]) in last and "vocab_size" in last, last


def test_a_replica_that_cannot_load_the_drafter_names_the_drafter(models, tmp_path) -> None:
    """What the check before start cannot see (here weights that do not fit the drafter's own config) still fails in
    the replica; its message named the model's folder, as if the checkpoint were broken, not the drafter."""
    import multiprocessing as mp
    import shutil

    from tlt.model.drafter import CONFIG_FILE
    from tlt.services.rollout.engine.config import EngineConfig
    from tlt.services.rollout.ipc import Fatal
    from tlt.services.rollout.replica import replica_main
    from tlt.services.rollout.spec.config import SpecConfig

    drafter = tmp_path / "drafter"
    shutil.copytree(_drafter_variants(models, tmp_path)["hidden"], drafter)  # weights of a wider drafter
    shutil.copy(Path(models["qwen2-drafter"], CONFIG_FILE), drafter / CONFIG_FILE)  # under the target's config
    spec = SpecConfig(drafter="learned", drafter_path=str(drafter))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=replica_main, args=(0, models["qwen2"], "native",
                                                  EngineConfig(num_kv_blocks=16).model_dump_json(), 1, child, "",
                                                  4096, spec.model_dump_json()), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(60), "the replica sent nothing in 60 s"
        event = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(30)
    assert isinstance(event, Fatal), event
    headline = event.message.splitlines()[0]
    assert f"replica 0 failed to load the drafter {drafter}" in headline, headline
    assert "DrafterError" in event.message
    assert event.checkpoint.startswith(f"the drafter {drafter}: ")  # `tlt rollout serve` says this, one line


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C in `tlt model eval` or `tlt model build` (commands with no handler of their own) printed a whole
    KeyboardInterrupt traceback; what the command cleans up runs as the exception unwinds it, then one line."""
    from tlt.services.trainer import report

    def interrupted(args):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "run", interrupted)
    assert main(["report", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "command=report" in err and "Traceback" not in err
