"""SpecConfig: when and how the native engine speculates (nested in the rollout config as [rollout.spec]).

    mode      off: plain decoding only; static: one fixed arm whenever the batch is small;
              adaptive: the BEG bandit picks the arm per batch-size bucket (TLT).
    threshold SD runs only while the running batch <= threshold, switched on after
              `hysteresis_steps` consecutive decode steps at or below it and off at once above it.
    drafter   learned: the EAGLE drafter in `drafter_path`; ngram: model-free suffix matching over the
              request's own context and its sibling samples (no training needed, useful at step 0).

Everything here is lossless: no setting trades exactness for speed. Seeded sampling is token-identical
to plain decoding under every setting except rejection-sampled chains (`chain_sampling`, see there), which a
request with `SamplingParams.reproducible` never takes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tlt.services.common.config import ServiceConfig
from tlt.services.rollout.spec.bandit import DEFAULT_BUCKET_ARMS, DEFAULT_THRESHOLDS, EXACT_SIZES, bucket_label
from tlt.services.rollout.spec.arm import Arm


class SpecConfig(ServiceConfig):
    """Speculative decoding of the native engine."""

    mode: Literal["off", "static", "adaptive"] = Field(
        "adaptive", description="off | static (always `static_arm` when the batch is small) | adaptive (bandit per bucket)"
    )
    threshold: int = Field(32, ge=1, description="speculate only while the running batch size is <= this")
    hysteresis_steps: int = Field(
        10, ge=1, description="consecutive decode steps at/below the threshold, after a step above it, before SD "
        "switches on (off is immediate; a fresh engine speculates from its first small decode step)"
    )
    bucket_thresholds: tuple[int, ...] = Field(
        DEFAULT_THRESHOLDS, description="ascending batch sizes where bandit buckets start (1,2,5,21 -> 1, 2-4, 5-20, "
        ">=21); a bucket starting above `threshold` never runs (`tlt rollout serve` warns, spec_buckets_unused, "
        "unless these are the defaults)"
    )
    bucket_arms: tuple[tuple[str, ...], ...] = Field(
        DEFAULT_BUCKET_ARMS, description="one list of arms steps_topk_drafttokens per bucket (each arm once), larger trees for smaller "
        "batches; \"plain\" is the arm that does not speculate (the bandit measures it like the others, so SD that "
        "does not pay, e.g. with a stale drafter, is left)"
    )
    static_arm: str = Field("8_4_16", description="the arm used in static mode")
    epsilon: float = Field(0.1, ge=0.0, le=1.0, description="bandit exploration probability")
    window: int = Field(300, ge=1, description="bandit sliding window of rewards per arm (median over it)")
    exact_sizes: int = Field(
        EXACT_SIZES, ge=1, description="the bandit compares arms at exactly the running batch size up to this; above "
        "it, within classes of sizes a factor 2^(1/4) apart (a large batch rarely repeats a size)"
    )
    rewards_kept_on_swap: int = Field(
        8, ge=0, description="when a new drafter is pushed, each drafting arm keeps only its last this many rewards "
        "per batch size (the 'plain' arm keeps all): the new drafter's rewards decide within a few steps (0: forget "
        "them, every arm is tried again; >= window: keep all, TLT's reference)"
    )
    verify_token_budget: int = Field(
        2048, ge=0, description="most draft tokens one verify step may check over the batch (0 = no limit). "
        "adaptive: the bandit skips arms whose draft_tokens x batch exceeds it, and a step where no arm of the "
        "bucket fits decodes plainly (counted as over_budget), and a bucket where no drafting arm fits even at its "
        "smallest batch is refused; static: `static_arm`'s draft_tokens x `threshold` "
        "(the largest batch SD runs at) must not exceed it, else the config is refused"
    )
    chain_min_prob: float = Field(
        0.0, ge=0.0, lt=1.0, description="learned chains (topk = 1): a sequence's chain stops at the first draft whose "
        "cumulative draft probability is below this, so unlikely drafts cost no verification (greedy chains: no "
        "drafting either, once every row is cut) (0 = always the arm's full depth). Lossless: greedy chains change "
        "only what is proposed; sampled chains are judged against the distribution the cut offered each kept "
        "draft from (the drafter's p restricted to the tokens the cut keeps, `accept.cut_sampled_chain`)"
    )
    chain_sampling: bool = Field(
        True, description="learned chains (topk = 1), for each sequence that samples (temperature > 0) and whose "
        "drafter row is warm: draw the drafts from the drafter's own tempered distribution p and verify by rejection "
        "sampling (accept with min(1, q/p), else draw from max(q - p, 0)); the step's other sequences (greedy, cold) "
        "take greedy drafts and the tree walk. false: greedy drafts and the tree walk for all. Both are exact in "
        "distribution, but only the tree walk emits the tokens plain decoding would: with it a seeded request gives "
        "the same samples whether SD is off, static or adaptive, whatever the load. Rejection-sampled chains are "
        "deterministic per seed and do not depend on the other sequences of a verify step, but emit other tokens "
        "than a plain step; a seeded request reproduces only when the same of its steps speculate with the same arm "
        "and drafter (a prefill beside it, the verify budget or a full KV cache makes a step plain; the adaptive "
        "bandit picks arms by measured speed, which varies from run to run). Set false for seed reproducibility across SD "
        "states and loads, or set SamplingParams.reproducible on the requests that need it (the trainer's evals do)"
    )
    drafter_graphs: Literal["off", "cuda", "emulate"] = Field(
        "off", description="learned chains: replay the drafter's chain drafting from CUDA graphs captured per batch "
        "bucket up to `threshold` and chain shape (tlt/model/drafter_graphs.py): 'cuda' needs the drafter on a CUDA "
        "device; 'emulate' runs the same padded static call eagerly (what the CPU tests check). The 'cuda' mode "
        "passed its GPU test on an H200 in session 32 (BENCHMARKS.md, 'GPU (H200)')"
    )
    drafter: Literal["learned", "ngram"] = Field("ngram", description="learned EAGLE drafter, or model-free n-gram matching")
    drafter_path: str = Field("", description="folder with drafter_config.json + model.safetensors (drafter = learned)")
    ngram_max: int = Field(4, ge=1, description="longest context suffix the n-gram drafter matches")
    ngram_min: int = Field(1, ge=1, description="shortest context suffix the n-gram drafter matches")
    seed: int = Field(0, description="bandit RNG seed: replica 0 uses it as is, each other replica a stream hashed from it "
                      "and its index, so replicas do not explore the same arm at the same step")

    @model_validator(mode="after")
    def _check(self) -> SpecConfig:
        problems = []
        for a in dict.fromkeys(a for bucket in self.bucket_arms for a in bucket):  # each arm named once
            try:
                Arm.parse(a)
            except ValueError as e:
                problems.append(str(e))
        static: Arm | None = None
        try:
            static = Arm.parse(self.static_arm)
        except ValueError as e:
            problems.append(str(e))
        if len(self.bucket_arms) != len(self.bucket_thresholds):
            problems.append(
                f"bucket_arms has {len(self.bucket_arms)} lists but bucket_thresholds has {len(self.bucket_thresholds)} "
                "entries; give one arm list per bucket"
            )
        if list(self.bucket_thresholds) != sorted(set(self.bucket_thresholds)) or min(self.bucket_thresholds, default=0) < 1:
            problems.append(f"bucket_thresholds must be strictly increasing and >= 1, e.g. [1, 2, 5, 21]; got {list(self.bucket_thresholds)}")
        if any(not bucket for bucket in self.bucket_arms):
            problems.append("every bucket needs at least one arm, e.g. [\"8_4_16\"]")
        if self.drafter == "learned" and self.mode != "off" and not self.drafter_path:
            problems.append("drafter = 'learned' needs drafter_path (a folder written by `tlt drafter warmup`), or set drafter = 'ngram'")
        if self.mode == "static" and static is not None and self.verify_token_budget:
            tokens = static.draft_tokens * self.threshold  # static speculates only while batch <= threshold
            if tokens > self.verify_token_budget:
                problems.append(
                    f"static_arm {self.static_arm} at the threshold batch {self.threshold} verifies {tokens} draft "
                    f"tokens a step, over verify_token_budget = {self.verify_token_budget}; lower static_arm's "
                    "draft_tokens or the threshold, or raise verify_token_budget (0 = no limit)"
                )
        if not problems and self.mode == "adaptive":
            problems += self._bucket_problems()
        if self.ngram_min > self.ngram_max:
            problems.append(f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _label(self, i: int) -> str:
        return bucket_label(self.bucket_thresholds, i)

    def _bucket_problems(self) -> list[str]:
        """Adaptive buckets that skew or starve the bandit: an arm named twice (explored twice as often), or drafting
        arms of which none fits the verify-token budget at the bucket's smallest batch (every step decoded plainly,
        as static mode's check refuses). A bucket that starts above the threshold never runs: not held to the
        budget (`unused_buckets`); nor are the built-in buckets and arms, which the user did not write."""
        twice: dict[tuple[str, tuple[str, ...]], list[str]] = {}  # (arm, the bucket's list) -> buckets naming it twice
        starved = []
        # the built-in ladder and arms (not the user's): a small budget there means "plain where nothing fits"
        built_in = self.bucket_thresholds == DEFAULT_THRESHOLDS and self.bucket_arms == DEFAULT_BUCKET_ARMS
        for i, bucket in enumerate(self.arms()):
            label = self._label(i)
            names = [a.name for a in bucket]
            for name in dict.fromkeys(n for n in names if names.count(n) > 1):
                twice.setdefault((name, self.bucket_arms[i]), []).append(label)
            smallest = 1 if i == 0 else self.bucket_thresholds[i]
            drafting = [a for a in bucket if not a.is_plain]
            if (self.verify_token_budget and smallest <= self.threshold and drafting and not built_in
                    and all(a.draft_tokens * smallest > self.verify_token_budget for a in drafting)):
                fewest = min(a.draft_tokens for a in drafting)
                starved.append(f"bucket {label} ({', '.join(names)}: {fewest * smallest} or more at batch {smallest})")
        problems = [f"arm {name} is named twice in bucket{'s' if len(labels) > 1 else ''} {', '.join(labels)} "
                    f"({', '.join(arms)}); name each arm once (a repeated arm is explored as often as it is named)"
                    for (name, arms), labels in twice.items()]
        if starved:
            problems.append(f"no drafting arm fits verify_token_budget = {self.verify_token_budget} draft tokens a step "
                            f"at the smallest batch of {'; '.join(starved)}: never speculating; raise "
                            "verify_token_budget (0 = no limit) or give such a bucket arms with fewer draft_tokens")
        return problems

    def unused_buckets(self) -> str | None:
        """A warning, or None: adaptive buckets written to start above `threshold`, where SD is off, so their arms
        never run. The built-in ladder (bucket_thresholds left at its default) is cut by any threshold silently."""
        if self.mode != "adaptive" or self.bucket_thresholds == DEFAULT_THRESHOLDS:
            return None
        above = [self._label(i) for i, t in enumerate(self.bucket_thresholds) if i and t > self.threshold]
        if not above:
            return None
        return (f"[rollout.spec] bucket{'s' if len(above) > 1 else ''} {', '.join(above)} start{'' if len(above) > 1 else 's'} "
                f"above threshold = {self.threshold}: SD is off at those batch sizes, so their arms never run; raise "
                "threshold, or drop those bucket_thresholds with their bucket_arms lists")

    def arms(self) -> tuple[tuple[Arm, ...], ...]:
        return tuple(tuple(Arm.parse(a) for a in bucket) for bucket in self.bucket_arms)
