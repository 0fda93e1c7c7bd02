"""Dynamic sampling's rounds: how many a step rolls out, and the seeds their requests carry.

`dynamic_sampling_max_rounds` bounds the rounds of a step whose groups stay flat (a `<=` there rolled out one round
more than configured, and nothing checked the bound). Each round's requests must carry a seed of their own
(collect.request_seed of the step's key "5", "5.1", "5.2", ...): rounds seeded alike sample correlated completions
(the same uniforms), and the check against that (the mutation audit's d6) was missing too. The seeds are recorded
from the requests a real rollout server (native engine, gRPC on 127.0.0.1) is sent by the loop's own rollout side.
"""

from __future__ import annotations

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.services.trainer.collect import RolloutResult
from tlt.services.trainer.dynamic_sampling import roll_out_rounds
from tlt.services.trainer.types import PromptItem, ScoredCompletion


def test_flat_rounds_stop_at_max_rounds() -> None:
    calls = []

    def collect_round(prompts, r):  # noqa: ANN001, ANN202 - every group flat: never enough informative ones
        calls.append(r)
        return RolloutResult([ScoredCompletion(i, j, (1,), (2,), 0.0) for i in range(len(prompts)) for j in range(2)],
                             {})

    batches = iter([[PromptItem(k, f"p{k}", "1") for k in range(a, a + 2)] for a in range(0, 20, 2)])
    for max_rounds in (1, 2, 3):
        calls.clear()
        res = roll_out_rounds(next(batches), lambda: next(batches), collect_round, want=2, n=2, max_rounds=max_rounds)
        assert calls == list(range(max_rounds)) and res.rounds == max_rounds
        assert len(res.samples) == 4  # the first round's flat groups fill the step


FLAT = """
def reward(prompts, completions, answer, **kw):
    return [0.0] * len(prompts)  # every group flat: the step rolls out all its rounds
"""


@pytest.fixture(scope="module")
def server(random_model_dir):
    with ServerThread(random_model_dir, replicas=1) as s:
        yield s


def _round_seeds(cfg, out, step: int) -> list[int]:  # noqa: ANN001
    """The seed of every request the loop's rollout side sends for `step` (a fresh one each call, as a restart)."""
    from tlt.services.trainer.data import PromptSampler, synthetic_prompts
    from tlt.services.trainer.loop import _Services

    services = _Services(cfg, out, 0)
    client = services.clients[0]
    sent, real = [], client.batch_generate

    def spy(prompts, n, params, **kw):  # noqa: ANN001, ANN003, ANN202 - the real request, its seed recorded
        sent.append(params.seed)
        return real(prompts, n=n, params=params, **kw)

    client.batch_generate = spy
    sampler = PromptSampler(synthetic_prompts(16, 0), seed=0)
    try:
        res = services.rollout(sampler.next_batch(2), step, 0, lambda: sampler.next_batch(2))
    finally:
        client.close()
    assert res.rounds == 3
    return sent


def test_each_round_is_seeded_by_its_own_key_reproducibly(server, random_model_dir, tmp_path, monkeypatch) -> None:
    from tlt.services.trainer.collect import request_seed, training_params
    from tlt.services.trainer.config import TrainerConfig

    torch.set_num_threads(1)
    (tmp_path / "flat_reward.py").write_text(FLAT)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainerConfig(model_dir=str(random_model_dir), rollout_addresses=[server.grpc_address],
                        output_dir=str(tmp_path / "run"), prompts_per_step=2, n_samples=2, max_tokens=4,
                        mini_batch_size=4, micro_batch_size=4, torch_threads=1, connect_timeout_s=30, seed=11,
                        reward="python", reward_function="flat_reward:reward", dynamic_sampling=True,
                        dynamic_sampling_max_rounds=3)
    seeds = _round_seeds(cfg, tmp_path / "run", step=5)
    run_seed = training_params(cfg).seed
    assert seeds == [request_seed(run_seed, key, 0) for key in ("5", "5.1", "5.2")]
    assert len(set(seeds)) == 3  # no two rounds share their uniforms
    assert _round_seeds(cfg, tmp_path / "run", step=5) == seeds  # a redone step (a resume) sends the same
    assert set(_round_seeds(cfg, tmp_path / "run", step=6)).isdisjoint(seeds)
