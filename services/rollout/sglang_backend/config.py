"""`SGLangBackendConfig`: the `[sglang]` preset section, used only with `--backend sglang`.

The native engine's knobs live in `[rollout.engine]`; SGLang has its own
launch arguments, so they get their own section instead of leaking into the
native config. Field names say which SGLang 0.5.x `ServerArgs` field they
become (see `launch.py`); the SGLang field definitions are in
`sglang/srt/arg_groups/fields/{spec,schedule,exec_,parallel}.py`.

TLT's adaptive speculative decoding maps onto SGLang's launch-time adaptive
mode (`speculative_adaptive` + a per-batch-size JSON config, read by
`sglang/srt/speculative/adaptive_spec_params.py`):

    TLT: SD on while running batch <= spec_batch_threshold, arm chosen per bucket
    SGLang: slot per batch-size key (floor match), candidate_steps per slot,
            steps picked by an EMA of acceptance; a slot [0] = no drafting

so `spec_batch_threshold` becomes a last slot `threshold + 1 -> [0]`. SGLang's
adaptive mode only varies the chain depth (it requires eagle_topk == 1); tree
arms (topk > 1) run as a static configuration with `adaptive = false`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tlt.services.common.config import ServiceConfig


class SGLangBackendConfig(ServiceConfig):
    """The [sglang] section (SGLang 0.5.23, the `sglang` extra)."""

    tp_size: int = Field(1, ge=1, description="GPUs per replica (tensor parallel); replica i uses GPUs i*tp .. i*tp+tp-1")
    mem_fraction_static: float = Field(
        0.80, gt=0, lt=1, description="GPU memory fraction for weights + KV cache; lower it when the trainer shares the GPU"
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="weights and activations dtype (SGLang's dtype; also set by --dtype)"
    )
    context_length: int = Field(
        0, ge=0, description="longest prompt + completion in tokens (SGLang's context_length; also set by "
        "--max-model-len); 0: the model's"
    )
    max_running_requests: int = Field(
        0, ge=0, description="cap on concurrently decoded requests (also set by --max-num-seqs); 0: SGLang decides"
    )
    random_seed: int = Field(0, description="SGLang's random_seed")
    deterministic_inference: bool = Field(
        False, description="SGLang's enable_deterministic_inference: per-request seeds (a request's `seed`) take "
        "effect only with it (SGLang drops sampling_seed otherwise); it restricts attention backends and costs speed"
    )
    speculative_algorithm: Literal["none", "EAGLE", "EAGLE3"] = Field(
        "EAGLE", description="draft model family: EAGLE (TLT's drafter export), EAGLE3, or none (plain decoding)"
    )
    draft_model_path: str = Field(
        "", description="drafter checkpoint folder (tlt drafter export); also set by --drafter; required unless none"
    )
    num_steps: int = Field(3, ge=1, description="draft depth (speculative_num_steps); the start value in adaptive mode")
    eagle_topk: int = Field(1, ge=1, description="children kept per draft level (speculative_eagle_topk); 1 = chain")
    num_draft_tokens: int = Field(
        0, ge=0, description="tokens verified per step (speculative_num_draft_tokens); 0: num_steps + 1 (a chain)"
    )
    adaptive: bool = Field(True, description="SGLang's batch-size adaptive speculative mode (needs eagle_topk = 1)")
    spec_batch_threshold: int = Field(
        32, ge=1, description="TLT threshold: drafting only while the running batch <= this (becomes an adaptive slot [0])"
    )
    adaptive_steps: dict[str, list[int]] = Field(
        default_factory=lambda: {"1": [1, 3, 5, 7], "2": [1, 3, 5], "5": [1, 3], "21": [0, 1, 3]},
        description="batch-size floor -> candidate draft depths (TLT buckets 1, 2-4, 5-20, >=21)",
    )
    return_hidden_states: bool = Field(
        True, description="return target hidden states (features for the drafter) when a request asks for them"
    )
    enable_memory_saver: bool = Field(
        False, description="allow releasing KV cache / weights while the trainer runs (colocated on one GPU)"
    )
    release_tags: list[Literal["kv_cache", "weights", "cuda_graph"]] = Field(
        default_factory=lambda: ["kv_cache"],
        description="what release() frees while the trainer runs; the drafter is re-pushed after 'weights' resumes",
    )
    startup_timeout_s: float = Field(900.0, gt=0, description="how long SGLang may take to load and capture graphs")

    @model_validator(mode="after")
    def _check(self) -> SGLangBackendConfig:
        if self.speculative_algorithm == "EAGLE3" and self.return_hidden_states:
            raise ValueError(
                "with EAGLE3, SGLang returns the packed auxiliary layers instead of the last-layer state "
                "(sglang/srt/layers/logits_processor.py), not the features TLT's drafter trains on: set "
                "[sglang] return_hidden_states = false and take features from the trainer ([drafter] source = 'trainer')"
            )
        if self.speculative_algorithm == "none":
            return self
        if self.adaptive and self.eagle_topk != 1:
            raise ValueError(
                "SGLang's adaptive speculative mode needs eagle_topk = 1 "
                "(sglang/srt/speculative/adaptive_spec_params.py); set adaptive = false for tree drafts"
            )
        if self.adaptive:
            for key, steps in self.adaptive_steps.items():
                if not key.isdigit() or int(key) < 1:
                    raise ValueError(f"adaptive_steps keys are batch sizes >= 1 as strings, got {key!r}")
                if not steps or any(s < 0 for s in steps):
                    raise ValueError(f"adaptive_steps[{key!r}] must be a non-empty list of depths >= 0")
            if self.num_steps not in self.candidate_steps:
                raise ValueError(
                    f"num_steps={self.num_steps} must be one of the adaptive candidate steps {self.candidate_steps} "
                    "(SGLang refuses to start otherwise)"
                )
        elif self.eagle_topk == 1 and self.num_draft_tokens not in (0, self.num_steps + 1):
            raise ValueError(f"a chain (eagle_topk = 1) verifies num_steps + 1 = {self.num_steps + 1} tokens")
        return self

    @property
    def draft_tokens(self) -> int:
        return self.num_draft_tokens or self.num_steps + 1

    @property
    def candidate_steps(self) -> list[int]:
        return sorted({s for steps in self.adaptive_steps.values() for s in steps})
