"""ZeRO-3 on two ranks: a rollout server restarted mid-run gets the weights again, the ranks gathering them together.

Under ZeRO-3 each rank holds a slice of every weight, so reading them whole is a collective. Rank 0 alone talks to
the rollout, and it finds a restarted server (one serving its start checkpoint, version 0) mid-rollout or mid-eval,
while the other ranks wait in a broadcast. The run used to end there (StaleWeightsError, "ZeRO-3 on several ranks"
in the hint: rank 0 cannot start a gather alone), losing the steps since the last checkpoint. Now rank 0 calls the
others into the gather through that broadcast (loop.GATHER) and pushes again, as one rank does
(test_trainer_repush.py). A fresh start also compares two probe weights with the rollout's start checkpoint, gathered
by both ranks, and pushes when they differ (here the server starts from another seed's checkpoint).

Real parts: DeepSpeed ZeRO-3 on a two-process gloo group (the zero3 tests' rank server), the rollout server
(replica process, native engine, gRPC on 127.0.0.1) started by rank 0 and restarted on the same ports (twice, four times), the
task verifier in-process. The restarts are made by wrapping rank 0's collect call; nothing in the trainer is stubbed.
"""

from __future__ import annotations

import json

import torch

from test_trainer_zero3 import TESTS, run_two_ranks
from tlt.services.common.ports import free_port

SCRIPT = """
import json, os, re, sys
from pathlib import Path
import torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
import tlt.services.trainer.policy as policy_mod
policy_mod.ZERO3_OPTIONS = {{"stage3_param_persistence_threshold": 0}}  # every weight's gather is a collective
from tlt.services.trainer import collect
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train
from tlt.services.trainer.weight_sync import StaleWeightsError

servers, seen, restarted = [], [], set()
if os.environ["RANK"] == "0":
    from rollout_helpers import ServerThread

    def start():
        servers.append(ServerThread(Path({served!r}), replicas=1, grpc_port={grpc_port}, http_port={http_port}).__enter__())

    start()
    real = collect.collect_retrying

    def wrapped(items, clients, rewards, n, params, label, *args, **kw):
        if str(label) in {restart_before} and str(label) not in restarted:  # its first attempt only
            restarted.add(str(label))
            servers[-1].__exit__()
            start()
        try:
            result = real(items, clients, rewards, n, params, label, *args, **kw)
        except StaleWeightsError as e:
            seen.append(["dropped", re.search(r"version\\(s\\) (\\[[\\d, ]*\\])", str(e))[1]])
            raise
        seen.append(sorted({{s.policy_version for s in result.samples}}))
        return result

    collect.collect_retrying = wrapped
try:
    cfg = TrainerConfig(model_dir={model!r}, rollout_addresses=["127.0.0.1:{grpc_port}"], output_dir={out!r},
                        prompts_per_step=2, n_samples=2, max_tokens=8, mini_batch_size=4, micro_batch_size=2,
                        zero_stage=3, lr=1e-3, checkpoint_interval=1, synthetic_problems=64, eval_problems=2,
                        eval_interval=1, connect_timeout_s=60, **{extra!r})
    s = train(cfg)
    if servers:
        from tlt.services.rollout.client import RolloutClient

        with RolloutClient("127.0.0.1:{grpc_port}") as client:
            serving = client.status().versions.policy
        Path({report!r}).write_text(json.dumps({{"seen": seen, "steps": s.steps_done, "version": s.policy_version,
                                                "serving": serving, "servers": len(servers)}}))
finally:
    if servers:
        servers[-1].__exit__()
from tlt.services.trainer.distributed import shutdown_process_group
shutdown_process_group()
"""


def _run(model_dir, served, tmp_path, restart_before: set[str], **extra) -> dict:  # noqa: ANN001
    """The two ranks' run against a server started from `served` and restarted before the collect calls labelled
    `restart_before` (steps: "2"; dynamic sampling's later rounds: "1.1"; evals: "eval1", "eval1-greedy")."""
    torch.set_num_threads(1)
    report = tmp_path / "report.json"
    run_two_ranks(SCRIPT.format(tests=str(TESTS), model=str(model_dir), served=str(served), grpc_port=free_port(),
                                http_port=free_port(), out=str(tmp_path / "run"), report=str(report),
                                restart_before=restart_before, extra=extra), timeout=400)
    return json.loads(report.read_text())


