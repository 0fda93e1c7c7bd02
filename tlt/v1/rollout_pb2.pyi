from tlt.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class LendRequest(_message.Message):
    __slots__ = ("lend", "lease_s", "holder")
    LEND_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    lend: bool
    lease_s: float
    holder: str
    def __init__(self, lend: _Optional[bool] = ..., lease_s: _Optional[float] = ..., holder: _Optional[str] = ...) -> None: ...

class LendResponse(_message.Message):
    __slots__ = ("lent", "expires_in_s", "replicas", "seconds")
    LENT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    lent: bool
    expires_in_s: float
    replicas: _containers.RepeatedScalarFieldContainer[int]
    seconds: float
    def __init__(self, lent: _Optional[bool] = ..., expires_in_s: _Optional[float] = ..., replicas: _Optional[_Iterable[int]] = ..., seconds: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "return_features", "reproducible")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    REPRODUCIBLE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    return_features: bool
    reproducible: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., return_features: _Optional[bool] = ..., reproducible: _Optional[bool] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids", "reference")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    reference: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., reference: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchGenerateRequest(_message.Message):
    __slots__ = ("batch_id", "prompts", "n", "params")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    n: int
    params: SamplingParams
    def __init__(self, batch_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., n: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "n", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: Prompt
    n: int
    params: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., n: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("verify_steps", "accepted_tokens", "plain_decode_steps")
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    verify_steps: int
    accepted_tokens: int
    plain_decode_steps: int
    def __init__(self, verify_steps: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., plain_decode_steps: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("request_id", "prompt_index", "sample_index", "prompt_token_ids", "token_ids", "text", "logprobs", "top_logprobs", "finish_reason", "versions", "spec", "replica_id", "features", "hidden_size", "error", "reference")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_index: int
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    finish_reason: FinishReason
    versions: _common_pb2.WeightVersions
    spec: SpecStats
    replica_id: int
    features: bytes
    hidden_size: int
    error: str
    reference: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., versions: _Optional[_Union[_common_pb2.WeightVersions, _Mapping]] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., replica_id: _Optional[int] = ..., features: _Optional[bytes] = ..., hidden_size: _Optional[int] = ..., error: _Optional[str] = ..., reference: _Optional[str] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("kind", "version", "tensors", "total_bytes", "sha256", "shm_path")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    kind: _common_pb2.WeightKind
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    total_bytes: int
    sha256: str
    shm_path: str
    def __init__(self, kind: _Optional[_Union[_common_pb2.WeightKind, str]] = ..., version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., shm_path: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("manifest", "data")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    data: bytes
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetWeightsRequest(_message.Message):
    __slots__ = ("kind", "names")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    kind: _common_pb2.WeightKind
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[_common_pb2.WeightKind, str]] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("ok", "error", "kind", "version", "apply_seconds", "replicas")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    kind: _common_pb2.WeightKind
    version: int
    apply_seconds: float
    replicas: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.WeightKind, str]] = ..., version: _Optional[int] = ..., apply_seconds: _Optional[float] = ..., replicas: _Optional[_Iterable[int]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecStatus(_message.Message):
    __slots__ = ("mode", "active", "arm", "mean_accept_len", "last_step_seconds", "verify_steps", "plain_steps", "bandit", "arms", "no_room", "over_budget", "switches")
    MODE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ARM_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    BANDIT_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    OVER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    active: bool
    arm: str
    mean_accept_len: float
    last_step_seconds: float
    verify_steps: int
    plain_steps: int
    bandit: _containers.RepeatedCompositeFieldContainer[BanditBucket]
    arms: _containers.RepeatedCompositeFieldContainer[ArmCount]
    no_room: int
    over_budget: int
    switches: int
    def __init__(self, mode: _Optional[str] = ..., active: _Optional[bool] = ..., arm: _Optional[str] = ..., mean_accept_len: _Optional[float] = ..., last_step_seconds: _Optional[float] = ..., verify_steps: _Optional[int] = ..., plain_steps: _Optional[int] = ..., bandit: _Optional[_Iterable[_Union[BanditBucket, _Mapping]]] = ..., arms: _Optional[_Iterable[_Union[ArmCount, _Mapping]]] = ..., no_room: _Optional[int] = ..., over_budget: _Optional[int] = ..., switches: _Optional[int] = ...) -> None: ...

class BanditBucket(_message.Message):
    __slots__ = ("bucket", "explored", "exploited", "arms")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    EXPLORED_FIELD_NUMBER: _ClassVar[int]
    EXPLOITED_FIELD_NUMBER: _ClassVar[int]
    ARMS_FIELD_NUMBER: _ClassVar[int]
    bucket: str
    explored: int
    exploited: int
    arms: _containers.RepeatedCompositeFieldContainer[BanditArm]
    def __init__(self, bucket: _Optional[str] = ..., explored: _Optional[int] = ..., exploited: _Optional[int] = ..., arms: _Optional[_Iterable[_Union[BanditArm, _Mapping]]] = ...) -> None: ...

class BanditArm(_message.Message):
    __slots__ = ("arm", "samples", "median_reward", "chosen")
    ARM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    arm: str
    samples: int
    median_reward: float
    chosen: int
    def __init__(self, arm: _Optional[str] = ..., samples: _Optional[int] = ..., median_reward: _Optional[float] = ..., chosen: _Optional[int] = ...) -> None: ...

class ArmCount(_message.Message):
    __slots__ = ("arm", "steps", "accept_len")
    ARM_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LEN_FIELD_NUMBER: _ClassVar[int]
    arm: str
    steps: int
    accept_len: float
    def __init__(self, arm: _Optional[str] = ..., steps: _Optional[int] = ..., accept_len: _Optional[float] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "device", "state", "running", "queued", "kv_usage", "versions", "spec", "alive")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    device: str
    state: _common_pb2.ReplicaState
    running: int
    queued: int
    kv_usage: float
    versions: _common_pb2.WeightVersions
    spec: SpecStatus
    alive: bool
    def __init__(self, replica_id: _Optional[int] = ..., device: _Optional[str] = ..., state: _Optional[_Union[_common_pb2.ReplicaState, str]] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., kv_usage: _Optional[float] = ..., versions: _Optional[_Union[_common_pb2.WeightVersions, _Mapping]] = ..., spec: _Optional[_Union[SpecStatus, _Mapping]] = ..., alive: _Optional[bool] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("model", "backend", "replicas", "versions", "lent_to", "control_refused", "dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LENT_TO_FIELD_NUMBER: _ClassVar[int]
    CONTROL_REFUSED_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    backend: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    versions: _common_pb2.WeightVersions
    lent_to: str
    control_refused: str
    dtype: str
    def __init__(self, model: _Optional[str] = ..., backend: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., versions: _Optional[_Union[_common_pb2.WeightVersions, _Mapping]] = ..., lent_to: _Optional[str] = ..., control_refused: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...
