"""A user's checkpoint folder that is damaged is refused in one line (exit 2, `bad_checkpoint`, no traceback) by
every command that loads it, before anything is served: a weight file without a tensor, with a misshapen or
integer one, cut short, or holding NaN; a tokenizer.json left as a Git LFS pointer. `tlt rollout serve` printed two
tracebacks of a replica that failed to start for the weights (the tensor checks ran only in the replica), every
command a JSONDecodeError traceback naming no file for the tokenizer, and NaN weights were served: every logprob a
NaN shown as -9999. A trainer's push of NaN weights is refused too.

Real `tlt` commands on tiny random Qwen2 checkpoints built here (tlt.model.testing), damaged by hand: one real
process (its exit status and output), the other cases `tlt.cli.main` in this process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 1843\n"


def _damaged(base: Path, root: Path, kind: str) -> Path:
    out = root / kind
    shutil.copytree(base, out)
    weights = load_file(out / "model.safetensors")
    if kind == "missing":
        del weights["model.layers.1.mlp.down_proj.weight"]
    elif kind == "shape":
        weights["model.norm.weight"] = torch.ones(7)
    elif kind == "integer":
        weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int32)
    elif kind == "nan":
        weights["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    if kind in ("missing", "shape", "integer", "nan"):
        save_file(weights, out / "model.safetensors")
    elif kind == "truncated":
        data = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "lfs_tokenizer":
        (out / "tokenizer.json").write_text(LFS_POINTER)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tlt.model.testing import random_checkpoint

    return random_checkpoint(tmp_path_factory.mktemp("m") / "qwen2", family="qwen2", num_hidden_layers=2)


SAYS = {"missing": "missing tensor(s) ['model.layers.1.mlp.down_proj.weight']", "shape": "expected shape (64,)",
        "integer": "expected a floating point dtype", "nan": "holds NaN or infinite values",
        "truncated": "is not a readable safetensors file", "lfs_tokenizer": "tokenizer files cannot be loaded"}


def _tlt(argv: list[str], capfd) -> tuple[int | str, str]:
    """`tlt` with these arguments: a real process for `rollout serve` of NaN weights (which a regression would serve,
    not refuse: it must end by a timeout, not hang this process), `tlt.cli.main` in this process for the rest (the
    same code, without seconds of imports per case); its exit status (or the exception a user would have seen as a
    traceback) and everything it printed."""
    if argv[:2] == ["rollout", "serve"] and "/nan" in argv[argv.index("--model") + 1]:
        r = subprocess.run([sys.executable, "-m", "tlt.cli", *argv], capture_output=True, text=True, timeout=180)
        return r.returncode, r.stdout + r.stderr
    from tlt.cli import main

    capfd.readouterr()
    try:
        rc: int | str = main(argv)
    except Exception as e:  # noqa: BLE001
        rc = f"Traceback: {type(e).__name__}: {e}"
    out, err = capfd.readouterr()
    return rc, out + err


@pytest.mark.parametrize("kind", list(SAYS))
def test_rollout_serve_refuses_a_damaged_folder_in_one_line(base, tmp_path, kind, capfd) -> None:
    model = _damaged(base, tmp_path, kind)
    rc, out = _tlt(["rollout", "serve", "--model", str(model), "--http-port", "0", "--grpc-port", "0", "--set",
                    "engine.num_kv_blocks=16", "--set", "threads_per_replica=1"], capfd)
    lines = [x for x in out.splitlines() if "error" in x]
    assert rc == 2 and "Traceback" not in out, (rc, out[-3000:])
    assert len(lines) == 1 and "bad_checkpoint" in lines[0] and SAYS[kind] in lines[0], out[-3000:]


@pytest.mark.parametrize("argv", [["model", "eval", "--n", "2"], ["drafter", "warmup", "--problems", "8", "--out", "{out}"]])
def test_other_commands_name_an_unreadable_tokenizer(base, tmp_path, argv, capfd) -> None:
    model = _damaged(base, tmp_path, "lfs_tokenizer")
    cmd = [a.replace("{out}", str(tmp_path / "drafter")) for a in argv]
    rc, out = _tlt([*cmd[:2], "--model", str(model), *cmd[2:]], capfd)
    assert rc == 2 and "Traceback" not in out and "bad_checkpoint" in out, (rc, out[-3000:])
    assert SAYS["lfs_tokenizer"] in out and str(model) in out, out[-3000:]


def test_a_push_of_nan_weights_is_refused(base) -> None:
    """A diverged trainer's NaN weights were applied and served; the replica now refuses the push, naming the tensor,
    and keeps serving the version it had."""
    from rollout_helpers import ServerThread
    from tlt.services.rollout.client import RolloutClient, WeightPushError
    from tlt.services.trainer.weight_sync import WeightPublisher

    weights = load_file(base / "model.safetensors")
    weights["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("inf")
    with ServerThread(base, replicas=1, insecure_local=True) as server, RolloutClient(server.grpc_address) as client:
        with pytest.raises(WeightPushError, match="model.layers.1.self_attn.o_proj.weight.*NaN or infinite"):
            WeightPublisher([client]).push(weights, 1)
        assert client.status().versions.policy == 0


def test_a_replica_restarted_on_a_folder_damaged_since_is_a_counted_death(base, tmp_path) -> None:
    """A folder damaged while the server runs (edited, cut short) fails a replica's restart: that is a replica death
    (logged, counted in replica_deaths, restarted again up to max_restarts), not the server start's one-line error,
    which only the first start is."""
    import os
    import signal
    import time

    from rollout_helpers import ServerThread

    model = tmp_path / "model"
    shutil.copytree(base, model)
    with ServerThread(model, replicas=1, max_restarts=2) as server:
        pool = server.server.pool
        (model / "model.safetensors").write_bytes(b"not safetensors")  # damaged after the start
        os.kill(server.server.replica_pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while pool.deaths.get(0, 0) < 3 and time.monotonic() < deadline:  # the kill and two failed restarts
            time.sleep(0.2)
        assert pool.deaths.get(0, 0) == 3, pool.deaths
        assert not pool.replicas[0].alive


def test_model_eval_on_a_model_with_too_short_a_context_is_one_line(tmp_path, capfd) -> None:
    """`tlt model eval` asks prompt + 240 new tokens of the model; a shorter context raised the engine's ValueError
    as a traceback."""
    from tlt.model.testing import random_checkpoint

    model = random_checkpoint(tmp_path / "short", family="qwen2", num_hidden_layers=1, max_position_embeddings=128)
    rc, out = _tlt(["model", "eval", "--model", str(model), "--n", "2"], capfd)
    assert rc == 2 and "Traceback" not in out, (rc, out[-3000:])
    assert "context is 128 tokens" in out and "needs a longer context" in out, out[-3000:]


def test_a_weight_file_cut_short_read_through_transformers_is_named_in_one_line(base, tmp_path, capfd) -> None:
    """`tlt model eval --engine transformers` reads the weights through transformers, whose SafetensorError names no
    file ("Error while deserializing header: ..."): the one line says a .safetensors file this command read is not
    readable and to copy or write it again."""
    model = _damaged(base, tmp_path, "truncated")
    rc, out = _tlt(["model", "eval", "--engine", "transformers", "--model", str(model), "--n", "2"], capfd)
    assert rc == 2 and "Traceback" not in out and "bad_checkpoint" in out, (rc, out[-3000:])
    assert "a .safetensors weight file this command read is not readable" in out, out[-3000:]
