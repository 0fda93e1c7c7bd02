"""A stale rollout (a rollout server restarted since the push: its completions carry an older policy version) is
dropped at its first completion, before any of it is scored.

VersionGuard checked the versions only once `collect` returned, that is once every completion was scored: a reward
server (`reward = "grpc"`) scored the whole stale rollout for nothing before the batch was pushed again and rolled out
anew, and where no second push could mend it (no repush, a server serving a newer version) the step failed only then.
A completion's version is known when it arrives, and since 555353c a reward call can be cancelled: now a completion of
another version than the guard expects fails the rollout at once (StaleWeightsError), its streams and reward calls
cancelled, none of the stale completions submitted for scoring. Real rollout (native engine) and reward servers on
127.0.0.1.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.services.trainer.collect import collect_retrying, sampling_params
from tlt.services.trainer.types import PromptItem

WORKERS, ITEM_S = 2, 0.1  # the reward server's workers, and each item's scoring time


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server(random_model_dir):
    with ServerThread(random_model_dir, replicas=1) as s:
        yield s


@pytest.fixture
def reward_server():
    """A real reward server whose verifier records each completion it scores (ITEM_S each)."""
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer

    scored: list[str] = []
    lock = threading.Lock()

    def slow(prompt: str, completion: str, reference: str) -> bool:
        with lock:
            scored.append(completion)
        time.sleep(ITEM_S)
        return True

    with RewardServer(RewardConfig(host="127.0.0.1", port=0, workers=WORKERS), verifier=slow) as rs:
        rs.scored = scored
        yield rs


def _prompts(k: int) -> list[PromptItem]:
    return [PromptItem(i, f"{i}+{i}=", str(2 * i)) for i in range(k)]


def _weights(model_dir) -> dict:  # noqa: ANN001 - Path
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_a_stale_rollout_is_dropped_before_any_of_it_is_scored(random_model_dir, server, reward_server) -> None:
    """The server serves an older version than the guard expects (it restarted from its start checkpoint): the
    guard pushes again and rolls the batch out again. Before, the stale rollout's 16 completions were all scored
    first (32 scored for 16 kept); now none of them is sent to the reward server."""
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.rewards import GrpcRewards
    from tlt.services.trainer.weight_sync import VersionGuard, WeightPublisher

    weights = _weights(random_model_dir)
    rewards = GrpcRewards(reward_server.address, concurrency=8, timeout_s=10, retries=0)
    try:
        with RolloutClient(server.grpc_address) as real:
            version = real.status().versions.policy + 1
            publisher = WeightPublisher([real])
            guard = VersionGuard([real], repush=lambda behind, v: publisher.push(weights, v, clients=behind))
            res = guard.collect(lambda: collect_retrying(_prompts(4), [real], rewards, 4,
                                                         sampling_params(8, 1.0, 1.0, seed=3), 1, retries=1,
                                                         wait_s=10), version)
    finally:
        rewards.close()
    assert guard.repushes == 1 and {s.policy_version for s in res.samples} == {version}
    assert len(res.samples) == 16 and res.retries == 1
    assert len(reward_server.scored) == 16, f"{len(reward_server.scored)} completions scored for 16 kept"


def test_a_stale_rollout_that_no_push_can_mend_fails_at_its_first_completion(server, reward_server) -> None:
    """No repush (a VersionGuard given none): the step fails with StaleWeightsError, as before, but without scoring
    the rollout first (before: all 16 scored, ITEM_S x 16 / WORKERS = 0.8 s of the reward server's time)."""
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.rewards import GrpcRewards
    from tlt.services.trainer.weight_sync import StaleWeightsError, VersionGuard

    rewards = GrpcRewards(reward_server.address, concurrency=8, timeout_s=10, retries=0)
    try:
        with RolloutClient(server.grpc_address) as real:
            version = real.status().versions.policy + 1
            guard = VersionGuard([real])
            with pytest.raises(StaleWeightsError, match=rf"but version {version} was pushed"):
                guard.collect(lambda: collect_retrying(_prompts(4), [real], rewards, 4,
                                                       sampling_params(8, 1.0, 1.0, seed=3), 2, retries=1,
                                                       wait_s=10), version)
    finally:
        rewards.close()
    time.sleep(2 * ITEM_S)  # a call the server had taken would be recorded by now
    assert reward_server.scored == []
