"""Bucketed epsilon-greedy (BEG) bandit: which draft shape to use at the current batch size.

Batch sizes are split into buckets by ascending thresholds (default 1, 2, 5, 21 -> buckets 1, 2-4,
5-20, >= 21); each bucket has its own arms (larger trees for smaller batches, where verifying many
tokens is nearly free). Within a bucket, at the current batch size B:

    1. arms without data at B are tried first (in list order);
    2. with probability epsilon a random arm is explored;
    3. otherwise the arm with the highest MEDIAN reward at B over its sliding window is exploited
       (the median ignores a step that was slow for an unrelated reason, e.g. a prefill).

Arms are compared at the batch size they will run at, not across the bucket: tokens per second
grows with the batch, so within the 2-4 bucket an arm whose rewards came from batch 4 would beat
one measured at batch 2 whatever their shapes (a rollout's batch only falls through a bucket, so
the arm tried first is measured at its largest batch). The bucket still decides which arms compete
and holds their statistics; each (arm, batch size) keeps its own window of the last `window` rewards.
Above `exact_sizes` (default 16) the "batch size" is a class of sizes within a factor 2^(1/4) of
each other (17-20, 21-24, 25-29, 30-35, ...; `size_class`): at large batch the running batch rarely
repeats a size (several sequences finish per step), so exact sizes would make nearly every step an
untried size and the bandit would only ever explore (seen with SD on up to batch 64 on CPU: a
random drafter was tried at every new size); and there tokens/s changes by a few percent across a
class, where at batch 2-4 it changes by 2x.

A new drafter (a hot-swap) makes the drafting arms' rewards stale: `drafter_changed(keep)` cuts each
drafting arm's windows to their last `keep` rewards (the "plain" arm's stay: they do not depend on the
drafter), so the new drafter's rewards take over the medians within a few steps instead of after half a
window (300 rewards of a drafter that was never right kept an improved one unused).

Reward of one SD step = tokens kept over the whole batch (accepted drafts + one bonus per
sequence, less what a stop cut off: the engine passes the count it appended) / step wall time:
measured tokens per second. A "plain" step's reward is amended later (`amend`, in the slot `record` put it in)
when the drafter catch-up it left to the next verify step is timed: that time is the plain steps' since the drafter
was last up to date, each its share by tokens (`PlainDebt`, SpecDecoder._catch_up). A guard skips arms whose
draft_tokens x batch_size exceeds the verify-token budget ("plain" verifies nothing and always fits);
if it skips every arm, `choose` returns None: that step decodes plainly, unrewarded (no arm was
chosen) and counted per bucket as `over_budget`. The RNG is seeded; each rollout replica's from the configured
seed and its index (`replica_seed`), so replicas of one pool do not explore the same arm at the same decision.
Not thread-safe: the engine step loop owns it.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tlt.services.rollout.spec.arm import Arm

DEFAULT_THRESHOLDS = (1, 2, 5, 21)
EXACT_SIZES = 16  # batch sizes compared exactly; above, classes a factor CLASS_RATIO wide
CLASS_RATIO = 2**0.25


def size_class(batch_size: int, exact_sizes: int = EXACT_SIZES) -> int:
    """The batch size whose statistics a step at `batch_size` uses: itself up to `exact_sizes`, else the smallest
    size of its class. Classes start at exact_sizes + 1 and each next one at ceil(start x 2^(1/4)) (at least
    one further): 17, 21, 25, 30, 36, 43, 52, 62, 74, 89, ... for the default 16."""
    if batch_size <= exact_sizes:
        return batch_size
    start = exact_sizes + 1
    while True:
        nxt = max(start + 1, math.ceil(start * CLASS_RATIO))
        if batch_size < nxt:
            return start
        start = nxt


def replica_seed(seed: int, replica: int) -> int:
    """The bandit seed of rollout replica `replica` under the configured `seed`: the seed itself for replica 0 (a
    single replica explores as before), else a 64-bit value hashed from both. One seed for every replica made their
    epsilon-greedy draws identical: each explored at the same decisions and picked the same arm there."""
    if replica == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"tlt-bandit/{seed}/{replica}".encode(), digest_size=8).digest(), "big")


DEFAULT_BUCKET_ARMS = (
    ("8_4_48", "8_4_32", "8_4_16"),
    ("8_4_32", "8_4_16", "8_4_8"),
    ("8_4_16", "8_4_8", "4_1_5"),
    ("8_4_8", "4_1_5"),
)


class _Window:
    """The last `size` rewards in arrival order, plus the same values sorted: the median is O(1) and a new
    reward costs one bisect insert (and one removal once full) instead of a sort of the window per choice."""

    def __init__(self, size: int) -> None:
        self.recent: deque[float] = deque()
        self.sorted: list[float] = []
        self.size = size
        self.added = 0  # rewards ever added: the slot of the k-th (from 0) is k

    def add(self, reward: float) -> int:
        """Add `reward`; returns its slot (for `replace`)."""
        self.keep_last(self.size - 1)  # room for this one
        self.recent.append(reward)
        bisect.insort(self.sorted, reward)
        self.added += 1
        return self.added - 1

    def replace(self, slot: int, new: float) -> bool:
        """Put `new` in place of the reward added in `slot` (its arrival order kept); False when that reward has
        left the window."""
        i = slot - (self.added - len(self.recent))  # the oldest held is the one added len(recent) rewards ago
        if not 0 <= i < len(self.recent):
            return False
        old, self.recent[i] = self.recent[i], new
        del self.sorted[bisect.bisect_left(self.sorted, old)]
        bisect.insort(self.sorted, new)
        return True

    def keep_last(self, n: int) -> None:
        while len(self.recent) > n:
            old = self.recent.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]

    def median(self) -> float:
        xs, n = self.sorted, len(self.sorted)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    def __len__(self) -> int:
        return len(self.recent)


@dataclass(frozen=True)
class ArmStats:
    arm: str
    samples: int  # rewards held, over every batch size of the bucket
    median_reward: float | None  # tokens/s at the bucket's latest batch size (what choices compare); None: no data
    chosen: int
    median_by_batch: dict[int, float]  # batch size (above exact_sizes: its class's smallest) -> median reward


@dataclass(frozen=True)
class BucketStats:
    label: str  # e.g. "2-4", ">=21"
    arms: tuple[ArmStats, ...]
    explored: int
    exploited: int
    over_budget: int  # steps at which no arm fit the verify-token budget (decoded plainly, no choice)


def bucket_label(thresholds: Sequence[int], i: int) -> str:
    """Bucket i of `thresholds` as status and config errors name it (1, 2-4, >=21)."""
    lo = 1 if i == 0 else thresholds[i]  # batches below the first threshold use bucket 0 too
    if i + 1 == len(thresholds):
        return f">={lo}"
    hi = thresholds[i + 1] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"


class BucketedEpsilonGreedy:
    def __init__(
        self,
        thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
        bucket_arms: Sequence[Sequence[Arm | str]] = DEFAULT_BUCKET_ARMS,
        epsilon: float = 0.1,
        window: int = 300,
        verify_token_budget: int | None = None,
        seed: int = 0,
        exact_sizes: int = EXACT_SIZES,
    ) -> None:
        if len(thresholds) != len(bucket_arms):
            raise ValueError(f"{len(thresholds)} bucket thresholds but {len(bucket_arms)} arm lists; give one arm list per bucket")
        if list(thresholds) != sorted(set(thresholds)) or not thresholds or thresholds[0] < 1:
            raise ValueError(f"bucket thresholds must be strictly increasing and >= 1, got {list(thresholds)}")
        if not 0 <= epsilon <= 1:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if exact_sizes < 1:
            raise ValueError(f"exact_sizes must be >= 1, got {exact_sizes}")
        self.exact_sizes = exact_sizes
        self.thresholds = tuple(thresholds)
        self.arms = tuple(tuple(a if isinstance(a, Arm) else Arm.parse(a) for a in arms) for arms in bucket_arms)
        for i, arms in enumerate(self.arms):
            if not arms:
                raise ValueError(f"bucket {self.label(i)} has no arms")
        self.epsilon = epsilon
        self.window = window
        self.last_slot = -1  # the slot of the reward `record` added last (for `amend`)
        self.budget = verify_token_budget
        self._rng = random.Random(seed)
        # bucket -> arm -> batch size -> the last `window` rewards at that size
        self._rewards: list[dict[Arm, dict[int, _Window]]] = [{a: {} for a in arms} for arms in self.arms]
        self._chosen = [{a: 0 for a in arms} for arms in self.arms]
        self._latest_size: list[int | None] = [None] * len(self.arms)  # per bucket: the last batch size recorded
        self._explored = [0] * len(self.arms)
        self._exploited = [0] * len(self.arms)
        self._over_budget = [0] * len(self.arms)
        self._last: tuple[int, Arm, bool] | None = None  # the last choice (bucket, arm, explored): `withdraw`

    def bucket(self, batch_size: int) -> int:
        """Index of the last threshold <= batch_size (batches below the first threshold use bucket 0)."""
        i = 0
        for j, t in enumerate(self.thresholds):
            if batch_size >= t:
                i = j
        return i

    def label(self, i: int) -> str:
        return bucket_label(self.thresholds, i)

    def eligible(self, batch_size: int) -> tuple[Arm, ...]:
        """The bucket's arms within the verify-token budget at this batch size; may be empty. "plain"
        always fits: it verifies nothing."""
        arms = self.arms[self.bucket(batch_size)]
        if self.budget is None:
            return arms
        return tuple(a for a in arms if a.is_plain or a.draft_tokens * batch_size <= self.budget)

    def choose(self, batch_size: int) -> Arm | None:
        """The arm for a step at this batch size, or None when no arm fits the verify-token budget: the
        step must decode plainly (a fallback arm over the budget would break the guard)."""
        b = self.bucket(batch_size)
        arms = self.eligible(batch_size)
        if not arms:
            self._over_budget[b] += 1
            return None
        size = size_class(batch_size, self.exact_sizes)
        here = [self._rewards[b][a].get(size) for a in arms]  # each arm's rewards at this batch size (class)
        untried = [a for a, r in zip(arms, here) if not r]
        explored = True
        if untried:
            arm = untried[0]
        elif len(arms) > 1 and self._rng.random() < self.epsilon:
            arm = self._rng.choice(arms)
        else:
            medians = [r.median() for r in here]
            arm = arms[medians.index(max(medians))]  # ties: first in list
            explored = False
        (self._explored if explored else self._exploited)[b] += 1
        self._chosen[b][arm] += 1
        self._last = (b, arm, explored)
        return arm

    def withdraw(self) -> None:
        """The last `choose` did not run (the step found no KV room for its drafts and decoded plainly): take it out
        of the chosen / explored / exploited counts, so that they count the steps each arm ran. Once per choice."""
        if self._last is None:
            raise RuntimeError("withdraw without a choice to take back")
        b, arm, explored = self._last
        (self._explored if explored else self._exploited)[b] -= 1
        self._chosen[b][arm] -= 1
        self._last = None

    def record(self, batch_size: int, arm: Arm, emitted_tokens: int, step_seconds: float) -> float:
        """Record one SD step: `emitted_tokens` over the whole batch in `step_seconds`. Returns the reward."""
        if step_seconds <= 0:
            raise ValueError(f"step_seconds must be > 0, got {step_seconds}")
        b = self.bucket(batch_size)
        if arm not in self._rewards[b]:
            raise ValueError(f"arm {arm} is not in bucket {self.label(b)} ({[str(a) for a in self.arms[b]]})")
        reward = emitted_tokens / step_seconds
        by_size = self._rewards[b][arm]
        size = size_class(batch_size, self.exact_sizes)
        self._latest_size[b] = size
        if size not in by_size:
            by_size[size] = _Window(self.window)
        self.last_slot = by_size[size].add(reward)
        return reward

    def amend(self, batch_size: int, arm: Arm, slot: int, new: float) -> bool:
        """Replace the reward `record` recorded for (batch_size, arm) in `slot` (its `last_slot` then) with `new`: a
        cost of that step known only later (the drafter catch-up a "plain" step leaves to the next verify step:
        SpecDecoder). By slot, not by value: of two equal rewards the other's place was taken. False when the arm's
        window at that size no longer holds it (pushed out, or forgotten by `drafter_changed`)."""
        by_size = self._rewards[self.bucket(batch_size)].get(arm)
        window = None if by_size is None else by_size.get(size_class(batch_size, self.exact_sizes))
        return window is not None and window.replace(slot, new)

    def drafter_changed(self, keep: int) -> None:
        """The drafter was replaced: keep only the last `keep` rewards of each drafting arm (0: forget them, so
        the arms are tried again first); "plain" keeps its window."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        for by_arm in self._rewards:
            for arm, by_size in by_arm.items():
                if arm.is_plain:
                    continue
                for size in list(by_size):
                    by_size[size].keep_last(keep)
                    if not by_size[size]:
                        del by_size[size]

    def snapshot(self) -> tuple[BucketStats, ...]:
        out = []
        for b, arms in enumerate(self.arms):
            stats = []
            for a in arms:  # O(batch sizes) per arm: status and /metrics read this while the engine runs
                by_size = self._rewards[b][a]
                latest = by_size.get(self._latest_size[b]) if self._latest_size[b] is not None else None
                stats.append(ArmStats(a.name, sum(len(r) for r in by_size.values()),
                                      latest.median() if latest else None, self._chosen[b][a],
                                      {size: r.median() for size, r in sorted(by_size.items())}))
            out.append(BucketStats(self.label(b), tuple(stats), self._explored[b], self._exploited[b],
                                   self._over_budget[b]))
        return tuple(out)


