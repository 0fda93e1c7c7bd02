"""`RewardConfig`: the reward server's one typed, frozen config ([reward] section).

Defaults run on a laptop and bind loopback only. Limits keep one bad client
from exhausting the server: a gRPC message size cap, a per-item size cap
(an item over it by its completion scores `oversized_reward`, one over it by its
data row is answered ok=false), a batch size cap, a bound on requests in
flight per stream and a bound on the items one stream holds unsent (being
scored or scored and waiting for the client to read them): at either bound
the stream stops reading requests until results go out, and gRPC flow
control then holds the client back.
"""

from __future__ import annotations

import math

from pydantic import Field, field_validator, model_validator

from tlt.services.common.config import ServiceConfig


class RewardConfig(ServiceConfig):
    """The [reward] section."""

    kind: str = Field("math", description="reward kind: math (the built-in verifier) or python (`function`)")
    function: str = Field(
        "", description="with kind python: the TRL-style reward function `module:function` (the module on "
        "PYTHONPATH or in the current directory), called per item; it must be thread-safe, or set workers = 1"
    )
    host: str = Field("127.0.0.1", description="address the gRPC server binds; loopback unless you mean to expose it")
    port: int = Field(50061, ge=0, le=65535, description="gRPC port of tlt.v1.Reward (0: pick a free one)")
    workers: int = Field(4, ge=1, le=256, description="threads scoring items concurrently (shared by all calls)")
    max_item_bytes: int = Field(
        256 << 10, ge=16, description="largest prompt + completion + reference + metadata (its keys and values) of "
        "one item, in UTF-8 bytes. An item over it because of its completion (a degenerate run of long tokens) is "
        "scored `oversized_reward`, unchecked, with a warning and tlt_reward_oversized_total, so the step goes on; "
        "one whose prompt, reference and metadata alone are over it (a data row too big) gets ok=false"
    )
    oversized_reward: float = Field(
        0.0, description="the reward of an item whose completion puts it over max_item_bytes (correct = false), "
        "without calling the verifier or function: the verifier's minimum, 0.0; set a function's own minimum "
        "when its rewards go below 0"
    )
    max_batch_items: int = Field(65536, ge=1, description="most items in one Score call; more is INVALID_ARGUMENT")
    max_message_bytes: int = Field(
        64 << 20, ge=1024, description="largest gRPC message the server accepts (RESOURCE_EXHAUSTED beyond)"
    )
    max_inflight_per_stream: int = Field(
        256, ge=1, description="items of one ScoreStream being scored at once; reading pauses beyond"
    )
    max_unsent_per_stream: int = Field(
        1024,
        ge=1,
        description="items one ScoreStream holds unsent (being scored, or scored and waiting for the client to "
        "read them); reading pauses at this many until the client reads, so a client that stops reading "
        "cannot grow the server's memory",
    )
    item_timeout_s: float = Field(
        60.0, ge=0, description="an item still scoring after this many seconds is answered ok=false (timed out) and "
        "its worker replaced (the stuck thread runs on; a Python thread cannot be stopped), up to `workers` stuck "
        "threads; once more are stuck, the health check (deploy/healthcheck.py grpc-reward) fails, so a liveness "
        "probe restarts the server, and an item waiting that long for a worker is answered ok=false. 0: no timeout"
    )
    async_block_warn_s: float = Field(
        1.0, ge=0, description="with an async def function: every worker's coroutines share one event loop, so a "
        "blocking call inside one holds up all of them; when the loop has not run for this many seconds the server "
        "logs reward_loop_blocked (the function and its line) and counts tlt_reward_async_loop_blocked_total. 0: off"
    )
    grace_s: float = Field(5.0, ge=0, description="on SIGTERM, how long in-flight calls may take to finish")
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Prometheus /metrics port on the same host; 0: no exporter"
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        from tlt.services.reward.verifiers import KINDS

        if v not in KINDS and v != "python":
            raise ValueError(f"unknown reward kind {v!r}; choose one of {sorted([*KINDS, 'python'])}")
        return v

    @field_validator("oversized_reward")
    @classmethod
    def _reward_fits(cls, v: float) -> float:
        from tlt.services.trainer.rewards import FLOAT32_MAX

        if not math.isfinite(v) or abs(v) > FLOAT32_MAX:  # the proto's reward field is a 32-bit float
            raise ValueError(f"oversized_reward {v!r} must be a finite number within a 32-bit float "
                             f"({FLOAT32_MAX!r})")
        return v

    @model_validator(mode="after")
    def _item_fits_a_message(self) -> RewardConfig:
        if self.max_item_bytes >= self.max_message_bytes:
            raise ValueError(
                f"max_item_bytes {self.max_item_bytes} must be below max_message_bytes {self.max_message_bytes}: an "
                "item between them is refused by gRPC (RESOURCE_EXHAUSTED, the trainer's step fails) before it "
                "could be scored oversized_reward; lower max_item_bytes or raise max_message_bytes")
        return self

    @model_validator(mode="after")
    def _metrics_port_apart(self) -> RewardConfig:
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port {self.metrics_port} is the gRPC port; give the /metrics exporter "
                             "another port (0: no exporter)")
        return self

    @model_validator(mode="after")
    def _function_with_python(self) -> RewardConfig:
        if self.kind == "python" and not self.function:
            raise ValueError("kind python needs function = 'module:function' (tlt reward serve --function)")
        if self.function and self.kind != "python":
            raise ValueError(f"function is read only with kind = 'python', not {self.kind!r}; drop one of them")
        return self

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("host must not be empty; use 127.0.0.1 for loopback or 0.0.0.0 to expose")
        return v
