"""EngineConfig: the native engine's knobs (one per replica), laptop defaults.

Nested in the rollout service config as `[rollout.engine]`; a replica process
receives it as JSON and builds `LLMEngine(model_dir, config)`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tlt.model.config import ModelConfig
from tlt.services.common.config import ConfigError, ServiceConfig
from tlt.services.common.config_values import device_problem


class EngineConfig(ServiceConfig):
    """Sizes and limits of one native engine."""

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="weights, activations and KV cache dtype (float32 on CPU; bfloat16 on GPU)"
    )
    device: str = Field("cpu", description="torch device of this replica: cpu, cuda, cuda:1, ...")
    kernels: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description=(
            "decode/verify hot path: 'triton' = fused add+RMSNorm, RoPE and paged decode/tree attention as the "
            "Triton kernels of tlt.kernels (prefill attention stays SDPA); 'torch' = the PyTorch path "
            "(TorchScript + oneDNN on CPU); 'auto' = triton on CUDA when triton imports, else torch. "
            "The compiled kernels passed the GPU tests on an H200 (tests/test_engine_cuda.py, session 30); "
            "'triton' on CPU needs TRITON_INTERPRET=1 from process start (tests only, very slow)"
        ),
    )
    decode_graphs: Literal["off", "cuda", "emulate"] = Field(
        "off",
        description=(
            "plain decode steps on static buffers padded to a batch-size bucket (services/rollout/engine/"
            "decode_graphs.py): 'cuda' replays CUDA graphs captured per bucket at start (needs CUDA and kernels = "
            "'triton'; tested on an H200 in session 30); 'emulate' runs the same padded step without "
            "graphs (CPU tests); 'off' = the ordinary eager step. With speculative decoding attached, its verify passes "
            "get graphs in the same mode, per arm for the batch buckets the arm's bandit bucket covers at or below the "
            "SD threshold (verify_graphs.py; 'cuda' tested on the H200 too)"
        ),
    )
    decode_graph_buckets: tuple[int, ...] = Field(
        (), description="batch sizes to capture decode graphs for, ascending; empty = 1, 2, 4, ... up to max_num_seqs"
    )
    max_num_seqs: int = Field(128, ge=1, description="most sequences decoded together in one step")
    max_num_batched_tokens: int = Field(
        2048, ge=16, description="token budget of one step (prefill chunks + decode tokens); longer prompts are chunked"
    )
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV cache block")
    num_kv_blocks: int = Field(
        0, ge=0, description="KV cache blocks; 0 = derive from kv_cache_mb (tests set a tiny value to force preemption)"
    )
    kv_cache_mb: float = Field(256.0, gt=0, description="KV cache memory budget in MiB when num_kv_blocks is 0")
    max_model_len: int = Field(
        0, ge=0, description="longest prompt + completion in tokens; 0 = the model's max_position_embeddings "
        "(times the factor of linear RoPE scaling); more than that is refused"
    )
    threads: int = Field(0, ge=0, description="torch intra-op threads for this replica; 0 = leave torch's default")
    seed: int = Field(0, description="seed for requests that give none, mixed with the host's name and the replica: "
                      "servers on other hosts (pods) draw other samples, a rerun on one host repeats them; the "
                      "samples of one request still differ from each other")
    prefix_sharing: bool = Field(True, description="share full prompt KV blocks between sequences with the same prefix "
                                 "and copy a computed partial last block: n samples of a prompt prefill it once")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        """'' or 'gpu' failed only in torch, in every replica process as it loaded the model. Whether the GPU is
        there is the replica's to find: a config may be checked on a machine without it."""
        if (problem := device_problem(v)) is not None:
            raise ValueError(f"device {problem}")
        return v

    @field_validator("decode_graph_buckets")
    @classmethod
    def _buckets(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if v and (sorted(set(v)) != list(v) or v[0] < 1):
            raise ValueError(f"decode_graph_buckets must be strictly increasing batch sizes >= 1 (e.g. [1, 8, 64]), "
                             f"or [] for 1, 2, 4, ... up to max_num_seqs; got {list(v)}")
        return v

    @model_validator(mode="after")
    def _graphs(self) -> EngineConfig:
        """What decode_graphs needs, known from this config alone: every replica's engine refused it as it set up
        its graphs (decode_graphs.py). Whether CUDA and Triton are there is the replica's to find."""
        if self.decode_graphs == "off":
            return self
        if self.kernels == "torch" or (self.kernels == "auto" and self.device == "cpu"):  # auto: torch on cpu
            raise ValueError(f"decode_graphs = {self.decode_graphs!r} needs the Triton decode path (kernels = "
                             f"'triton'; kernels = {self.kernels!r} on device {self.device!r} is the PyTorch path); "
                             "set kernels = 'triton', or decode_graphs = 'off'")
        if self.decode_graphs == "cuda" and self.device == "cpu":
            raise ValueError("decode_graphs = 'cuda' needs a CUDA device: set device = 'cuda', or decode_graphs = "
                             "'emulate' (CPU tests) or 'off'")
        return self


def context_limit(max_model_len: int, model: ModelConfig) -> int:
    """The engine's context: max_model_len, or the model's own when 0. ConfigError past the model's own, whose
    positions it was never trained on (RoPE extrapolates there silently: a zero too many in a preset)."""
    trained, source = model.max_position_embeddings, "config.json max_position_embeddings"
    if model.rope_scaling is not None and model.rope_scaling.rope_type == "linear":
        trained = int(trained * model.rope_scaling.factor)  # as vLLM derives it; llama3's is already in the field
        source += f" x its linear RoPE factor {model.rope_scaling.factor:g}"
    if max_model_len > trained:
        raise ConfigError(f"[rollout.engine] max_model_len {max_model_len} is past the model's context {trained} "
                          f"({source}): lower it, or 0 for the model's own")
    return max_model_len or trained
