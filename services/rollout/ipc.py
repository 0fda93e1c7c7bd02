"""Typed messages between the front process and its replica processes.

    front --Command--> replica      (AddRequest, AbortRequest, ApplyWeights, Lend, QueryStats, Shutdown)
    replica --Event--> front        (Ready, StepEvents, Aborted, RequestFailed, Reply, Fatal)

Both directions travel over one duplex `multiprocessing` pipe per replica
(pickled dataclasses; no tensors cross it: weights travel as the packed
payload of `services/common/weights.py` and features as numpy arrays, so no
file descriptors are passed around). A reply to a command that asks for one
carries the command's `cmd_id`. What the engine holds (`EngineLoad`: running,
queued, KV use) rides along with every StepEvents and Aborted, so the front's
capacity events follow the engine without a message of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tlt.services.rollout.types import CompletionOutput, GenerationRequest, StepOutput, Versions


# ---- front -> replica -------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request: GenerationRequest


@dataclass(frozen=True)
class AbortRequest:
    """Drop a request's sequences; answered with `Aborted(cmd_id)` once the engine holds none of them."""

    request_id: str
    cmd_id: int


@dataclass(frozen=True)
class ApplyWeights:
    """A validated weight push: `manifest` is a serialized tlt.v1.WeightManifest."""

    cmd_id: int
    kind: str  # "policy" | "drafter"
    version: int
    manifest: bytes
    payload: bytes


@dataclass(frozen=True)
class Lend:
    """The device goes to the colocated trainer (`lent`) or comes back. Lending releases what the engine can
    free (`release()`, e.g. SGLang's KV cache) once it holds no sequences; answered with `Reply(cmd_id)` when done
    (cmd_id 0: nobody waits for the answer)."""

    cmd_id: int
    lent: bool


@dataclass(frozen=True)
class QueryStats:
    cmd_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequest | ApplyWeights | Lend | QueryStats | Shutdown


# ---- replica -> front -------------------------------------------------------


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica learns when it loads the model; sent once in `Ready`."""

    replica_id: int
    device: str
    max_model_len: int
    vocab_size: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    versions: Versions
    expected_weights: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, torch dtype name)
    pid: int
    runs_sample_subsets: bool = False  # its engine runs a request's `sample_indices` alone (re-dispatch, replicas.py)
    kv_capacity_tokens: int = 0  # the most tokens (prompt + max_tokens) one sequence's KV cache can hold; 0: unknown
    start_drafter: str = ""  # the learned drafter it started with, as tlt.model.drafter.folder_identity; "": none


@dataclass(frozen=True)
class Ready:
    info: ReplicaInfo


@dataclass(frozen=True)
class EngineLoad:
    """What a replica's engine holds right now (after its last step or abort): capacity events carry it."""

    running: int = 0
    queued: int = 0
    kv_usage: float = 0.0


@dataclass
class StepEvents:
    """Everything one engine step produced on one replica, and the engine's load after it."""

    steps: list[StepOutput]
    finished: list[CompletionOutput]  # features, when asked, are numpy float16 arrays
    load: EngineLoad


@dataclass(frozen=True)
class Aborted:
    """The engine holds none of the sequences of the aborted request any more (answers `AbortRequest.cmd_id`);
    until then the replica may still be decoding them."""

    cmd_id: int
    load: EngineLoad


@dataclass(frozen=True)
class RequestFailed:
    """The engine refused a request (ValueError): a client error, reported as 400."""

    request_id: str
    message: str


@dataclass(frozen=True)
class ReplicaStats:
    running: int
    queued: int
    kv_usage: float
    versions: Versions
    num_preemptions: int
    steps: int
    spec: dict = field(default_factory=dict)
    features_dropped: int = 0  # finished sequences whose drafter features were dropped (slow/absent consumer)
    gc: dict = field(default_factory=dict)  # the replica process's collections (services/common/gc_heap.GcPauses)


@dataclass(frozen=True)
class Reply:
    """The answer to a command with a `cmd_id`; `error` empty when it succeeded."""

    cmd_id: int
    error: str = ""
    stats: ReplicaStats | None = None
    versions: Versions | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Fatal:
    """The replica loop died; the message says why. The process exits after sending it. `checkpoint`: the user's
    folder is at fault (a CheckpointError or DrafterError while loading: a bad tensor, NaN weights, an unreadable
    tokenizer), its message alone; the start then fails as that error, one line, not a replica failure."""

    message: str
    checkpoint: str = ""


Event = Ready | StepEvents | Aborted | RequestFailed | Reply | Fatal
