"""The OpenAI-compatible request bodies the HTTP front accepts (pydantic), and error bodies.

Fields follow OpenAI's Chat Completions and Completions APIs (as vLLM's
``entrypoints/openai/protocol.py`` does); fields we do not implement and that would change
the answer (``n > 1``, ``logprobs``, ``echo``, tools, penalties, ``logit_bias``) are refused
with a 400 rather than ignored. Two additions: ``cache_salt`` (as in vLLM: narrows the
tenant's block-key salt) and ``traffic_class`` (the store's TTL class of this request's KV
blocks, default ``chat``); and vLLM's ``top_k``.

Every field is bounded and typed here, before anything else sees it: an integer outside its
range (``max_tokens`` 2^70, a token id of -1 or 2^40, a seed past 64 bits), a wrong type
(``stream: "yes"``: booleans are strict, as OpenAI's are), a message role OpenAI does not
have, or an overlong string is a validation error, which the front answers 400 naming the
field. The
bounds are those of the wire format (``serving.proto``: token ids and counts are uint32, the
seed uint64), so no value that passes can fail later on the way to a worker. ``/tokenize``
and ``/detokenize`` take vLLM's request shapes. :class:`ApiError` is every error's answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from engine_adapter.serving.errors import ContextTooLong, QueueFull, TenantNotAllowed, error_body
from kvstore.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unavailable,
)

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: sampling, not greedy
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
INT32_MAX = 2**31 - 1  # counts and token ids (uint32 on the wire; no model needs more)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # vLLM takes int64; the wire holds it as uint64
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 1024
MAX_NAME_CHARS = 256  # model, cache_salt, user, role
MAX_TRAFFIC_CLASS_CHARS = 64
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound (logprobs are refused, but typed)

Count = Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)]  # strict: no bools, "5" or 5.0
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
# OpenAI's message roles ("function" is its deprecated form of "tool"); anything else is a 400.
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
# Booleans as OpenAI takes them: true or false, never "yes", "true", 1 or "on".
Bool = StrictBool


def _token_ids(value: list[Any], what: str) -> list[int]:
    """``value`` as token ids, each an int in [0, INT32_MAX] (bools are not ids)."""
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise ValueError(f"{what}[{index}] is {item!r}: token ids are integers")
        if not 0 <= item <= INT32_MAX:
            raise ValueError(f"{what}[{index}] = {item} is not a token id (0 to {INT32_MAX})")
    return value


class ChatMessage(BaseModel):
    role: Role
    content: Any = None  # a string or a list of {"type": "text", "text": ...} parts

    @field_validator("content")
    @classmethod
    def _text_content(cls, value: Any) -> str:
        """The message's text: a string, or the concatenated text parts (images are refused)."""
        if value is None or isinstance(value, str):
            return value or ""
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts")
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ValueError('content parts must be {"type": "text", "text": "..."}')
            if not isinstance(part.get("text"), str):
                raise ValueError("a text part's text must be a string")
            texts.append(part["text"])
        return "".join(texts)

    def text(self) -> str:
        return self.content


class StreamOptions(BaseModel):
    include_usage: Bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: Name
    max_tokens: Count | None = None
    temperature: float = Field(default=OPENAI_DEFAULT_TEMPERATURE, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, strict=True, ge=-1, le=INT32_MAX, description="-1, 0: all")
    stop: Any = None
    seed: int | None = Field(default=None, strict=True, ge=SEED_MIN, le=SEED_MAX)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, strict=True, ge=1, le=1, description="only n=1 is served")
    logprobs: Any = None
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=MAX_LOGPROBS)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    cache_salt: Name | None = None
    traffic_class: str = Field(default="chat", min_length=1, max_length=MAX_TRAFFIC_CLASS_CHARS)
    user: Name | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str]:
        stops = [value] if isinstance(value, str) else [] if value is None else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                "characters"
            )
        return stops

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: Any) -> bool | int | None:
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int) and 0 <= value <= MAX_LOGPROBS:
            return value
        raise ValueError(f"logprobs must be a boolean or an integer from 0 to {MAX_LOGPROBS}")

    def stop_strings(self) -> list[str]:
        return list(self.stop or ())  # the default (None) is not run through the validator

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def seed_u64(self) -> int | None:
        """The seed as the wire's uint64 (a negative int64 seed wraps, as a C cast does)."""
        return None if self.seed is None else self.seed % 2**64

    def unserved_field(self) -> str | None:
        """The first field set to something that would change the answer and is not served."""
        unserved = {
            "logprobs": bool(self.logprobs),
            "top_logprobs": bool(self.top_logprobs),
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }
        return next((name for name, is_set in unserved.items() if is_set), None)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    tools: list[Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: Any  # a string, token ids, or a list holding one of those (batches are refused)
    echo: Bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string or a non-empty list of token ids")
        if all(isinstance(item, int) for item in value):
            return _token_ids(value, "prompt")
        if len(value) != 1:
            raise ValueError("send one prompt per request (batches are not served)")
        (only,) = value
        if isinstance(only, str):
            return only
        if isinstance(only, list) and only:
            return _token_ids(only, "prompt[0]")
        raise ValueError("prompt must be a string or a non-empty list of token ids")


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages`` through the template."""

    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` body."""

    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    tokens: list[Any]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value: list[Any]) -> list[int]:
        return _token_ids(value, "tokens")


# kvstore error -> (HTTP status, OpenAI error type, code); the first match wins.
_ERROR_STATUS: list[tuple[type[KVStoreError], int, str, str | None]] = [
    (ContextTooLong, 413, "invalid_request_error", "context_length_exceeded"),
    (QueueFull, 429, "rate_limit_error", "queue_full"),
    (TenantNotAllowed, 403, "permission_error", "tenant_not_allowed"),
    (PermissionDenied, 401, "authentication_error", "invalid_api_key"),
    (InvalidArgument, 400, "invalid_request_error", None),
    (DeadlineExceeded, 504, "timeout_error", "deadline_exceeded"),
    (Unavailable, 503, "service_unavailable_error", "no_worker"),
]
UNAVAILABLE_RETRY_AFTER_S = 5  # a crashed worker is restarted; loading it takes a while


class ApiError(Exception):
    """An error answered as an OpenAI error body with ``status`` (and ``Retry-After`` when
    ``retry_after_s`` is set)."""

    def __init__(self, status: int, message: str, error_type: str, code: str | None = None,
                 param: str | None = None, retry_after_s: float | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.error_type, self.code, self.param = status, error_type, code, param
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, exc: KVStoreError) -> ApiError:
        for error_type, status, kind, code in _ERROR_STATUS:
            if isinstance(exc, error_type):
                error = cls(status, str(exc), kind, code)
                if isinstance(exc, QueueFull):
                    error.code, error.retry_after_s = exc.code, exc.retry_after_s
                elif status == 503:
                    error.retry_after_s = UNAVAILABLE_RETRY_AFTER_S
                return error
        return cls(500, str(exc), "internal_error")

    def response(self) -> JSONResponse:
        body = error_body(str(self), self.error_type, self.code, self.param)
        headers = {} if self.retry_after_s is None else {"Retry-After": f"{self.retry_after_s:.0f}"}
        return JSONResponse(body, status_code=self.status, headers=headers)
