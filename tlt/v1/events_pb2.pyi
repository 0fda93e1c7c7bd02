from tlt.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CapacityEvent(_message.Message):
    __slots__ = ("replica_id", "device", "state", "running", "queued", "kv_usage", "versions", "timestamp", "seq", "heartbeat", "server_id", "start_drafter")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    START_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    device: str
    state: _common_pb2.ReplicaState
    running: int
    queued: int
    kv_usage: float
    versions: _common_pb2.WeightVersions
    timestamp: float
    seq: int
    heartbeat: bool
    server_id: str
    start_drafter: str
    def __init__(self, replica_id: _Optional[int] = ..., device: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.ReplicaState, str]] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., kv_usage: _Optional[float] = ..., versions: _Optional[_Union[_common_pb2.WeightVersions, _Mapping]] = ..., timestamp: _Optional[float] = ..., seq: _Optional[int] = ..., heartbeat: _Optional[bool] = ..., server_id: _Optional[str] = ..., start_drafter: _Optional[str] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[CapacityEvent]
    def __init__(self, replicas: _Optional[_Iterable[_Union[CapacityEvent, _Mapping]]] = ...) -> None: ...

class FeatureSequence(_message.Message):
    __slots__ = ("seq_id", "group_id", "token_ids", "response_start", "hidden_size", "features", "policy_version", "replica_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_START_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    group_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_start: int
    hidden_size: int
    features: bytes
    policy_version: int
    replica_id: int
    def __init__(self, seq_id: _Optional[str] = ..., group_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., response_start: _Optional[int] = ..., hidden_size: _Optional[int] = ..., features: _Optional[bytes] = ..., policy_version: _Optional[int] = ..., replica_id: _Optional[int] = ...) -> None: ...

class FeatureBatch(_message.Message):
    __slots__ = ("sequences", "source", "dropped_before", "sender", "dropped_since")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SINCE_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[FeatureSequence]
    source: str
    dropped_before: int
    sender: str
    dropped_since: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[FeatureSequence, _Mapping]]] = ..., source: _Optional[str] = ..., dropped_before: _Optional[int] = ..., sender: _Optional[str] = ..., dropped_since: _Optional[int] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("capacity", "features", "snapshot_request", "snapshot")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    capacity: CapacityEvent
    features: FeatureBatch
    snapshot_request: SnapshotRequest
    snapshot: Snapshot
    def __init__(self, capacity: _Optional[_Union[CapacityEvent, _Mapping]] = ..., features: _Optional[_Union[FeatureBatch, _Mapping]] = ..., snapshot_request: _Optional[_Union[SnapshotRequest, _Mapping]] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ...) -> None: ...
