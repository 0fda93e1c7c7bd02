"""`TrainerConfig`: every knob of the GRPO trainer, typed, frozen, documented.

Loaded from the `[trainer]` section of a preset (deploy/configs/cpu-tiny.toml)
with `load_config(TrainerConfig, "trainer", preset, overrides)`. Defaults run
on a laptop CPU against the tiny model in artifacts/tiny.

Batch arithmetic of one step:

    prompts_per_step x n_samples = sequences per step
    sequences per step = k x mini_batch_size     (k x ppo_epochs optimizer updates per step)
    mini_batch_size    = m x micro_batch_size x ranks   (m = gradient accumulation)
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tlt.services.common.config import ServiceConfig
from tlt.services.common.config_values import grpc_address_problem, zmq_endpoint_problem
from tlt.services.rollout.lease import MAX_LEASE_S  # the rollout servers' bound (asyncio and time only)


class TrainerConfig(ServiceConfig):
    # -- model -----------------------------------------------------------------
    model_dir: str = Field("artifacts/tiny", description="local Hugging Face checkpoint folder of the policy (no network)")
    reference_model_dir: str | None = Field(
        None, description="frozen reference model for the KL term, of the policy's vocabulary; default: model_dir "
        "(used only when kl_beta > 0)"
    )
    output_dir: str = Field("runs/latest", description="where checkpoints, metrics and the final policy are written")

    # -- services ---------------------------------------------------------------
    rollout_addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50051"],
        description="gRPC host:port of the rollout server(s); prompts are spread over them",
    )
    rollout_token: str = Field("", description="shared control-plane token sent as 'authorization' on UpdateWeights")
    reward: Literal["grpc", "task", "python"] = Field(
        "task",
        description="reward source: 'grpc' (reward_address; `tlt reward serve --kind math` checks \\boxed{} answers), "
        "'task' (the synthetic task's verifier in-process: the integer after `answer:` only; a data file whose "
        "references are not integers is refused), 'python' (the function named by reward_function)",
    )
    reward_address: str = Field("127.0.0.1:50061", description="gRPC host:port of the reward service (reward='grpc')")
    reward_function: str = Field(
        "", description="'module:function' with the TRL contract f(prompts, completions, **kw) -> list[float]; "
        "kw: answer (= answers), completion_ids (each completion's token ids) and each other column of the data "
        "file, one list entry per completion. Chat-message rows: prompts are the message lists and each "
        "completion is [{'role': 'assistant', 'content': text}], as TRL passes them"
    )
    reward_concurrency: int = Field(32, ge=1, description="completions scored at once by the gRPC reward client")
    reward_timeout_s: float = Field(
        30.0, gt=0, description="a reward call times out once the reward server has answered none of the trainer's "
        "calls for this many seconds since it began (a busy server still answering others is waited for, however "
        "long its queue); one answering nothing fails the step after about (reward_retries + 1) x this"
    )
    reward_retries: int = Field(2, ge=0, description="retries of a reward call that timed out or could not reach "
                                "the server before the step fails")
    reward_retry_window_s: float = Field(
        30.0, ge=0, description="a reward server that refuses connections (UNAVAILABLE: its pod restarting) is "
        "retried, backing off up to 2 s, until this many seconds after the first failure, beyond reward_retries; "
        "0: reward_retries only"
    )
    reward_async_block_warn_s: float = Field(
        1.0, ge=0, description="reward='python' with an async def function: its coroutines run on one event loop, so a "
        "blocking call inside one stalls the step's scoring; when the loop has not run for this many seconds the "
        "trainer logs reward_loop_blocked (the function and its line), as [reward] async_block_warn_s does, and counts "
        "it in the step's reward_loop_blocked metric. 0: off"
    )
    connect_timeout_s: float = Field(120.0, gt=0, description="how long to wait for the rollout server(s) and the reward server at start")
    rollout_retries: int = Field(2, ge=0, description="times a step is rolled out again (its partial rollout dropped) "
                                 "after a rollout replica died mid-step and was restarted, or the rollout server "
                                 "was too busy with other clients to take it (5 s later, doubling); 0: the step fails")
    rollout_retry_wait_s: float = Field(600.0, gt=0, description="how long to wait for every replica to serve again "
                                        "before a rollout retry (a restarted replica reloads its model)")
    push_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of pushed weights; must match the rollout engine's (auto: bf16 when training bf16, else fp32)"
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port of the trainer (0: off)")
    metrics_host: str = Field("127.0.0.1", description="address /metrics binds (0.0.0.0 in a container a Prometheus "
                              "outside it scrapes)")
    drafter_features_address: str = Field(
        "", description="ZeroMQ endpoint the drafter PULLs trainer features from (its features_bind, with "
        "[drafter] source='trainer'); when set, the old-logprob pass keeps last-layer hidden states and pushes "
        "them there, never blocking (empty: off)"
    )
    weight_push: Literal["grpc", "shm", "none"] = Field(
        "grpc", description="how new policy weights reach the rollout server: gRPC chunks, same-host shm, or not at all"
    )
    lend_rollout_devices: bool = Field(
        False, description="colocated placement (rollout and trainer share the devices): borrow the rollout "
        "replicas' devices (Rollout.LendDevices) for the old-logprob pass and the update, and give them back "
        "before the weight push. Lent replicas publish LENT instead of IDLE, so drafter workers do not train "
        "on the devices the trainer uses, and SGLang releases its KV cache (release_tags)"
    )
    lend_lease_s: float = Field(
        60.0, gt=0, le=MAX_LEASE_S, description="the lend lapses after this long unless renewed (the trainer renews "
        "it every third of it): a trainer killed mid-update gives the devices back by itself; at most a day, as the "
        "rollout servers refuse longer leases"
    )

    # -- data ---------------------------------------------------------------------
    data_path: str | None = Field(
        None, description="JSONL or Parquet (needs pyarrow) file of rows with a 'prompt' and the reference answer "
        "(answer_field); 'prompt' is text, or a list of chat messages [{role, content}] (TRL's conversational rows, "
        "verl's rows), rendered with model_dir's chat template (add_generation_prompt); default: the synthetic task"
    )
    answer_field: str = Field(
        "answer", pattern=r"^[^.]+(\.[^.]+)*$", description="field of a data_path row holding the reference answer "
        "(text or a number); a dotted path reaches into a nested field: 'reward_model.ground_truth' for verl's "
        "rows. The row's other fields (a nested answer's parent included) go to reward functions as columns"
    )
    synthetic_problems: int = Field(2048, ge=1, description="size of the synthetic data set when data_path is unset")

    # -- held-out eval (evaluate.py) -----------------------------------------------
    eval_problems: int = Field(
        0, ge=0, description="held-out problems scored through the rollout server before training, every "
        "eval_interval steps and at the end, into output_dir/eval.jsonl (0: no eval)"
    )
    eval_interval: int = Field(10, ge=1, description="RL steps between held-out evals")
    eval_samples: int = Field(1, ge=1, description="completions per eval problem")
    eval_temperature: float = Field(0.0, ge=0, description="eval sampling temperature (0: greedy)")
    eval_greedy: bool = Field(
        False, description="each eval also scores one greedy completion (temperature 0) per problem, recorded as "
        "greedy_accuracy (a deployment's pass@1, beside the sampled accuracy RL optimises); with eval_temperature = 0 "
        "no second pass runs and greedy_accuracy = accuracy"
    )
    eval_data_path: str | None = Field(
        None, description="JSONL or Parquet eval prompts (its first eval_problems rows); default: the synthetic "
        "task's held-out draw (the problems `tlt model eval` scores); required when data_path is set. Rows as "
        "for data_path"
    )
    eval_answer_field: str | None = Field(
        None, pattern=r"^[^.]+(\.[^.]+)*$", description="answer_field of the eval_data_path rows; default: "
        "answer_field"
    )

    # -- sampling -------------------------------------------------------------------
    prompts_per_step: int = Field(8, ge=1, description="prompts sampled per RL step")
    n_samples: int = Field(4, ge=1, description="samples per prompt (the GRPO group size; at least 2: a sample's "
                           "advantage is relative to its prompt's other samples)")
    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling: a group whose rewards are all equal (advantage 0, no gradient) "
        "is replaced by one from further rounds of prompts_per_step fresh prompts, rolled out until the step has "
        "prompts_per_step groups with a reward spread or dynamic_sampling_max_rounds ran; then flat groups fill up. "
        "reward_mean / accuracy then describe every completion generated (step metrics sampling_rounds, "
        "groups_generated, zero_signal_groups_trained)"
    )
    dynamic_sampling_max_rounds: int = Field(
        4, ge=1, description="rollout rounds a step may take at most with dynamic_sampling (the first included)"
    )
    max_tokens: int = Field(96, ge=1, description="maximum response tokens per sample")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (also applied to trainer logprobs)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold for rollouts; the trainer's "
                         "logprobs are the full softmax at `temperature`, so below 1 the rollout samples from another "
                         "distribution than the one trained (off-policy, as in other RL trainers): keep 1 for RL")

    # -- optimisation ---------------------------------------------------------------
    lr: float = Field(1e-5, gt=0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    warmup_steps: int = Field(0, ge=0, description="optimizer updates of linear LR warm-up")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warm-up")
    grad_clip: float = Field(1.0, gt=0, description="global gradient-norm clip")
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO clip: ratio floor is 1 - clip_low")
    clip_high: float = Field(0.2, gt=0, description="PPO clip: ratio ceiling is 1 + clip_high (DAPO clip-higher > clip_low)")
    kl_beta: float = Field(0.0, ge=0, description="weight of the k3 KL to the reference model; 0 loads no reference")
    scale_adv_by_std: bool = Field(True, description="divide advantages by the group std (False = Dr. GRPO); "
                                   "advantage_estimator='grpo' only: 'rloo' never divides (as in verl, whose "
                                   "norm_adv_by_std_in_grpo only applies to GRPO)")
    adv_eps: float = Field(1e-6, gt=0, description="added to the group std before dividing")
    advantage_estimator: Literal["grpo", "rloo"] = Field(
        "grpo", description="'grpo': (r_i - group mean) / (group std + adv_eps) (scale_adv_by_std); 'rloo': "
        "REINFORCE leave-one-out, A_i = r_i - mean of the other n - 1 rewards of its group (= n / (n - 1) x "
        "(r_i - group mean); not divided by the std). Either way a group of one sample or of equal rewards gets 0"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how the per-token PPO, KL and entropy terms become one loss (and pg_loss, kl, "
        "entropy in the step metrics): 'token-mean' sums over every response token of the mini-batch / its "
        "tokens (DAPO); 'seq-mean-token-mean' averages each sequence's tokens, then the sequences (the GRPO "
        "paper: short responses weigh more per token); 'seq-mean-token-sum-norm' divides each sequence's token "
        "sum by the constant max_tokens, then averages the sequences (Dr. GRPO). Exact under gradient "
        "accumulation and data parallel (each rank divides by the mini-batch's tokens or sequences / ranks)"
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="entropy bonus: loss -= entropy_coef x the entropy aggregated as loss_agg says, "
        "with its gradient (0: the entropy is only logged, detached)"
    )
    ppo_epochs: int = Field(
        1, ge=1, description="passes over each step's rollout batch, each shuffled into mini-batches with its "
        "own seed; old (and reference) logprobs are computed once, before the first, so the step makes "
        "ppo_epochs x (sequences per step / mini_batch_size) optimizer updates (the LR schedule counts them). "
        "The step's loss, clip_fraction, ... metrics are means over every pass"
    )
    old_logprobs: Literal["recompute", "rollout"] = Field(
        "recompute", description="where the PPO ratio's old logprobs come from: 'recompute' (a no-grad trainer pass "
        "over the step's batch, as verl does) or 'rollout' (the logprobs the rollout returned with each token, from "
        "the same weights: it saves that pass). 'rollout' still recomputes one micro-batch a step, the longest, and "
        "checks it: a gap over old_logprob_tolerance (a bf16 rollout, top_p / top_k) recomputes the whole step's, with "
        "a warning. Without rollout logprobs, for completions of another policy version than the trainer's, or when "
        "the step collects drafter features, it recomputes"
    )
    old_logprob_tolerance: float = Field(
        1e-3, gt=0, description="old_logprobs = 'rollout': the largest |trainer - rollout| logprob allowed on the "
        "checked micro-batch (fp32 on CPU measures 3e-6 to 4e-5)"
    )
    overlong_filter: bool = Field(
        False, description="DAPO's overlong filtering: a response cut at max_tokens (finish_reason 'length') is "
        "left out of the loss (its tokens out of numerator and denominator); its reward still enters its "
        "group's advantages. The step records the share left out (overlong_filtered_fraction)"
    )
    mini_batch_size: int = Field(16, ge=1, description="sequences per optimizer update")
    micro_batch_size: int = Field(4, ge=1, description="sequences per forward/backward pass")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage: 0 none; 1 partitions the optimizer "
                                        "state over the ranks, 2 also the gradients, 3 also the parameters (for "
                                        "policies whose weights + gradients + Adam state do not fit one device; "
                                        "every push and the final export gather the weights)")
    bf16: bool | None = Field(None, description="bf16 training; default: on with a GPU, off (fp32) on CPU")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    logprob_chunk_tokens: int = Field(1024, ge=0, description="response tokens whose [tokens, vocab] logits exist at "
                                      "once in the logprob and entropy pass (recomputed in backward); 0 builds a "
                                      "micro-batch's whole [B, R, vocab] logits at once")
    seed: int = Field(0, description="seed of the data order, the torch RNG and (unless sampling_seed) the rollout's "
                      "sampling")
    sampling_seed: int | None = Field(None, description="seed of the rollout's sampling: each rollout server's "
                                      "request is seeded from it, the step (or dynamic-sampling round, or eval) and the "
                                      "server's place, and the rollout gives each prompt its own seed from that, so a resumed run or a rerun samples the completions the first run "
                                      "did (with reproducible_rollouts under speculative decoding); another value "
                                      "samples others of the same prompts; unset: seed")
    reproducible_rollouts: bool = Field(
        False, description="send the step rollouts as `reproducible` requests: under speculative decoding they take "
        "the tree walk, which emits plain decoding's tokens for the run's seeds, so a redone or rerun step samples "
        "the completions it first did where the rollout's numerics are deterministic (one CPU replica's are). "
        "It costs speed: at T = 1 the walk keeps ~3.5 tokens per verify step of an 8-deep learned chain where "
        "rejection sampling keeps ~6.6 (BENCHMARKS.md, 'Sampled chains'). "
        "false: sampled learned chains are verified by rejection sampling (exact in distribution), whose tokens depend on which steps speculate, with which arm (the bandit's timing) and "
        "drafter: a redone step samples other completions of the same distribution. The evals are always "
        "reproducible. Native engine only: the SGLang backend ignores it (SGLang's sampling and speculation decide)")
    steps: int = Field(20, ge=1, description="RL steps to run")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads on CPU; 0 keeps torch's default, capped by a container's CPU quota (cgroup)")

    # -- checkpoints ----------------------------------------------------------------
    checkpoint_interval: int = Field(5, ge=0, description="save trainer state every N steps (0: only at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="how many recent checkpoints to keep")
    resume: bool = Field(True, description="resume from the latest checkpoint in output_dir when one exists")

    @field_validator("rollout_addresses")
    @classmethod
    def _rollout_addresses(cls, v: list[str]) -> list[str]:
        """[] failed as the first step spread its prompts over no server; a malformed address only after the whole
        connect_timeout_s, as "not reachable"."""
        if not v:
            raise ValueError("rollout_addresses must name at least one rollout server, e.g. ['127.0.0.1:50051']")
        for address in v:
            if (problem := grpc_address_problem(address)) is not None:
                raise ValueError(f"rollout_addresses: {problem}")
        return v

    @field_validator("reward_address")
    @classmethod
    def _reward_address(cls, v: str, info: ValidationInfo) -> str:
        """Checked only where it is used (reward = 'grpc'); a malformed one failed after connect_timeout_s."""
        if info.data.get("reward") == "grpc" and (problem := grpc_address_problem(v)) is not None:
            raise ValueError(f"reward_address (reward = 'grpc') {problem}")
        return v

    @field_validator("drafter_features_address")
    @classmethod
    def _drafter_features_address(cls, v: str) -> str:
        """'' is off; a malformed endpoint was a ZMQError traceback once the trainer set up its feature hook."""
        if v and (problem := zmq_endpoint_problem(v, bind=False)) is not None:
            raise ValueError(f"drafter_features_address {problem}; or '' for off")
        return v

    @field_validator("adam_betas")
    @classmethod
    def _adam_betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        """torch.optim.AdamW refuses a beta outside [0, 1) only as the trainer builds its optimizer."""
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"adam_betas must both be in [0, 1) (AdamW's running-average decays), e.g. (0.9, 0.999); "
                             f"got {v}")
        return v

    @model_validator(mode="after")
    def _check_batches(self) -> TrainerConfig:
        if self.n_samples < 2:  # every group of one is flat: advantage 0, no gradient, every step trains nothing
            raise ValueError(f"n_samples={self.n_samples}: GRPO's advantages compare a prompt's samples with each "
                             "other, so a group of one has none and no step would train; use n_samples >= 2")
        per_step = self.prompts_per_step * self.n_samples
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size}); e.g. set micro_batch_size to a divisor of it"
            )
        if per_step % self.mini_batch_size:
            raise ValueError(
                f"prompts_per_step x n_samples = {per_step} sequences must be a multiple of mini_batch_size "
                f"({self.mini_batch_size}); e.g. set mini_batch_size={per_step}"
            )
        if self.eval_problems and self.data_path and not self.eval_data_path:
            raise ValueError(
                "eval_problems > 0 with your own data_path needs eval_data_path (held-out prompts of the same "
                "kind); or set eval_problems=0"
            )
        if self.reward == "python" and ":" not in self.reward_function:
            raise ValueError("reward='python' needs reward_function='module:function'")
        if self.reward_function and self.reward != "python":  # it was ignored: the run scored with another reward
            raise ValueError(f"reward_function is read only with reward='python' (reward is {self.reward!r}); "
                             "drop one of them")
        return self

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.n_samples
