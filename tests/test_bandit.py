"""The bucketed epsilon-greedy arm chooser: routing, untried-first, exploration rate, median, budget."""

from __future__ import annotations

import pytest

from tlt.services.rollout.spec.bandit import BucketedEpsilonGreedy, PlainDebt, size_class
from tlt.services.rollout.spec.tree import Arm

A, B, C = Arm.parse("8_4_48"), Arm.parse("8_4_16"), Arm.parse("4_1_5")


def test_bucket_routing_and_labels():
    bandit = BucketedEpsilonGreedy()
    assert [bandit.bucket(n) for n in (1, 2, 4, 5, 20, 21, 500)] == [0, 1, 1, 2, 2, 3, 3]
    assert [bandit.label(i) for i in range(4)] == ["1", "2-4", "5-20", ">=21"]
    assert bandit.choose(1) in bandit.arms[0] and bandit.choose(64) in bandit.arms[3]
    assert bandit.arms[0][0] == A  # larger trees for the smallest batches
    with pytest.raises(ValueError, match="one arm list per bucket"):
        BucketedEpsilonGreedy(thresholds=(1, 2), bucket_arms=[[A]])
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketedEpsilonGreedy(thresholds=(2, 1), bucket_arms=[[A], [B]])
    with pytest.raises(ValueError, match="steps_topk_drafttokens"):
        BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[["8x4"]])


def test_untried_arms_first_then_best_median():
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A, B, C]], epsilon=0.0)
    first = []
    for reward in (100.0, 300.0, 200.0):
        arm = bandit.choose(1)
        first.append(arm)
        bandit.record(1, arm, emitted_tokens=int(reward), step_seconds=1.0)
    assert first == [A, B, C]
    assert all(bandit.choose(1) == B for _ in range(20))


def test_a_withdrawn_choice_is_not_counted():
    """The decoder withdraws a choice whose step found no KV room (it decoded plainly): chosen, explored and
    exploited count the steps each arm ran."""
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A, B]], epsilon=0.0)
    assert bandit.choose(1) == A  # untried: explored
    bandit.withdraw()
    snap = bandit.snapshot()[0]
    assert (snap.explored, snap.exploited, [a.chosen for a in snap.arms]) == (0, 0, [0, 0])
    with pytest.raises(RuntimeError, match="withdraw without a choice"):
        bandit.withdraw()  # once per choice
    bandit.record(1, A, 10, 1.0)
    bandit.record(1, B, 20, 1.0)
    assert bandit.choose(1) == B  # exploited
    assert bandit.choose(1) == B
    bandit.withdraw()
    snap = bandit.snapshot()[0]
    assert (snap.explored, snap.exploited, [a.chosen for a in snap.arms]) == (0, 1, [0, 1])


def test_median_is_robust_to_an_outlier():
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A, B]], epsilon=0.0)
    for r in (10, 10, 10, 10_000):  # one freak fast step: the mean would prefer A
        bandit.record(1, A, r, 1.0)
    for r in (20, 20, 20):
        bandit.record(1, B, r, 1.0)
    assert bandit.choose(1) == B
    # reward is tokens per second over the whole batch
    assert bandit.record(4, A, emitted_tokens=24, step_seconds=0.5) == 48.0


def test_exploration_frequency_is_epsilon():
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A, B, C]], epsilon=0.1, seed=3)
    for arm, r in ((A, 5), (B, 50), (C, 10)):
        bandit.record(1, arm, r, 1.0)
    n = 4000
    picks = [bandit.choose(1) for _ in range(n)]
    non_best = sum(p != B for p in picks) / n
    # random arm with prob 0.1, which is not the best with prob 2/3: 0.0667 expected (sd ~0.004)
    assert 0.05 < non_best < 0.085
    snap = bandit.snapshot()[0]
    assert snap.explored + snap.exploited == n
    assert 0.08 < snap.explored / n < 0.12


