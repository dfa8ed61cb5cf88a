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
    __slots__ = ("max_new_tokens", "temperature", "top_k", "seed", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    seed: int
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "messages", "token_ids", "sampling", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    traffic_class: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PrefillStats(_message.Message):
    __slots__ = ("worker_id", "num_prompt_tokens", "num_cached_tokens", "num_computed_tokens", "prefill_s", "num_attempts", "num_matched_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_computed_tokens: int
    prefill_s: float
    num_attempts: int
    num_matched_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., prefill_s: _Optional[float] = ..., num_attempts: _Optional[int] = ..., num_matched_tokens: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("finish_reason", "decode_worker_id", "num_swapped_tokens", "num_recomputed_tokens", "text")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    decode_worker_id: str
    num_swapped_tokens: int
    num_recomputed_tokens: int
    text: str
    def __init__(self, finish_reason: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., num_swapped_tokens: _Optional[int] = ..., num_recomputed_tokens: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "messages", "token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    traffic_class: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("request_id", "tenant", "traffic_class", "model_fingerprint", "token_ids", "block_tokens", "num_stored_blocks", "tail_kv", "tail_tokens", "kv_dtype", "first_token_id", "sampler_state")
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
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., traffic_class: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_tokens: _Optional[int] = ..., num_stored_blocks: _Optional[int] = ..., tail_kv: _Optional[bytes] = ..., tail_tokens: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., first_token_id: _Optional[int] = ..., sampler_state: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ("token", "finish")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    token: TokenDelta
    finish: Finish
    def __init__(self, token: _Optional[_Union[TokenDelta, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("worker_id", "role", "model_fingerprint", "num_active", "pid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model_fingerprint: str
    num_active: int
    pid: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_active: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...
