"""Each rollout replica's bandit explores on its own random stream: derived from [rollout.spec] seed and the
replica's index (`bandit.replica_seed`), so replicas with one config do not explore the same arm at the same
decision, while the same replica index and seed repeat exactly and replica 0 keeps the configured seed."""

from __future__ import annotations

from spec_decoder_helpers import SPEC, ckpt  # noqa: F401 - ckpt: fixture
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.engine.engine import LLMEngine
from tlt.services.rollout.spec.bandit import BucketedEpsilonGreedy, replica_seed
from tlt.services.rollout.spec.config import SpecConfig
from tlt.services.rollout.spec.tree import Arm

ARMS = [Arm.parse(a) for a in ("8_4_48", "8_4_16", "4_1_5", "plain")]


def _choices(seed: int, n: int = 200) -> list[Arm]:
    """n choices at batch 1 once every arm has one equal reward: epsilon 0.5, so about half are explored."""
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[ARMS], epsilon=0.5, seed=seed)
    for arm in ARMS:
        bandit.record(1, arm, 10, 1.0)
    return [bandit.choose(1) for _ in range(n)]


def test_replica_seeds_are_distinct_and_repeatable():
    assert replica_seed(7, 0) == 7 and replica_seed(0, 0) == 0  # one replica: the configured seed, as before
    seeds = [replica_seed(7, i) for i in range(64)]
    assert len(set(seeds)) == 64 and seeds == [replica_seed(7, i) for i in range(64)]
    assert replica_seed(8, 1) != replica_seed(7, 1)  # the configured seed still matters
    a, b = _choices(replica_seed(7, 0)), _choices(replica_seed(7, 1))
    # same decisions: an explored step at the same index picks the same arm on both only by chance (1 in 4)
    same = sum(x == y for x, y in zip(a, b))
    assert same < 150, same  # one stream for both: all 200 equal
    assert _choices(replica_seed(7, 1)) == b  # the same replica index and seed: the same choices


def test_engines_of_two_replicas_explore_differently(ckpt):  # noqa: F811
    """The replica's engine gives its decoder its index: two engines with one [rollout.spec] (as two replicas of
    one pool get) hold bandits on different streams; replica 0's is the configured seed's."""
    cfg = SpecConfig(drafter="ngram", **dict(SPEC, seed=3, epsilon=0.5))
    bandits = []
    for replica in (0, 1, 1):
        eng = LLMEngine(ckpt, EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64),
                        replica_id=replica)
        eng.enable_spec(cfg)
        bandits.append(eng.spec_decoder.bandit)
    draws = [[b._rng.random() for _ in range(20)] for b in bandits]
    assert draws[0] != draws[1] and draws[1] == draws[2]
    configured = BucketedEpsilonGreedy(seed=3)._rng
    assert draws[0] == [configured.random() for _ in range(20)]