def test_sliding_window_forgets_old_rewards():
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A, B]], epsilon=0.0, window=3)
    for _ in range(3):
        bandit.record(1, A, 100, 1.0)
        bandit.record(1, B, 50, 1.0)
    assert bandit.choose(1) == A
    for _ in range(3):  # A got slow (e.g. the drafter went stale): its old rewards leave the window
        bandit.record(1, A, 10, 1.0)
    assert bandit.choose(1) == B
    stats = {s.arm: s for s in bandit.snapshot()[0].arms}
    assert stats[A.name].samples == 3 and stats[A.name].median_reward == 10.0


def test_verify_token_budget_guard():
    bandit = BucketedEpsilonGreedy(thresholds=(1, 2), bucket_arms=[[A], [A, B, C]], epsilon=0.0,
                                   verify_token_budget=64)
    assert bandit.eligible(1) == (A,)  # 48 x 1 <= 64
    assert bandit.eligible(3) == (B, C)  # 48 x 3 exceeds 64; 16 x 3 and 5 x 3 fit
    assert bandit.eligible(5) == (C,)  # 16 x 5 exceeds 64 too
    seen = {bandit.choose(5) for _ in range(10)}
    assert seen == {C}
    with pytest.raises(ValueError, match="not in bucket"):
        bandit.record(1, B, 10, 1.0)


def test_verify_token_budget_guard_holds_when_no_arm_fits():
    """Every arm over the budget: the guard used to fall back to the arm with the fewest draft tokens,
    which still verified more than the budget (5 x 100 = 500 > 64). Now no arm is chosen (the step
    decodes plainly), no choice is counted, and the bucket counts the step as over_budget."""
    bandit = BucketedEpsilonGreedy(thresholds=(1, 2), bucket_arms=[[A], [A, B, C]], epsilon=0.0,
                                   verify_token_budget=64)
    assert bandit.eligible(100) == ()
    assert [bandit.choose(100) for _ in range(3)] == [None] * 3
    snap = bandit.snapshot()[1]
    assert (snap.over_budget, snap.explored, snap.exploited) == (3, 0, 0)
    assert all(a.chosen == 0 for a in snap.arms)
    # "plain" verifies nothing: it always fits, even where 1 token x batch would exceed the budget
    plain = Arm.parse("plain")
    with_plain = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[plain, C]], verify_token_budget=64)
    assert with_plain.eligible(100) == (plain,) and with_plain.choose(100) == plain
    assert with_plain.snapshot()[0].over_budget == 0


def test_arms_are_compared_at_the_batch_size_they_run_at():
    """Tokens/s grows with the batch: within the 2-4 bucket an arm measured at batch 4 must not beat a
    better arm measured at batch 2. A rollout's batch only falls, so the arm tried first is the one
    measured at the largest batch (what made the cold bandit pick a short arm in `tlt bench rollout`)."""
    speed = {A: 100.0, B: 80.0, C: 60.0}  # tokens/s per sequence: A is best at every batch size

    def step(batch: int) -> Arm:
        arm = bandit.choose(batch)
        bandit.record(batch, arm, emitted_tokens=int(speed[arm] * batch), step_seconds=1.0)
        return arm

    bandit = BucketedEpsilonGreedy(thresholds=(1, 2), bucket_arms=[[A], [C, B, A]], epsilon=0.0)
    assert [step(4) for _ in range(3)] == [C, B, A]  # untried at batch 4 first, in list order
    assert step(4) == A
    # the batch falls to 2: C's and B's batch-4 rewards (240, 320 tok/s) beat anything at batch 2 (<= 200),
    # so comparing across the bucket would keep them; every arm is tried at 2, then A wins there too
    assert [step(2) for _ in range(3)] == [C, B, A]
    assert all(step(2) == A for _ in range(10))
    assert step(3) == C  # a batch size not seen yet: untried arms first again
    stats = {s.arm: s for s in bandit.snapshot()[1].arms}
    assert stats[A.name].median_by_batch[4] == 400.0 and stats[A.name].median_by_batch[2] == 200.0
    assert stats[C.name].samples == 3 and stats[C.name].median_by_batch == {2: 120.0, 3: 180.0, 4: 240.0}
    # median_reward: at the bucket's latest batch size (3), where only C has run so far
    assert stats[C.name].median_reward == 180.0 and stats[A.name].median_reward is None


