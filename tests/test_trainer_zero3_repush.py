"""ZeRO-3 on two ranks: a rollout server restarted mid-run gets the weights again, the ranks gathering them together.

Under ZeRO-3 each rank holds a slice of every weight, so reading them whole is a collective. Rank 0 alone talks to
the rollout, and it finds a restarted server (one serving its start checkpoint, version 0) mid-rollout or mid-eval,
while the other ranks wait in a broadcast. The run used to end there (StaleWeightsError, "ZeRO-3 on several ranks"
in the hint: rank 0 cannot start a gather alone), losing the steps since the last checkpoint. Now rank 0 calls the
others into the gather through that broadcast (loop.GATHER) and pushes again, as one rank does
(test_trainer_repush.py).

Real parts: DeepSpeed ZeRO-3 on a two-process gloo group (the zero3 tests' rank server), the rollout server
(replica process, native engine, gRPC on 127.0.0.1) started by rank 0 and restarted on the same ports twice, the
task verifier in-process. The restarts are made by wrapping rank 0's collect call; nothing in the trainer is stubbed.
"""

from __future__ import annotations

import json

import torch

from test_trainer_zero3 import TESTS, run_two_ranks
from tlt.services.common.ports import free_port

# Rank 0's collect calls, in order: 0 eval before step 0, 1 step 0, 2 eval after step 0 (restart: rank 1 waits for
# the eval's end), 3 its redo, 4 step 1, 5 eval after step 1, 6 step 2 (restart: rank 1 waits for the rollout), 7 its
# redo, 8 the last eval.
RESTART_BEFORE = (2, 6)

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

servers, seen, calls = [], [], [0]
if os.environ["RANK"] == "0":
    from rollout_helpers import ServerThread

    def start():
        servers.append(ServerThread(Path({model!r}), replicas=1, grpc_port={grpc_port}, http_port={http_port}).__enter__())

    start()
    real = collect.collect_retrying

    def wrapped(*args, **kw):
        calls[0] += 1
        if calls[0] - 1 in {restart_before}:
            servers[-1].__exit__()
            start()
        try:
            result = real(*args, **kw)
        except StaleWeightsError as e:
            seen.append(["dropped", re.search(r"version\\(s\\) (\\[[\\d, ]*\\])", str(e))[1]])
            raise
        seen.append(sorted({{s.policy_version for s in result.samples}}))
        return result

    collect.collect_retrying = wrapped
try:
    cfg = TrainerConfig(model_dir={model!r}, rollout_addresses=["127.0.0.1:{grpc_port}"], output_dir={out!r},
                        prompts_per_step=2, n_samples=2, max_tokens=8, mini_batch_size=4, micro_batch_size=2,
                        zero_stage=3, lr=1e-3, steps=3, checkpoint_interval=1, synthetic_problems=64,
                        eval_problems=2, eval_interval=1, eval_greedy=False, connect_timeout_s=60)
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


def test_a_rollout_server_restarted_mid_eval_and_mid_rollout_gets_the_weights_gathered_by_both_ranks(
        random_model_dir, tmp_path) -> None:
    torch.set_num_threads(1)
    out, report = tmp_path / "run", tmp_path / "report.json"
    run_two_ranks(SCRIPT.format(tests=str(TESTS), model=str(random_model_dir), grpc_port=free_port(),
                                http_port=free_port(), out=str(out), report=str(report),
                                restart_before=set(RESTART_BEFORE)), timeout=400)
    r = json.loads(report.read_text())
    assert r["servers"] == 3, "the server was not restarted twice"
    # each restarted server's first rollout is dropped at its first completion (version 0), and the batch rolled out
    # again from the version pushed to it again
    assert r["seen"] == [[0], [0], ["dropped", "[0]"], [1], [1], [2], ["dropped", "[0]"], [2], [3]], r["seen"]
    assert r["steps"] == 3 and r["version"] == 3 and r["serving"] == 3
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2] and [m["policy_version"] for m in lines] == [1, 2, 3]
    assert [m["rollout_retries"] for m in lines] == [0, 0, 1]
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["after_steps"] for e in evals] == [0, 1, 2, 3] and [e["policy_version"] for e in evals] == [0, 1, 2, 3]