class PlainDebt:
    """The "plain" arm steps since the drafter was last up to date: the drafter catch-up the next verify step times
    is theirs (SpecDecoder._catch_up). `charge` adds it to their step times, each its share by tokens, and amends
    their rewards. The share is over every step since the drafter was up to date, while only the last `window` of
    each of the bandit's windows (bucket, arm, batch size) are kept to amend (older ones have left it): charging the
    whole catch-up to the last `window` alone made them pay for the older steps' tokens too, the plain arm's median
    too low, and keeping the last `window` over all sizes left a size's steps still in its window unamended."""

    def __init__(self, bandit: BucketedEpsilonGreedy) -> None:
        self.bandit = bandit
        # (bucket, arm, size class): that window's last steps (batch size, arm, tokens, seconds, slot)
        self.steps: dict[tuple[int, Arm, int], deque[tuple[int, Arm, int, float, int]]] = {}
        self.tokens = 0  # over every step owed, kept or not
        self.count = 0

    def add(self, batch_size: int, arm: Arm, tokens: int, seconds: float, slot: int) -> None:
        """A plain step of `tokens` in `seconds`, recorded in `slot` (the bandit's `last_slot`)."""
        key = (self.bandit.bucket(batch_size), arm, size_class(batch_size, self.bandit.exact_sizes))
        self.steps.setdefault(key, deque(maxlen=self.bandit.window)).append((batch_size, arm, tokens, seconds, slot))
        self.tokens += tokens
        self.count += 1

    def charge(self, seconds: float) -> float:
        """Charge a catch-up of `seconds` to the steps owed, and owe nothing more; the seconds charged (0 if none)."""
        if not self.count:
            return 0.0
        for steps in self.steps.values():
            for batch_size, arm, tokens, step_s, slot in steps:
                share = seconds * (tokens / self.tokens if self.tokens else 1 / self.count)
                self.bandit.amend(batch_size, arm, slot, tokens / (step_s + share))
        self.steps.clear()
        self.tokens = self.count = 0
        return seconds
