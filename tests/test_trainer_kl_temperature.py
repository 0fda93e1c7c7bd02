"""The KL reference of `tlt train` scores at the run's temperature, as the policy does.

Real parts: a rollout server (replica process, native engine, grpc.aio on 127.0.0.1) sampling at temperature 0.7,
the trainer's loop with DeepSpeed (gloo, CPU) and a reference model (kl_beta > 0) that is the policy's own start
checkpoint. Policy and reference logprobs are the softmax of logits / temperature (policy.response_logprobs); before
the first update the two models are one, so the step's k3 KL is 0 unless the reference scores at another
temperature (built at 1.0, this random model's KL to the policy at 0.7 is 2.6e-3 per token, and the KL term pulls
the policy towards the temperature-1 distribution).
"""

from __future__ import annotations

import json

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def test_the_reference_scores_at_the_runs_temperature(random_model_dir, tmp_path):
    with ServerThread(random_model_dir, replicas=1) as server:
        cfg = TrainerConfig(model_dir=str(random_model_dir), rollout_addresses=[server.grpc_address],
                            output_dir=str(tmp_path / "run"), prompts_per_step=2, n_samples=4, max_tokens=12,
                            mini_batch_size=8, micro_batch_size=4, lr=1e-3, steps=1, checkpoint_interval=0,
                            synthetic_problems=64, torch_threads=1, connect_timeout_s=30, eval_problems=0,
                            temperature=0.7, kl_beta=0.1)  # reference_model_dir unset: the policy's start checkpoint
        train(cfg)
    (m,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert m["optimizer_updates"] == 1 and m["tokens"] > 0
    assert m["rollout_logprob_max_diff"] < 1e-3  # the rollout's logprobs are at 0.7 too: the trainer's scale
    assert m["kl"] == pytest.approx(0.0, abs=1e-6), m["kl"]  # one model, one temperature: no KL
