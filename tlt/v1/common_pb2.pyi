from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class WeightKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_KIND_UNSPECIFIED: _ClassVar[WeightKind]
    WEIGHT_KIND_POLICY: _ClassVar[WeightKind]
    WEIGHT_KIND_DRAFTER: _ClassVar[WeightKind]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_BUSY: _ClassVar[ReplicaState]
    REPLICA_STATE_IDLE: _ClassVar[ReplicaState]
    REPLICA_STATE_DRAINING: _ClassVar[ReplicaState]
    REPLICA_STATE_LENT: _ClassVar[ReplicaState]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
WEIGHT_KIND_UNSPECIFIED: WeightKind
WEIGHT_KIND_POLICY: WeightKind
WEIGHT_KIND_DRAFTER: WeightKind
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_BUSY: ReplicaState
REPLICA_STATE_IDLE: ReplicaState
REPLICA_STATE_DRAINING: ReplicaState
REPLICA_STATE_LENT: ReplicaState

class WeightVersions(_message.Message):
    __slots__ = ("policy", "drafter", "policy_min")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    POLICY_MIN_FIELD_NUMBER: _ClassVar[int]
    policy: int
    drafter: int
    policy_min: int
    def __init__(self, policy: _Optional[int] = ..., drafter: _Optional[int] = ..., policy_min: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...