def test_window_median_matches_statistics_median():
    import random
    import statistics
    from collections import deque

    from tlt.services.rollout.spec.bandit import _Window

    rng = random.Random(1)
    for size in (1, 2, 5, 300):
        w, ref = _Window(size), deque(maxlen=size)
        for _ in range(3 * size + 7):
            x = rng.choice([rng.random(), 0.5, float(rng.randint(0, 3))])  # ties too
            w.add(x)
            ref.append(x)
            assert len(w) == len(ref) and w.median() == statistics.median(ref)


def test_first_bucket_label_covers_the_batches_routed_to_it():
    """Batches below the first threshold use bucket 0, so its label (on /metrics and GetStatus) must
    include them: with thresholds (2, 5) batch 1 was recorded under a bucket labelled "2-4"."""
    bandit = BucketedEpsilonGreedy(thresholds=(2, 5), bucket_arms=[[A], [B]], epsilon=0.0)
    assert bandit.bucket(1) == 0
    assert [bandit.label(i) for i in range(2)] == ["1-4", ">=5"]
    assert BucketedEpsilonGreedy(thresholds=(3,), bucket_arms=[[A]]).label(0) == ">=1"


@pytest.mark.parametrize("keep,flips", [(8, True), (300, False)])
def test_a_new_drafter_takes_over_the_medians_within_a_few_steps(keep, flips):
    """300 rewards of a drafter that was never right (A far below plain), then a hot-swap to a good one. Kept
    whole, the stale window outvotes 9 good rewards and the bandit stays on plain; cut to the last 8, the 9 new
    rewards are the median's majority and A is chosen. The plain arm's window does not depend on the drafter."""
    plain = Arm.parse("plain")
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A, plain]], epsilon=0.0)
    for _ in range(300):
        bandit.record(4, A, 1, 1.0)
        bandit.record(4, plain, 4, 1.0)
    assert bandit.choose(4) == plain
    bandit.drafter_changed(keep)
    for _ in range(9):
        bandit.record(4, A, 12, 1.0)
    assert (bandit.choose(4) == A) is flips
    stats = {a.arm: a.samples for a in bandit.snapshot()[0].arms}
    assert stats == {A.name: min(keep + 9, 300), "plain": 300}  # (a window holds 300)


def test_forgetting_a_drafter_entirely_makes_its_arms_untried():
    plain = Arm.parse("plain")
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[plain, A]], epsilon=0.0)
    bandit.record(2, plain, 8, 1.0)
    bandit.record(2, A, 1, 1.0)
    assert bandit.choose(2) == plain
    bandit.drafter_changed(0)
    assert bandit.choose(2) == A  # untried first: the new drafter is measured at once
    with pytest.raises(ValueError, match="keep"):
        bandit.drafter_changed(-1)


def test_budget_guard_admits_an_arm_that_exactly_fills_the_budget():
    # "skips arms whose draft_tokens x batch_size EXCEEDS the budget": 16 x 2 = 32 = budget fits, 48 x 2 does not
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A, B]], epsilon=0.0, verify_token_budget=32)
    assert bandit.eligible(2) == (B,)
    assert bandit.eligible(3) == ()  # 16 x 3 = 48 > 32
    assert bandit.choose(2) == B and bandit.choose(3) is None


def test_a_bucket_with_one_arm_never_explores():
    # exploring among one arm is no exploration: with epsilon 1 the single arm is exploited, and the snapshot's
    # explored / exploited counts say so
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A]], epsilon=1.0)
    assert bandit.choose(1) == A  # untried: counted as explored once
    bandit.record(1, A, 10, 1.0)
    assert [bandit.choose(1) for _ in range(5)] == [A] * 5
    snap = bandit.snapshot()[0]
    assert (snap.explored, snap.exploited) == (1, 5)


