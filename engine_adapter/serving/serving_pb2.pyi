from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_k", "seed", "ignore_eos", "top_p")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    seed: int
    ignore_eos: bool
    top_p: float
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: bool = ..., top_p: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "messages", "token_ids", "sampling", "timeout_s", "stop", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    traffic_class: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    timeout_s: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., timeout_s: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrefillStats(_message.Message):
    __slots__ = ("worker_id", "num_prompt_tokens", "num_cached_tokens", "num_computed_tokens", "prefill_s", "num_attempts", "num_matched_tokens", "busy_s", "fetch_bytes", "fallback")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    prefill_s: float
    num_attempts: int
    num_matched_tokens: int
    busy_s: float
    fetch_bytes: int
    fallback: str
    def __init__(self, worker_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., prefill_s: _Optional[float] = ..., num_attempts: _Optional[int] = ..., num_matched_tokens: _Optional[int] = ..., busy_s: _Optional[float] = ..., fetch_bytes: _Optional[int] = ..., fallback: _Optional[str] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("prefill", "token", "finish")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    prefill: PrefillStats
    token: TokenDelta
    finish: Finish
    def __init__(self, prefill: _Optional[_Union[PrefillStats, _Mapping]] = ..., token: _Optional[_Union[TokenDelta, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_id", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("finish_reason", "decode_worker_id", "num_swapped_tokens", "num_recomputed_tokens", "text", "num_migrations")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    decode_worker_id: str
    num_swapped_tokens: int
    num_recomputed_tokens: int
    text: str
    num_migrations: int
    def __init__(self, finish_reason: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., num_swapped_tokens: _Optional[int] = ..., num_recomputed_tokens: _Optional[int] = ..., text: _Optional[str] = ..., num_migrations: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "messages", "token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    traffic_class: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "model_fingerprint", "token_ids", "block_tokens", "num_stored_blocks", "tail_kv", "tail_tokens", "kv_dtype", "first_token_id", "sampler_state", "cache_salt", "num_prompt_tokens", "kv_format")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_KV_FIELD_NUMBER: _ClassVar[int]
    TAIL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    traffic_class: str
    model_fingerprint: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_tokens: int
    num_stored_blocks: int
    tail_kv: bytes
    tail_tokens: int
    kv_dtype: str
    first_token_id: int
    sampler_state: bytes
    cache_salt: str
    num_prompt_tokens: int
    kv_format: str
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_tokens: _Optional[int] = ..., num_stored_blocks: _Optional[int] = ..., tail_kv: _Optional[bytes] = ..., tail_tokens: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., first_token_id: _Optional[int] = ..., sampler_state: _Optional[bytes] = ..., cache_salt: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., kv_format: _Optional[str] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first", "handoff")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    first: PrefillFirst
    handoff: Handoff
    def __init__(self, first: _Optional[_Union[PrefillFirst, _Mapping]] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ...) -> None: ...

class PrefillFirst(_message.Message):
    __slots__ = ("stats", "first_token_id", "text")
    STATS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    stats: PrefillStats
    first_token_id: int
    text: str
    def __init__(self, stats: _Optional[_Union[PrefillStats, _Mapping]] = ..., first_token_id: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("handoff", "sampling")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    handoff: Handoff
    sampling: SamplingParams
    def __init__(self, handoff: _Optional[_Union[Handoff, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("token", "finish", "migrate")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FIELD_NUMBER: _ClassVar[int]
    token: TokenDelta
    finish: Finish
    migrate: Handoff
    def __init__(self, token: _Optional[_Union[TokenDelta, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., migrate: _Optional[_Union[Handoff, _Mapping]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_s",)
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    def __init__(self, grace_s: _Optional[float] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("num_active",)
    NUM_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    num_active: int
    def __init__(self, num_active: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("worker_id", "role", "model_fingerprint", "num_active", "pid", "draining", "max_model_len", "calibration_tokens", "calibration_s", "prefill_chunk_tokens", "metrics_address", "not_serving")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NOT_SERVING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model_fingerprint: str
    num_active: int
    pid: int
    draining: bool
    max_model_len: int
    calibration_tokens: _containers.RepeatedScalarFieldContainer[int]
    calibration_s: _containers.RepeatedScalarFieldContainer[float]
    prefill_chunk_tokens: int
    metrics_address: str
    not_serving: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_active: _Optional[int] = ..., pid: _Optional[int] = ..., draining: bool = ..., max_model_len: _Optional[int] = ..., calibration_tokens: _Optional[_Iterable[int]] = ..., calibration_s: _Optional[_Iterable[float]] = ..., prefill_chunk_tokens: _Optional[int] = ..., metrics_address: _Optional[str] = ..., not_serving: _Optional[str] = ...) -> None: ...
