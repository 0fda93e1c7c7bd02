from tlt.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainingWindow(_message.Message):
    __slots__ = ("worker_id", "replica_id", "start", "end", "micro_steps", "preempted", "busy_timestamp", "released", "mean_loss", "last_step_start", "shared_policy_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    BUSY_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_START_FIELD_NUMBER: _ClassVar[int]
    SHARED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    replica_id: int
    start: float
    end: float
    micro_steps: int
    preempted: bool
    busy_timestamp: float
    released: float
    mean_loss: float
    last_step_start: float
    shared_policy_version: int
    def __init__(self, worker_id: _Optional[int] = ..., replica_id: _Optional[int] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., micro_steps: _Optional[int] = ..., preempted: _Optional[bool] = ..., busy_timestamp: _Optional[float] = ..., released: _Optional[float] = ..., mean_loss: _Optional[float] = ..., last_step_start: _Optional[float] = ..., shared_policy_version: _Optional[int] = ...) -> None: ...

class AcceptanceRecord(_message.Message):
    __slots__ = ("drafter_version", "policy_version", "candidate_accept_len", "serving_accept_len", "published", "timestamp")
    DRAFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SERVING_ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    drafter_version: int
    policy_version: int
    candidate_accept_len: float
    serving_accept_len: float
    published: bool
    timestamp: float
    def __init__(self, drafter_version: _Optional[int] = ..., policy_version: _Optional[int] = ..., candidate_accept_len: _Optional[float] = ..., serving_accept_len: _Optional[float] = ..., published: _Optional[bool] = ..., timestamp: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "replica_id", "training", "micro_steps", "preemptions", "alive", "shared_policy_version", "shared_fetch_failures", "deltas_refused")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SHARED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    DELTAS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    replica_id: int
    training: bool
    micro_steps: int
    preemptions: int
    alive: bool
    shared_policy_version: int
    shared_fetch_failures: int
    deltas_refused: int
    def __init__(self, worker_id: _Optional[int] = ..., replica_id: _Optional[int] = ..., training: _Optional[bool] = ..., micro_steps: _Optional[int] = ..., preemptions: _Optional[int] = ..., alive: _Optional[bool] = ..., shared_policy_version: _Optional[int] = ..., shared_fetch_failures: _Optional[int] = ..., deltas_refused: _Optional[int] = ...) -> None: ...

class DrafterStatus(_message.Message):
    __slots__ = ("serving_version", "candidate_version", "latest_policy", "buffer_sequences", "buffer_tokens", "features_dropped", "workers", "windows", "acceptance", "preemptions", "shared_policy_version", "shared_fetch_failures", "shared_fetch_error", "features_rejected", "deltas_refused")
    SERVING_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_POLICY_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SHARED_FETCH_ERROR_FIELD_NUMBER: _ClassVar[int]
    FEATURES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    DELTAS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    serving_version: int
    candidate_version: int
    latest_policy: _common_pb2.WeightVersions
    buffer_sequences: int
    buffer_tokens: int
    features_dropped: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    windows: _containers.RepeatedCompositeFieldContainer[TrainingWindow]
    acceptance: _containers.RepeatedCompositeFieldContainer[AcceptanceRecord]
    preemptions: int
    shared_policy_version: int
    shared_fetch_failures: int
    shared_fetch_error: str
    features_rejected: int
    deltas_refused: int
    def __init__(self, serving_version: _Optional[int] = ..., candidate_version: _Optional[int] = ..., latest_policy: _Optional[_Union[_common_pb2.WeightVersions, _Mapping]] = ..., buffer_sequences: _Optional[int] = ..., buffer_tokens: _Optional[int] = ..., features_dropped: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., windows: _Optional[_Iterable[_Union[TrainingWindow, _Mapping]]] = ..., acceptance: _Optional[_Iterable[_Union[AcceptanceRecord, _Mapping]]] = ..., preemptions: _Optional[int] = ..., shared_policy_version: _Optional[int] = ..., shared_fetch_failures: _Optional[int] = ..., shared_fetch_error: _Optional[str] = ..., features_rejected: _Optional[int] = ..., deltas_refused: _Optional[int] = ...) -> None: ...

class WorkerHello(_message.Message):
    __slots__ = ("worker_id", "replica_id", "pid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    replica_id: int
    pid: int
    def __init__(self, worker_id: _Optional[int] = ..., replica_id: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...

class PullCandidate(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("max_tokens", "rows")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    rows: int
    def __init__(self, max_tokens: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class TrainBatch(_message.Message):
    __slots__ = ("rows", "length", "hidden_size", "token_ids", "features", "segment_ids", "loss_mask", "policy_version", "sequences")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    rows: int
    length: int
    hidden_size: int
    token_ids: bytes
    features: bytes
    segment_ids: bytes
    loss_mask: bytes
    policy_version: int
    sequences: int
    def __init__(self, rows: _Optional[int] = ..., length: _Optional[int] = ..., hidden_size: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., features: _Optional[bytes] = ..., segment_ids: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., policy_version: _Optional[int] = ..., sequences: _Optional[int] = ...) -> None: ...

class DeltaUpdate(_message.Message):
    __slots__ = ("base_version", "manifest", "payload", "micro_steps", "mean_loss")
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    base_version: int
    manifest: bytes
    payload: bytes
    micro_steps: int
    mean_loss: float
    def __init__(self, base_version: _Optional[int] = ..., manifest: _Optional[bytes] = ..., payload: _Optional[bytes] = ..., micro_steps: _Optional[int] = ..., mean_loss: _Optional[float] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("worker_id", "replica_id", "hello", "pull", "batch_request", "update", "window", "shared_policy_version", "shared_fetch_failures")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    BATCH_REQUEST_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SHARED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    replica_id: int
    hello: WorkerHello
    pull: PullCandidate
    batch_request: BatchRequest
    update: DeltaUpdate
    window: TrainingWindow
    shared_policy_version: int
    shared_fetch_failures: int
    def __init__(self, worker_id: _Optional[int] = ..., replica_id: _Optional[int] = ..., hello: _Optional[_Union[WorkerHello, _Mapping]] = ..., pull: _Optional[_Union[PullCandidate, _Mapping]] = ..., batch_request: _Optional[_Union[BatchRequest, _Mapping]] = ..., update: _Optional[_Union[DeltaUpdate, _Mapping]] = ..., window: _Optional[_Union[TrainingWindow, _Mapping]] = ..., shared_policy_version: _Optional[int] = ..., shared_fetch_failures: _Optional[int] = ...) -> None: ...

class CandidateWeights(_message.Message):
    __slots__ = ("version", "manifest", "payload")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: bytes
    payload: bytes
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("error", "status", "candidate", "batch", "candidate_version")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    error: str
    status: DrafterStatus
    candidate: CandidateWeights
    batch: TrainBatch
    candidate_version: int
    def __init__(self, error: _Optional[str] = ..., status: _Optional[_Union[DrafterStatus, _Mapping]] = ..., candidate: _Optional[_Union[CandidateWeights, _Mapping]] = ..., batch: _Optional[_Union[TrainBatch, _Mapping]] = ..., candidate_version: _Optional[int] = ...) -> None: ...
