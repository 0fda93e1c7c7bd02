"""`RolloutConfig`: the rollout server's one typed, frozen config ([rollout] section).

The server fronts `replicas` engine processes; `engine` is the native engine's
own config (nested, `[rollout.engine]` in a preset) and is handed unchanged to
every replica except for the device, which the server assigns per replica
(`cuda:i` on a GPU box, `cpu` otherwise). Defaults run on a laptop CPU and bind
loopback only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from tlt.services.common.config import ServiceConfig
from tlt.services.common.config_values import zmq_endpoint_problem
from tlt.services.common.events import STALE_S
from tlt.services.rollout.engine.config import EngineConfig
from tlt.services.rollout.spec.config import SpecConfig


class RolloutConfig(ServiceConfig):
    """The [rollout] section."""

    host: str = Field("127.0.0.1", description="address HTTP and gRPC bind to; loopback unless you mean to expose it")
    http_port: int = Field(8000, ge=0, le=65535, description="OpenAI-compatible HTTP port (0: pick a free one)")
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port of tlt.v1.Rollout (0: pick a free one)")
    served_model_name: str = Field(
        "", description="model id reported by /v1/models and required in requests; empty: the model folder's name"
    )
    backend: str = Field(
        "native", description="engine backend: native | sglang | 'module:Class' of an engine with the same interface"
    )
    replicas: int = Field(1, ge=1, le=64, description="engine replicas (data parallel), one process each")
    threads_per_replica: int = Field(
        0, ge=0, description="torch CPU threads per replica process; 0: the usable cores (affinity, capped by a container's CPU "
        "quota) divided by replicas"
    )
    pin_cpus: bool = Field(
        True, description="CPU replicas: pin replica i to its own threads_per_replica cores (services/common/cpus.py), "
        "so a drafter worker training on an idle replica's cores never slows a busy one; no effect on GPU replicas"
    )
    spin_wait: bool = Field(
        True, description="CPU replicas: OpenMP threads spin briefly at barriers before sleeping (GOMP_SPINCOUNT, "
        "services/common/cpus.py) instead of the passive wait every other service uses. A decoding replica has its "
        "cores to itself in an RL step, and a decode step is many small parallel kernels: waking sleeping threads "
        "for each one cost 23% of the rollout time of `tlt run` (BENCHMARKS.md). Off by itself where replicas x "
        "threads exceeds the usable cores (replicas sharing cores spin against each other: 17x slower); set false "
        "on a machine shared with other jobs; no effect with one thread per replica"
    )
    gc_freeze: bool = Field(
        True, description="freeze the Python heap (gc.freeze) of the front and of each replica once started: full "
        "garbage collections then skip the ~400,000 objects that imports, the model and the KV block pool leave, "
        "which took 0.16-0.30 s each, every stream stalled meanwhile (services/common/gc_heap.py, BENCHMARKS.md "
        "\"Rollout server under load\"); /metrics shows each process's collections and pauses (rollout_gc_*)"
    )
    max_n: int = Field(64, ge=1, description="largest n (samples per prompt) a request may ask for")
    max_prompts_per_batch: int = Field(4096, ge=1, description="largest number of prompts in one BatchGenerate")
    max_pending_sequences: int = Field(
        65536, ge=0, description="most sequences (a request's prompts x n) the replicas may hold at once, running or "
        "waiting; a request that would pass it gets 429 with Retry-After (gRPC RESOURCE_EXHAUSTED), one that alone "
        "is larger gets 400; checked as each request arrives; 0: no limit"
    )
    http_idle_timeout_s: float = Field(
        60.0, ge=0, description="an HTTP connection with no complete request for this long is closed: one that "
        "never sent one, or sent part of its header, or whose body has had no byte for this long or comes slower than "
        "1 KB/s past it (uvicorn's own 5 s keep-alive starts only after an "
        "answer, and a peer holding such sockets used up the open files of HTTP and gRPC together); a request "
        "being answered, streamed or not, is never cut; 0: never"
    )
    max_request_bytes: int = Field(
        1 << 20, ge=1024, description="largest HTTP request body in bytes; larger gets 413"
    )
    tool_call_parser: Literal["hermes", "none"] = Field(
        "hermes", description="how /v1/chat/completions finds the tool calls in a completion of a request with "
        "tools (tool_choice not 'none'): 'hermes' parses the <tool_call>{\"name\": ..., \"arguments\": {...}}"
        "</tool_call> blocks Qwen2.5, Qwen3 and Hermes models write into message.tool_calls (finish_reason "
        "'tool_calls'; a block that is no call to one of the request's tools stays text); 'none' never parses: "
        "the text is returned as content (services/rollout/tool_calls.py)"
    )
    max_weight_bytes: int = Field(
        16 << 30, ge=1, description="largest UpdateWeights payload in bytes; larger is rejected before reading on"
    )
    control_token: str = Field(
        "", description="shared secret required as gRPC metadata 'authorization: Bearer <token>' on UpdateWeights; "
        "empty: $TLT_AUTH_TOKEN or the file in $TLT_AUTH_TOKEN_FILE (services/common/auth.py)"
    )
    insecure_local: bool = Field(
        False, description="with no control token, allow UpdateWeights anyway — only when host is loopback"
    )
    api_key: str = Field(
        "", description="API key required as 'Authorization: Bearer <key>' on /v1/*; empty: $TLT_API_KEY, else none"
    )
    max_restarts: int = Field(
        5, ge=0, description="times in a row a dead replica process is restarted (weights replayed before it serves); "
        "a replica that served 10 minutes before it died counts from 0 again; 0: never"
    )
    startup_timeout_s: float = Field(300.0, gt=0, description="how long to wait for every replica to load its model")
    stall_timeout_s: float = Field(
        300.0, ge=0, description="a replica with sequences outstanding that sends nothing this long hangs: it is "
        "killed, its requests are re-dispatched like a dead replica's (redispatch_limit) or fail with UNAVAILABLE, "
        "and it is restarted (max_restarts); 0: never"
    )
    redispatch_limit: int = Field(
        1, ge=0, description="times one request's samples that had not finished when its replica died (exit, kill, "
        "stall) are re-issued to another live replica, or to the restarted one when none other is alive, so its "
        "caller still gets each of its n completions once (a seeded sample keeps its seed); past it, or with no "
        "replica alive or restarting, the request fails with UNAVAILABLE as a stream that already sent tokens "
        "does. 1 by default: a request that itself crashes its replica then costs one more replica, not several; "
        "0: never re-dispatch"
    )
    update_timeout_s: float = Field(600.0, gt=0, description="how long a weight update may take on every replica")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the native engine's config, per replica")
    spec: SpecConfig = Field(
        default_factory=SpecConfig, description="speculative decoding of the native engine ([rollout.spec]), per replica"
    )
    capacity_pub: str = Field(
        "", description="ZeroMQ endpoint to bind the capacity-event PUB on (e.g. tcp://127.0.0.1:5701); empty: off"
    )
    capacity_snapshot: str = Field(
        "", description="ZeroMQ endpoint to bind the capacity snapshot REP on (late subscribers); empty: an ephemeral port"
    )
    capacity_heartbeat_s: float = Field(
        1.0, gt=0, le=STALE_S / 2,
        description=f"seconds between capacity heartbeats; at most {STALE_S / 2:g}: the drafter counts a replica whose "
        f"state was not repeated for {STALE_S:g} s as busy",
    )
    features_push: str = Field(
        "", description="drafter feature PULL endpoint each replica PUSHes finished sequences' features to; empty: off"
    )
    features_max_tokens: int = Field(4096, ge=2, description="most tokens of one sequence sent as drafter features")

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("host must not be empty; use 127.0.0.1 for loopback or 0.0.0.0 to expose")
        return v

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        """An unknown name was refused only once the model's checkpoint had been checked (serve.check_before_start),
        and never by `tlt config check`; a 'module:Class' is imported by each replica, so only its shape is checked:
        a dotted module path and a class name, each made of Python identifiers (a stray space, as in 'pkg.mod : Cls',
        failed only at the replica's start, as "No module named 'pkg.mod '")."""
        from tlt.services.rollout.backends import BACKENDS

        module, _, name = v.partition(":")
        if v not in BACKENDS and not (name.isidentifier() and all(p.isidentifier() for p in module.split("."))):
            raise ValueError(f"unknown rollout backend {v!r}; use one of {sorted(BACKENDS)} or 'module:Class'")
        return v

    @field_validator("capacity_pub", "capacity_snapshot", "features_push")
    @classmethod
    def _zmq_endpoint(cls, v: str, info: ValidationInfo) -> str:
        """'' is off (capacity_pub, features_push) or an ephemeral port (capacity_snapshot); a malformed endpoint was a
        ZMQError traceback as the server started (the binds) or in every replica process (features_push connects)."""
        if v and (problem := zmq_endpoint_problem(v, bind=info.field_name != "features_push")) is not None:
            empty = "an ephemeral port" if info.field_name == "capacity_snapshot" else "off"
            raise ValueError(f"{problem}; or '' for {empty}")
        return v