def test_a_rollout_server_restarted_mid_eval_and_mid_rollout_gets_the_weights_gathered_by_both_ranks(
        random_model_dir, tmp_path) -> None:
    """Restarted mid-eval (after step 0: rank 1 waits for the eval's end) and mid-rollout (step 2: rank 1 waits for
    the rollout). The server starts, and restarts, from another seed's checkpoint: the startup sync pushes v1."""
    from tlt.model.testing import random_checkpoint

    other = random_checkpoint(tmp_path / "other", family="qwen2", seed=5)
    r = _run(random_model_dir, other, tmp_path, {"eval1", "2"}, steps=3, eval_greedy=False)
    assert r["servers"] == 3, "the server was not restarted twice"
    # the start: the other checkpoint's weights are not the trainer's, so v1 is pushed before the first eval. Each
    # restarted server's first rollout is dropped at its first completion (version 0), and the batch rolled out again
    # from the version pushed to it again
    assert r["seen"] == [[1], [1], ["dropped", "[0]"], [2], [2], [3], ["dropped", "[0]"], [3], [4]], r["seen"]
    assert r["steps"] == 3 and r["version"] == 4 and r["serving"] == 4
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2] and [m["policy_version"] for m in lines] == [2, 3, 4]
    assert [m["rollout_retries"] for m in lines] == [0, 0, 1]
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["after_steps"] for e in evals] == [0, 1, 2, 3]
    assert [e["policy_version"] for e in evals] == [1, 2, 3, 4]


def test_two_restarts_within_one_wait_of_the_other_rank_are_two_gathers(random_model_dir, tmp_path) -> None:
    """Rank 1 waits once for a whole eval (its sampled and its greedy pass) and once for a whole step's rollout (every
    dynamic-sampling round); a restart before each pass and before each round calls it into two gathers in one wait
    (with one gather per wait, rank 1 took the second GATHER for the eval's end, or for the rollout)."""
    r = _run(random_model_dir, random_model_dir, tmp_path, {"eval1", "eval1-greedy", "1", "1.1"}, steps=2,
             eval_greedy=True, eval_temperature=0.7, dynamic_sampling=True, dynamic_sampling_max_rounds=2)
    assert r["servers"] == 5, f"restarted {r['servers'] - 1} times, not 4 (a dynamic-sampling round did not run?)"
    assert [x for x in r["seen"] if x[0] == "dropped"] == [["dropped", "[0]"]] * 4, r["seen"]
    assert r["steps"] == 2 and r["version"] == 2 and r["serving"] == 2


def test_a_rank_told_anything_but_gathers_then_the_end_of_the_eval_stops_with_out_of_step(monkeypatch) -> None:
    """The other ranks' side of `_meet`, its protocol alone: rank 0's broadcasts are scripted here (no process group),
    `push_tensors` counted. Each GATHER is one joined gather, then DONE ends the wait; any other value means the
    ranks are out of step (a rank that took it for DONE would train on while rank 0 waits in an eval's gather, or go
    on with rank 0's next broadcast read as this one) and must stop with a message, not pass. Session 55's audit left
    a `_meet` that accepted any value alive (M9): rank 0 only ever sends DONE there, so no real run reaches it."""
    import pytest

    import tlt.services.trainer.distributed as distributed
    from tlt.services.trainer import loop

    def run(script: list) -> int:
        sent, pushed = iter(script), []
        monkeypatch.setattr(distributed, "broadcast", lambda value: next(sent))
        monkeypatch.setattr(loop, "push_tensors", lambda policy: pushed.append(policy))
        loop._meet("policy", None)
        assert next(sent, "spent") == "spent", "a broadcast left unread: the ranks would be out of step from here"
        return len(pushed)

    assert run([loop.DONE]) == 0
    assert run([loop.GATHER, loop.GATHER, loop.DONE]) == 2
    for wrong in ("tlt:something-else", None, 3):
        with pytest.raises(RuntimeError, match="out of step"):
            run([loop.GATHER, wrong])