def test_record_rejects_a_zero_step_time_with_a_value_error():
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A]])
    for bad in (0.0, 0, -1.0):
        with pytest.raises(ValueError, match="step_seconds"):
            bandit.record(1, A, 10, bad)


def test_snapshot_after_forgetting_a_drafter_has_no_empty_windows():
    plain = Arm.parse("plain")
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[plain, A]], epsilon=0.0)
    bandit.record(2, plain, 8, 1.0)
    bandit.record(2, A, 6, 1.0)
    bandit.record(3, A, 9, 1.0)
    bandit.drafter_changed(0)
    stats = {s.arm: s for s in bandit.snapshot()[0].arms}  # status and /metrics read this after a hot-swap
    assert stats[A.name].samples == 0 and stats[A.name].median_reward is None
    assert stats[A.name].median_by_batch == {}
    assert stats["plain"].samples == 1 and stats["plain"].median_by_batch == {2: 8.0}


def test_thresholds_must_start_at_one_or_more():
    with pytest.raises(ValueError, match=">= 1"):
        BucketedEpsilonGreedy(thresholds=(0, 2), bucket_arms=[[A], [B]])
    with pytest.raises(ValueError, match=">= 1"):
        BucketedEpsilonGreedy(thresholds=(-3,), bucket_arms=[[A]])


def test_size_classes_above_exact_sizes():
    """Exact sizes up to `exact_sizes`; above, classes a factor <= 2^(1/4) wide that tile every size once."""
    assert [size_class(b) for b in range(1, 17)] == list(range(1, 17))
    starts = sorted({size_class(b) for b in range(17, 1000)})
    assert starts[:10] == [17, 21, 25, 30, 36, 43, 52, 62, 74, 89]
    for lo, hi in zip(starts, starts[1:]):  # class [lo, hi - 1]
        assert all(size_class(b) == lo for b in range(lo, hi))
        assert (hi - 1) / lo <= 2**0.25
    assert size_class(5, exact_sizes=4) == 5 and size_class(4, exact_sizes=4) == 4
    assert [size_class(b, exact_sizes=1) for b in (1, 2, 3)] == [1, 2, 3]  # classes of one size while ratio < 2


def test_a_large_falling_batch_exploits_instead_of_exploring_every_new_size():
    """A rollout's batch above the exact sizes falls by several sequences a step and rarely repeats a size. With
    windows per exact size every step would be an untried size (each arm tried again, in list order, whatever
    it did one size up); within classes the bandit learns that drafting does not pay and stays on plain."""
    plain, chain = Arm.parse("plain"), Arm.parse("3_1_4")
    tokens_per_seq_second = {plain: 10.0, chain: 4.0}  # a drafter that is never right: verify passes cost 2.5x

    def rollout(bandit: BucketedEpsilonGreedy) -> int:
        chosen = 0
        for batch in range(64, 16, -3):  # 16 steps at 16 distinct sizes
            arm = bandit.choose(batch)
            bandit.record(batch, arm, emitted_tokens=int(tokens_per_seq_second[arm] * batch), step_seconds=1.0)
            chosen += arm == chain
        return chosen

    classes = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[chain, plain]], epsilon=0.0)
    exact = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[chain, plain]], epsilon=0.0, exact_sizes=1000)
    assert rollout(exact) == 16  # the first arm at every new size: never learns
    assert rollout(classes) <= 8  # once per class (17-20, ..., 62-73: 8 classes), then plain
    assert rollout(classes) == 0  # the next rollout (the bandit lives across RL steps): plain throughout
    with pytest.raises(ValueError, match="exact_sizes"):
        BucketedEpsilonGreedy(exact_sizes=0)


