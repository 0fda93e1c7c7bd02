"""Data-parallel GRPO: two ranks (gloo, two processes) make the same update as one rank.

Real DeepSpeed and a real 2-process gloo group on 127.0.0.1 (the environment
variables the DeepSpeed launcher would set are set by the test), a tiny random
Qwen2 built in code. The two-rank run uses micro-batches of 2 on each rank and
the one-rank run micro-batches of 4, so the gradient averaging over ranks and
the per-rank token normalisation both have to be right for the weights to match.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_trainer_step import config, make_samples, tiny_qwen2
from tlt.services.common.ports import free_port
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step

TESTS = Path(__file__).resolve().parent

RANK_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from test_trainer_step import config, make_samples, tiny_qwen2
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step
policy = Policy(config(micro_batch_size=2, zero_stage={stage}), model=tiny_qwen2(0))
res = grpo_step(policy, make_samples(2, 4, seed=3), step=0, with_features=True)
if policy.rank == 0:
    torch.save({{"params": {{k: p.detach() for k, p in policy.module.named_parameters()}},
                "loss": res.metrics.loss, "tokens": res.metrics.tokens, "version": policy.version,
                "grad_norm": res.metrics.grad_norm,
                "featured": sum(f is not None for f in res.features)}}, {out!r})
from tlt.services.trainer.distributed import shutdown_process_group
shutdown_process_group()  # torn down together: a rank left to exit alone could abort (-6)
"""


def _run_two_ranks(tmp_path, stage: int) -> dict:
    from test_trainer_zero3 import run_two_ranks

    out = tmp_path / f"rank0-{stage}.pt"
    run_two_ranks(RANK_SCRIPT.format(tests=str(TESTS), out=str(out), stage=stage), timeout=240)
    return torch.load(out)


PRIMITIVES_SCRIPT = """
import json, os, time, torch.distributed as dist
from tlt.services.trainer.distributed import barrier, broadcast, init_process_group, is_main, world_size
init_process_group("gloo")  # the launcher's variables are set: the ranks' own group, as under `deepspeed`
rank = dist.get_rank()
got = broadcast({{"from": rank, "prompts": list(range(3 + rank))}})
if rank == 0:  # rank 1 reaches the barrier first; past it, it must see what rank 0 wrote before it
    time.sleep(0.5)
    open({out!r} + "-before-barrier", "w").write("rank 0")
barrier()
seen = os.path.exists({out!r} + "-before-barrier")
open({out!r} + str(rank), "w").write(json.dumps({{"main": is_main(), "world": world_size(), "got": got,
                                                 "seen": seen}}))
from tlt.services.trainer.distributed import shutdown_process_group
shutdown_process_group()
"""


def test_two_ranks_agree_on_the_main_rank_and_get_its_broadcast(tmp_path):
    """The primitives every multi-rank path stands on, on a real two-process gloo group (fast: no model): only rank 0
    is main (it alone talks to the rollout, rewards and disk), each rank counts two, what rank 0 broadcasts (its
    collected batch) is what rank 1 gets, not rank 1's own, and a barrier holds rank 1 until rank 0 reaches it (the
    checkpoints' barriers: rank 0 writes, then the others read). The slow loop tests above were the only ones to catch
    either going wrong."""
    import json

    from test_trainer_zero3 import run_two_ranks

    out = tmp_path / "rank"
    run_two_ranks(PRIMITIVES_SCRIPT.format(out=str(out)), timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    assert [r["main"] for r in ranks] == [True, False]
    assert [r["world"] for r in ranks] == [2, 2]
    assert [r["got"] for r in ranks] == [{"from": 0, "prompts": [0, 1, 2]}] * 2
    assert [r["seen"] for r in ranks] == [True, True], "rank 1 went past the barrier before rank 0 reached it"


@pytest.mark.slow  # two extra processes importing DeepSpeed: about a minute on two cores
def test_two_ranks_match_one_rank(tmp_path):
    torch.set_num_threads(2)
    two = _run_two_ranks(tmp_path, stage=1)
    one = Policy(config(micro_batch_size=4), model=tiny_qwen2(0))
    res = grpo_step(one, make_samples(2, 4, seed=3), step=0)
    assert two["version"] == one.version == 1
    assert two["tokens"] == res.metrics.tokens  # metrics cover the whole step on every rank
    assert two["featured"] == 4  # each rank's old-logprob pass covers only its own 4 of the 8 sequences
    assert abs(two["loss"] - res.metrics.loss) < 1e-5
    # Adam's first step is nearly blind to the gradient's scale; the norm is not: a wrong
    # per-rank normalisation (e.g. dividing by all tokens and then averaging) halves it.
    assert abs(two["grad_norm"] - res.metrics.grad_norm) < 1e-4 * res.metrics.grad_norm
    for k, p in one.module.named_parameters():
        torch.testing.assert_close(two["params"][k], p.detach(), atol=2e-6, rtol=1e-4)


LOOP_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train
cfg = TrainerConfig(model_dir={model!r}, rollout_addresses=[{address!r}], output_dir={out!r}, prompts_per_step=2,
                    n_samples=4, max_tokens=8, mini_batch_size=8, micro_batch_size=2, zero_stage=2, lr=1e-3,
                    steps=2, checkpoint_interval=1, synthetic_problems=32, connect_timeout_s=60)
s = train(cfg)
print("SUMMARY", s.steps_done, s.policy_version)
from tlt.services.trainer.distributed import shutdown_process_group
shutdown_process_group()  # torn down together: a rank left to exit alone could abort (-6)
"""


@pytest.mark.slow  # two trainer ranks and a rollout server: a minute or two on two cores
def test_two_rank_loop_against_rollout_server(random_model_dir, tmp_path):
    import json

    from rollout_helpers import ServerThread
    from tlt.services.rollout.client import RolloutClient

    out = tmp_path / "run"
    with ServerThread(random_model_dir, replicas=1) as server:
        script = LOOP_SCRIPT.format(model=str(random_model_dir), address=server.grpc_address, out=str(out))
        port = str(free_port())
        procs = []
        for rank in (0, 1):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        try:
            outputs = [p.communicate(timeout=400)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        with RolloutClient(server.grpc_address) as client:
            serving = client.status().versions.policy
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]
        assert "SUMMARY 2 2" in text
    assert serving == 2  # rank 0 pushed after each step; the other rank pushed nothing
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and all(m["optimizer_updates"] == 1 for m in lines)
    # ZeRO-2 partitions the optimizer state: both ranks wrote theirs into the one checkpoint
    engine_files = sorted(x.name for x in (out / "checkpoints" / "step-00000002" / "engine").iterdir())
    assert sum("optim_states" in f for f in engine_files) == 2, engine_files
