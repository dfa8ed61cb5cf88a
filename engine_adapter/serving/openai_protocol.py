"""The OpenAI-compatible request bodies the HTTP front accepts (pydantic), and error bodies.

Fields follow OpenAI's Chat Completions and Completions APIs (as vLLM's
``entrypoints/openai/protocol.py`` does); fields we do not implement and that would change
the answer (``n > 1``, ``logprobs``, ``echo``, tools) are refused with a 400 rather than
ignored. Two additions: ``cache_salt`` (as in vLLM: narrows the tenant's block-key salt) and
``traffic_class`` (the store's TTL class of this request's KV blocks, default ``chat``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: sampling, not greedy
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=OPENAI_DEFAULT_TEMPERATURE, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is served")
    logprobs: Any = None
    cache_salt: str | None = None
    traffic_class: str = "chat"
    user: str | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


def error_body(message: str, error_type: str, code: str | None = None, param: str | None = None):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