def test_amend_replaces_a_recorded_reward():
    """The decoder charges a "plain" step the drafter catch-up it left to the next verify step once that is timed:
    `amend` puts the lower reward in the recorded one's place (the median moves), and finds nothing once the
    window has let the reward go."""
    plain = Arm.parse("plain")
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[A, plain]], epsilon=0.0, window=3)
    bandit.record(1, A, 20, 1.0)
    bandit.record(1, plain, 30, 1.0)
    slot = bandit.last_slot
    assert bandit.choose(1) == plain
    assert bandit.amend(1, plain, slot, 30 / 3.0)  # the step really took 3 s: 10 tok/s, below A's 20
    assert bandit.choose(1) == A and bandit.snapshot()[0].arms[1].median_reward == 10.0
    for _ in range(3):
        bandit.record(1, plain, 40, 1.0)  # the amended reward leaves the 3-reward window
    assert not bandit.amend(1, plain, slot, 1.0) and bandit.snapshot()[0].arms[1].median_reward == 40.0
    assert not bandit.amend(5, B, 0, 2.0)  # an arm not in the bucket: nothing to amend


def test_amend_keeps_each_reward_in_its_own_slot_when_two_are_equal():
    """`amend` replaced the newest reward equal to the old value: of two equal plain rewards, amending the older
    one changed the newer one's slot, so the amended value stayed in the window one reward too long and the
    unamended one left first. Each reward is amended in its own slot now (`last_slot`)."""
    plain = Arm.parse("plain")
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[plain]], epsilon=0.0, window=2)
    bandit.record(1, plain, 30, 1.0)
    older = bandit.last_slot
    bandit.record(1, plain, 30, 1.0)
    assert bandit.amend(1, plain, older, 10.0)  # the older step is charged: window (10, 30)
    bandit.record(1, plain, 40, 1.0)  # pushes the older step's reward out: (30, 40)
    assert bandit.snapshot()[0].arms[0].median_reward == 35.0


def test_a_catch_up_owed_by_more_plain_steps_than_the_window_is_shared_by_all_of_them():
    """More than `window` plain steps in a row: the catch-up seconds (the drafter taking in every one of their
    tokens) were shared by the last `window` steps alone, each charged for the older steps' tokens as well, so the
    plain arm's median came out too low (6 steps of 2 tokens in 1 s, a 6 s catch-up, window 3: 0.67 tok/s where
    the steps ran at 1.0). The share is each step's tokens over all the steps' now."""
    plain = Arm.parse("plain")
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[plain]], epsilon=0.0, window=3)
    debt = PlainDebt(bandit)
    for _ in range(6):
        bandit.record(1, plain, 2, 1.0)
        debt.add(1, plain, 2, 1.0, bandit.last_slot)
    assert debt.charge(6.0) == 6.0 and bandit.snapshot()[0].arms[0].median_reward == 1.0
    assert debt.charge(5.0) == 0.0  # charged once: nothing owed any more


def test_a_catch_up_reaches_the_plain_steps_of_every_batch_size_still_in_their_windows():
    """PlainDebt kept the last `window` plain steps over all batch sizes, but each size has a window of its own: two
    steps at batch 1 followed by two at batch 2 (window 2) dropped the batch-1 steps, still the whole batch-1
    window, so their rewards kept no share of the catch-up (2.0 tok/s where each step ran at 1.0). Each size's
    last `window` steps are kept now."""
    plain = Arm.parse("plain")
    bandit = BucketedEpsilonGreedy(thresholds=(1,), bucket_arms=[[plain]], epsilon=0.0, window=2)
    debt = PlainDebt(bandit)
    for batch in (1, 1, 2, 2):
        bandit.record(batch, plain, 2, 1.0)
        debt.add(batch, plain, 2, 1.0, bandit.last_slot)
    assert debt.charge(4.0) == 4.0  # 8 tokens: 1 s each
    assert bandit.snapshot()[0].arms[0].median_by_batch == {1: 1.0, 2: 1.0}
