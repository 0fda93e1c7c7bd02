"""Typed records the trainer passes between its parts (never loose dicts).

    rollout Completion (proto) + reward -> ScoredCompletion
    GRPO step -> StepMetrics (one line of the run's metrics.jsonl)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptItem:
    """One prompt of the data set with its reference answer."""

    index: int  # position in the data set
    prompt: str
    answer: str
    # The row's other columns (JSON values), for reward functions: TRL passes each as a keyword list.
    extra: dict[str, Any] = field(default_factory=dict, hash=False)
    # The row's chat messages when its prompt was a list of {role, content} (TRL's conversational rows): `prompt` is
    # then their rendering by the policy's chat template, and reward functions get these, as TRL passes them.
    messages: list[dict[str, str]] | None = field(default=None, hash=False)
    # Where the row is in its file ("file:line" of JSONL, "file row i" of Parquet; "" for the synthetic task), for the
    # errors that name a row; not part of the item's identity (fingerprints, equality).
    where: str = field(default="", hash=False, compare=False, repr=False)


@dataclass(frozen=True)
class ScoredCompletion:
    """One sampled response of a prompt's group, with its reward."""

    prompt_index: int  # group id inside the step (0 .. prompts_per_step - 1)
    sample_index: int  # 0 .. n - 1
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    reward: float
    correct: bool = False
    rollout_logprobs: tuple[float, ...] | None = None
    policy_version: int = 0
    finish_reason: str = "stop"
    text: str = ""


@dataclass
class StepMetrics:
    """What one RL step did; every field is a plain number so it serialises as JSON.

    loss, pg_loss, kl and entropy are aggregated as [trainer] loss_agg says (token means by default; loss =
    pg_loss + kl_beta x kl - entropy_coef x entropy), clip_fraction and approx_kl are token means. With
    ppo_epochs > 1 they are means over every pass (each sequence counted once per pass), grad_norm and lr
    means over every update; tokens and the rollout fields count the step's batch once.
    """

    step: int
    policy_version: int
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    clip_fraction: float = 0.0
    approx_kl: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0  # mean LR the step's optimizer updates used (not the next update's)
    optimizer_updates: int = 0
    reward_mean: float = 0.0
    reward_std: float = 0.0  # sample std (n - 1) over every completion the step generated, as the advantages use
    accuracy: float = 0.0
    zero_signal_groups: float = 0.0  # share of groups whose rewards were all equal
    response_len_mean: float = 0.0
    response_len_max: int = 0
    truncated_fraction: float = 0.0
    overlong_filtered_fraction: float = 0.0  # share of sequences [trainer] overlong_filter left out of the loss
    # |trainer old logprob - rollout logprob|, diagnostics (~1e-6 at top_p = 1). With top_p < 1 or top_k it is
    # large by design (~0.2): the rollout reports the truncated distribution it sampled from, the trainer
    # scores the full softmax; the PPO ratio compares the trainer's own passes, as verl does, although the samples
    # come from the truncated distribution (a known off-policy gap of top_p/top_k in RL: keep them off to avoid it)
    rollout_logprob_max_diff: float = 0.0
    # sequences whose old logprobs were the rollout's ([trainer] old_logprobs = 'rollout'); the diff above is then
    # over the recomputed (checked) ones only
    old_logprobs_from_rollout: int = 0
    tokens: int = 0
    # Speculative decoding during this step's rollout, summed over its completions (SpecStats):
    sd_verify_steps: int = 0  # per-sequence verify passes
    sd_accepted_tokens: int = 0  # tokens those passes emitted (incl. the bonus token)
    sd_plain_steps: int = 0  # per-sequence plain decode steps
    sd_response_tokens: int = 0  # tokens the rollout generated, every round (`tokens` counts those trained on)
    drafter_version: int = -1  # newest drafter version stamped on a completion (-1: no drafter)
    # rollout attempts of this step dropped and redone: a replica died past [rollout] redispatch_limit or a server was
    # busy (collect_retrying), a server restarted and served its start checkpoint (weight_sync.VersionGuard)
    rollout_retries: int = 0
    # times an in-process `async def` reward function held the reward loop past [trainer] reward_async_block_warn_s
    # while this step's rollout was scored (FunctionRewards.loop_blocked; 0 for other reward sources)
    reward_loop_blocked: int = 0
    # Dynamic sampling ([trainer] dynamic_sampling): rollout rounds the step took, prompt groups they generated, and the
    # share of flat groups (all rewards equal) among those it trained on. zero_signal_groups, reward_mean, reward_std
    # and accuracy are over every generated completion (all rounds).
    sampling_rounds: int = 1
    groups_generated: int = 0
    zero_signal_groups_trained: float = 0.0
    started_at: float = 0.0  # unix time the step began (places the step on the run's timeline)
    # phase -> seconds: step_s (the whole step), rollout_s (from the first rollout attempt to the kept one's last
    # completion), rollout_retry_s (of rollout_s, the attempts dropped and the waits and weight pushes before each
    # redo; 0 when none), reward_tail_s, old_logprobs_s, update_s, push_s (push_apply_s: the servers' part of it), and
    # lend_s / features_push_s where those are on
    times: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)
