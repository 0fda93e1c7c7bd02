from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("id", "prompt", "completion", "reference", "metadata", "json_metadata_keys")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    JSON_METADATA_KEYS_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    completion: str
    reference: str
    metadata: _containers.ScalarMap[str, str]
    json_metadata_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., reference: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., json_metadata_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("id", "reward", "ok", "error", "correct")
    ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    id: str
    reward: float
    ok: bool
    error: str
    correct: bool
    def __init__(self, id: _Optional[str] = ..., reward: _Optional[float] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., correct: _Optional[bool] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ...) -> None: ...
