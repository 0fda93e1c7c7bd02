"""`DrafterServiceConfig`: the elastic drafter trainer's one typed, frozen config ([drafter] section).

    rollout --capacity PUB/REP (capacity_pub / capacity_snapshot)--> workers
    rollout --features PUSH--> coordinator PULL (features_bind)
    workers --REQ--> coordinator ROUTER (coordinator_bind)
    coordinator --gRPC UpdateWeights(kind=drafter)--> rollout (rollout_grpc)
    coordinator, workers --gRPC GetWeights(embed, lm_head) after a policy update--> rollout (rollout_grpc)
    anyone --gRPC tlt.v1.Drafter/GetStatus--> coordinator (status_port)

Defaults run on a laptop CPU on loopback with the tiny model. Training
hyper-parameters follow TLT.md section 3 (AdamW betas (0.9, 0.95), grad clip
1.0); buffer and window sizes follow section 6 (windows of at most 512
tokens from the response, newest step first, previous step's long sequences
as fallback).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tlt.services.common.config import ServiceConfig
from tlt.services.common.config_values import device_problem, grpc_address_problem, zmq_endpoint_problem


class DrafterServiceConfig(ServiceConfig):
    """The [drafter] section."""

    # ---- wiring
    capacity_pub: str = Field("tcp://127.0.0.1:5701", description="rollout's capacity PUB endpoint to subscribe to")
    capacity_snapshot: str = Field("tcp://127.0.0.1:5702", description="rollout's capacity snapshot REP endpoint")
    features_bind: str = Field("tcp://127.0.0.1:5703", description="where the coordinator PULLs features (it binds)")
    coordinator_bind: str = Field(
        "tcp://127.0.0.1:5704", description="coordinator ROUTER for workers (it binds; port 0 picks a free one)"
    )
    rollout_grpc: str = Field("127.0.0.1:50051", description="rollout gRPC address for UpdateWeights(kind=drafter) and GetWeights")
    control_token: str = Field("", description="the rollout's control token for UpdateWeights and GetWeights; empty: $TLT_AUTH_TOKEN")
    host: str = Field("127.0.0.1", description="address the Drafter status gRPC server binds")
    status_port: int = Field(50071, ge=0, le=65535, description="gRPC port of tlt.v1.Drafter/GetStatus (0: free)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus /metrics port of the coordinator; 0: none")
    source: Literal["rollout", "trainer"] = Field(
        "rollout", description="who sends features: the rollout engine's own passes, or the trainer's old-logprob pass"
    )
    # ---- state
    checkpoint_dir: str = Field("artifacts/drafter-online", description="atomic checkpoints of candidate + workers")
    init_drafter: str = Field("", description="drafter folder to start from (e.g. `tlt drafter warmup`); empty: random")
    # ---- data
    buffer_sequences: int = Field(
        2048, ge=1, description="most training windows kept in the buffer (a sequence longer than window_tokens is "
        "several windows; oldest evicted first); DrafterStatus.buffer_sequences counts the same windows"
    )
    window_tokens: int = Field(256, ge=8, description="longest training window cut from a response")
    long_tokens: int = Field(
        64, ge=1, description="a previous-step sequence this long or longer is fallback data (one-step offset)"
    )
    holdout_every: int = Field(
        8, ge=2, description="every k-th group (a prompt's samples, whole) goes to the held-out set instead of training"
    )
    holdout_sequences: int = Field(64, ge=1, description="most held-out windows kept (newest)")
    batch_rows: int = Field(4, ge=1, description="packed rows per micro-batch")
    batch_tokens: int = Field(256, ge=8, description="tokens per packed row")
    # ---- training
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip")
    feature_noise: float = Field(0.0, ge=0, description="uniform noise half-width on input features (warm-up uses 0.1)")
    ttt_steps: int = Field(
        1, ge=1, description="training-time test depth (`Drafter.forward_unrolled`): also train on the drafter's own "
        "outputs this many steps deep; each step adds about one forward and backward (a preemption still waits only "
        "for the stretch between two of micro_step's checkpoints, which come once per unroll step)"
    )
    window_max_steps: int = Field(
        0, ge=0, description="most micro-steps a worker trains per idle period of its replica; then it waits for the "
        "replica's next BUSY -> IDLE (0: trains until the replica turns busy). Where the replica's idle period is "
        "someone else's busy time (a CPU machine shared with the policy trainer), this caps what the drafter takes"
    )
    min_idle_s: float = Field(
        0.0, ge=0, description="a window opens only once the replica has been idle this long (0: at once). Colocated "
        "with the policy trainer (one GPU), the replica is idle for a moment between the end of the rollout and the "
        "trainer's LendDevices: a window opened there would load the drafter and its optimizer onto the device just "
        "as the trainer starts on it"
    )
    submit_every: int = Field(20, ge=1, description="micro-steps between delta submissions inside a long window")
    threads: int = Field(1, ge=0, description="torch threads per worker and for the coordinator's evaluations on CPU (0: leave torch's default)")
    device: str = Field("cpu", description="worker device template: cpu, or cuda (a worker uses cuda:<replica>)")
    coordinator_nice: int = Field(
        10, ge=0, le=19, description="niceness of the coordinator process (`tlt drafter serve`, after starting its "
        "workers): its feature ingest and candidate evaluations yield the CPU to busy rollout replicas; 0 = normal"
    )
    worker_nice: int = Field(
        0, ge=0, le=19, description="niceness of worker processes. 0 where a worker has its replica's device to itself "
        "(a GPU); on a CPU machine shared with the policy trainer, 19 makes workers train only on cycles nothing else "
        "wants (a replica's idle window is the trainer's busy time there)"
    )
    evaluation_sched: Literal["normal", "idle"] = Field(
        "normal", description="CPU scheduling class of the coordinator's candidate evaluations (its gate thread "
        "only; feature ingest and worker service keep coordinator_nice): idle = Linux SCHED_IDLE. They run between "
        "rollouts, which on a CPU machine is the policy trainer's time (~0.4 CPU-s per drafter scored on the tiny "
        "model, BENCHMARKS.md 'Session 7')"
    )
    worker_sched: Literal["normal", "idle"] = Field(
        "normal", description="CPU scheduling class of worker processes: idle = Linux SCHED_IDLE, which runs a worker "
        "only on cycles no other task wants and lets any waking task preempt it at once (on a CPU machine shared "
        "with the policy trainer, a nice-19 task slowed a 2-thread policy forward/backward by 21%, a SCHED_IDLE one "
        "by nothing measurable; in `tlt run` on a 2-vCPU VM both classes gave the same step times, BENCHMARKS.md "
        "'Session 7'); normal where a worker has its replica's device to itself"
    )
    train_when: Literal["replica_idle", "rollout_idle", "always"] = Field(
        "replica_idle", description="when a worker trains: while the replica it watches is idle (TLT: a replica "
        "whose share of the rollout is done trains while others still decode; right where replicas have devices "
        "of their own), only while every replica is idle (CPU replicas share caches and memory bandwidth: "
        "training beside a decoding replica slowed it by ~13%, BENCHMARKS.md 'Session 5'), or always (the drafter "
        "has devices of its own, as in the Kubernetes manifests: a window ends at each submission, so that a newer "
        "policy's embedding / lm_head comes in between windows)"
    )
    pin_cpus: bool = Field(
        True, description="CPU workers: run on the cores of the replica they watch (cpu_group(replica, threads), as "
        "the rollout's pin_cpus places replicas with threads_per_replica = threads)"
    )
    # ---- publishing
    publish_margin: float = Field(
        0.02, ge=0, description="publish when candidate accept length >= serving x (1 + margin) on held-out data, "
        "and above the serving one (a tie is not published, whatever the margin)"
    )
    eval_depth: int = Field(6, ge=1, le=32, description="chain depth of the offline acceptance simulation")
    eval_interval_s: float = Field(2.0, ge=0, description="least seconds between two candidate evaluations")
    gate_when_idle: bool = Field(
        True, description="evaluate candidates (and publish) only while every rollout replica is idle, as seen on "
        "capacity_pub; an evaluation stops when one turns busy. The evaluation is seconds of CPU per round: run "
        "during decoding it slowed CPU rollouts by 57% (BENCHMARKS.md, 'Session 5')")
    min_eval_tokens: int = Field(64, ge=1, description="held-out tokens needed before a candidate may be published")
    history: int = Field(200, ge=1, description="training windows and acceptance records kept for status")

    @field_validator("capacity_pub", "capacity_snapshot", "features_bind", "coordinator_bind")
    @classmethod
    def _zmq_endpoint(cls, v: str, info: ValidationInfo) -> str:
        """An empty or malformed endpoint failed late: a ZMQError traceback at start (the binds), a worker that
        crashed, or a coordinator whose idle gate was silently off (capacity_*: set gate_when_idle = false for that)."""
        problem = zmq_endpoint_problem(v, bind=info.field_name in ("features_bind", "coordinator_bind"))
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("rollout_grpc", "host", "checkpoint_dir")
    @classmethod
    def _not_empty(cls, v: str, info: ValidationInfo) -> str:
        """'' failed only at the first policy update (rollout_grpc), or was silently the current folder."""
        if not v.strip():
            hint = {"rollout_grpc": "give the rollout's gRPC host:port, e.g. 127.0.0.1:50051",
                    "host": "use 127.0.0.1 for loopback or 0.0.0.0 to expose",
                    "checkpoint_dir": "'' would be the current folder; give a folder, e.g. artifacts/drafter-online"}
            raise ValueError(f"{info.field_name} must not be empty; {hint[str(info.field_name)]}")
        if info.field_name == "rollout_grpc" and (problem := grpc_address_problem(v)) is not None:
            raise ValueError(f"rollout_grpc {problem}")  # a typo failed at the first policy update, minutes in
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        """'' or 'gpu' failed only in torch, in each worker process as it built its drafter."""
        if (problem := device_problem(v, indexed=False)) is not None:
            raise ValueError(f"device {problem}")
        return v

    @model_validator(mode="after")
    def _check(self) -> DrafterServiceConfig:
        if self.window_tokens > self.batch_tokens:
            raise ValueError(
                f"window_tokens ({self.window_tokens}) must fit in a packed row: raise batch_tokens to at least it"
            )
        return self
