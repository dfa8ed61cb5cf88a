"""The OpenAI completion endpoints' work: request bodies into router requests, router events
into OpenAI responses (whole or server-sent events), and the request log's record of each.

A prompt's text is tokenized here (the chat template for messages, untrusted text for a
prompt), off the event loop when it is long, after a cheap length check: a text longer
than the context could hold even at the longest token is refused (413) without tokenizing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.errors import ContextTooLong, TenantNotAllowed, error_body
from engine_adapter.serving.openai_protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from engine_adapter.serving.request import Request as ServingRequest
from engine_adapter.serving.request import chat_prompt_ids
from engine_adapter.serving.request_log import RequestRecord
from engine_adapter.serving.router import Router
from engine_adapter.tokenizer import ChatTokenizer
from kvstore.errors import KVStoreError, PermissionDenied

TOKENIZE_OFF_LOOP_CHARS = 32_768  # longer texts are tokenized in a thread


class Completions:
    """Turns OpenAI request bodies into router requests and router events into responses."""

    def __init__(self, router: Router, model_name: str) -> None:
        self.router, self.model_name = router, model_name
        self.created_s = int(time.time())
        tokenizer = router.tokenizer  # its longest token, in UTF-8 bytes (0: no tokenizer)
        self.max_token_bytes = max_token_bytes(tokenizer) if tokenizer is not None else 0

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created_s,
            "owned_by": "kvstore",
            "max_model_len": self.router.max_model_len,
        }

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}` (GET /v1/models)", "not_found_error",
                           "model_not_found", "model")  # fmt: skip

    async def complete(self, body: SamplingFields, http: Request, chat: bool) -> Response:
        record: RequestRecord = http.state.record  # set by RequestLog
        record.tenant = http.state.tenant  # set by the authentication middleware
        self.check_model(body.model)
        request = await self._request(body, record, chat)
        events = self.router.stream(request)
        try:
            first = await anext(events)  # admission errors (413, 429, 503, 400, 403) come here
        except StopAsyncIteration:
            raise ApiError(
                503, "the router ended the request without an answer", "internal_error"
            ) from None
        except PermissionDenied as exc:  # the store refused the serving tier for this tenant
            raise ApiError.of(TenantNotAllowed(str(exc))) from None
        kind = "chat.completion" if chat else "text_completion"
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{request.request_id}"
        answer = _Answer(self, record, response_id, kind, chat)
        if body.stream:
            chunks = answer.stream(first, events, body.include_usage())
            return StreamingResponse(chunks, media_type="text/event-stream")
        return JSONResponse(await answer.whole(first, events))

    async def _request(self, body: SamplingFields, record: RequestRecord, chat: bool):
        """The router request of an OpenAI body (400 for what we do not serve)."""
        unserved = body.unserved_field() or _unserved_by_endpoint(body, chat)
        if unserved:
            raise ApiError(400, f"{unserved} is not supported", "invalid_request_error",
                           "unsupported_parameter", unserved)  # fmt: skip
        token_ids = await self._prompt_ids(body, chat)
        record.prompt_tokens = len(token_ids)
        max_tokens = body.requested_max_tokens() if chat else body.max_tokens  # type: ignore[attr-defined]
        if max_tokens is None:
            room = self.router.max_model_len - len(token_ids) + 1
            max_tokens = max(room, 1) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        seed = body.seed_u64()
        return ServingRequest(
            token_ids=token_ids,
            tenant=record.tenant,
            traffic_class=body.traffic_class,
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_k=max(body.top_k, 0),
            top_p=body.top_p,
            seed=secrets.randbits(63) if seed is None else seed,
            stop=body.stop_strings(),
            cache_salt=body.cache_salt or "",
            request_id=record.request_id,
        )

    async def _prompt_ids(self, body: SamplingFields, chat: bool) -> list[int]:
        """Prompt token ids: chat messages through the template, text as untrusted text."""
        if chat:
            assert isinstance(body, ChatCompletionRequest)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            tokenizer = self.tokenizer("messages")
            num_chars = self._check_text_length(sum(len(m["content"]) for m in messages))
            return await _off_loop_if_long(num_chars, chat_prompt_ids, tokenizer, messages)
        assert isinstance(body, CompletionRequest)
        if isinstance(body.prompt, str):
            tokenizer = self.tokenizer("prompt")
            num_chars = self._check_text_length(len(body.prompt))
            return await _off_loop_if_long(num_chars, tokenizer.encode, body.prompt)
        tokenizer = self.router.tokenizer
        if tokenizer is not None and max(body.prompt) >= tokenizer.vocab_size:
            raise ApiError(400, f"prompt: token id {max(body.prompt)} is outside the vocabulary "
                           f"(0 to {tokenizer.vocab_size - 1})", "invalid_request_error", None,
                           "prompt")  # fmt: skip
        return list(body.prompt)

    def tokenizer(self, param: str) -> ChatTokenizer:
        """The router's tokenizer; 400 naming ``param`` if the model has none."""
        if self.router.tokenizer is None:
            raise ApiError(400, f"model {self.model_name} has no tokenizer: send the prompt as "
                           "token ids", "invalid_request_error", None, param)  # fmt: skip
        return self.router.tokenizer

    def _check_text_length(self, num_chars: int) -> int:
        """``num_chars``; 413 for a text that cannot fit the context even at the longest
        token (a token covers at most ``max_token_bytes`` bytes, so that many characters)."""
        max_model_len = self.router.max_model_len
        if max_model_len and num_chars > max_model_len * self.max_token_bytes:
            raise ApiError.of(ContextTooLong(
                f"a prompt of {num_chars} characters is over {max_model_len} tokens, the "
                "model's context; shorten it"))  # fmt: skip
        return num_chars

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/tokenize`` answer: ``count``, ``max_model_len``, ``tokens``, ``token_strs``."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", "invalid_request_error")
        if body.messages is not None:
            tokenizer = self.tokenizer("messages")
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            num_chars = sum(len(m["content"]) for m in messages)
            template = tokenizer.apply_chat_template
            ids = await _off_loop_if_long(num_chars, template, messages, body.add_generation_prompt)
        else:
            tokenizer = self.tokenizer("prompt")
            ids = await _off_loop_if_long(len(body.prompt or ""), tokenizer.encode, body.prompt)
        strs = None
        if body.return_token_strs:
            strs = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return {"count": len(ids), "max_model_len": self.router.max_model_len, "tokens": ids,
                "token_strs": strs}  # fmt: skip

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's ``/detokenize`` answer: ``{"prompt": text}``."""
        self.check_model(body.model)
        tokenizer = self.tokenizer("tokens")
        if body.tokens and max(body.tokens) >= tokenizer.vocab_size:
            raise ApiError(400, f"tokens: token id {max(body.tokens)} is outside the "
                           f"vocabulary (0 to {tokenizer.vocab_size - 1})",
                           "invalid_request_error", None, "tokens")  # fmt: skip
        return {"prompt": tokenizer.decode(body.tokens)}


def _unserved_by_endpoint(body: SamplingFields, chat: bool) -> str | None:
    if chat:
        return "tools" if body.tools else None  # type: ignore[attr-defined]
    if body.echo:  # type: ignore[attr-defined]
        return "echo"
    return "suffix" if body.suffix else None  # type: ignore[attr-defined]


async def _off_loop_if_long(num_chars: int, function: Any, *args: Any) -> Any:
    if num_chars > TOKENIZE_OFF_LOOP_CHARS:
        return await asyncio.to_thread(function, *args)
    return function(*args)


def max_token_bytes(tokenizer: ChatTokenizer) -> int:
    """The UTF-8 length of the vocabulary's longest token (an upper bound on the characters
    one token of text can cover)."""
    return max(
        len(tokenizer.decode([token_id], skip_special_tokens=False).encode())
        for token_id in range(tokenizer.vocab_size)
    )


class _Answer:
    """One request's response, whole or streamed, and its record for the request log."""

    def __init__(self, front: Completions, record: RequestRecord, response_id: str, kind: str,
                 chat: bool) -> None:  # fmt: skip
        self.front, self.record, self.chat = front, record, chat
        self.envelope = {"id": response_id, "object": kind, "model": front.model_name}

    def _observe(self, event: pb.GenerateEvent) -> str:
        """Note the event in the record; its kind."""
        record, which = self.record, event.WhichOneof("event")
        if which == "prefill":
            record.prompt_tokens = event.prefill.num_prompt_tokens
            record.cached_tokens = event.prefill.num_cached_tokens
        elif which == "token":
            record.completion_tokens += 1
            if record.ttft_s is None:
                record.ttft_s = time.monotonic() - record.start_s
        else:
            record.finish = event.finish.finish_reason
        return which

    async def whole(
        self, first: pb.GenerateEvent, events: AsyncIterator[pb.GenerateEvent]
    ) -> dict[str, Any]:
        finish = pb.Finish()
        async for event in _chain(first, events):
            if self._observe(event) == "finish":
                finish = event.finish
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish.finish_reason,
            "logprobs": None,
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": finish.text}
        else:
            choice["text"] = finish.text
        return {**self._envelope(), "choices": [choice], "usage": self._usage()}

    async def stream(
        self,
        first: pb.GenerateEvent,
        events: AsyncIterator[pb.GenerateEvent],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events: a chunk per text delta, the finish chunk, usage, ``[DONE]``."""
        if self.chat:
            self.envelope["object"] += ".chunk"
        shown = ""
        try:
            if self.chat:
                yield self._chunk(None, role=True)
            async for event in _chain(first, events):
                which = self._observe(event)
                if which == "token" and event.token.text:
                    shown += event.token.text
                    yield self._chunk(event.token.text)
                elif which == "finish":
                    rest = _unshown(event.finish.text, shown)
                    if rest:
                        yield self._chunk(rest)
                    yield self._chunk(None, event.finish.finish_reason)
            if include_usage:
                yield _sse({**self._envelope(), "choices": [], "usage": self._usage()})
        except KVStoreError as exc:  # after the first byte the status is sent: say it in-band
            error = ApiError.of(exc)
            self.record.error = error.code or error.error_type
            self.front.router.metrics.errors.labels(str(error.status)).inc()
            yield _sse(error_body(str(error), error.error_type, error.code))
        yield "data: [DONE]\n\n"

    def _chunk(self, delta: str | None, finish_reason: str | None = None, role: bool = False):
        choice = _chunk_choice(self.chat, delta, finish_reason, role)
        return _sse({**self._envelope(), "choices": [choice]})

    def _envelope(self) -> dict[str, Any]:
        return {**self.envelope, "created": int(time.time())}

    def _usage(self) -> dict[str, Any]:
        record = self.record
        return {
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "total_tokens": record.prompt_tokens + record.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": record.cached_tokens},
        }


async def _chain(
    first: pb.GenerateEvent, events: AsyncIterator[pb.GenerateEvent]
) -> AsyncIterator[pb.GenerateEvent]:
    """``first``, then ``events``, which close with this (a client that hung up ends the
    router's request now, its slot and worker calls with it, not at garbage collection)."""
    async with contextlib.aclosing(events):  # type: ignore[type-var]
        yield first
        async for event in events:
            yield event


def _chunk_choice(
    chat: bool, delta: str | None, finish_reason: str | None, role: bool
) -> dict[str, Any]:
    """The one choice of a stream chunk: a chat ``delta`` (the role first) or ``text``."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        choice["delta"] = {"role": "assistant", "content": ""} if role else (
            {} if delta is None else {"content": delta})  # fmt: skip
    else:
        choice["text"] = delta or ""
    return choice


def _unshown(text: str, shown: str) -> str:
    """What the final ``text`` adds to the deltas already streamed (``shown``)."""
    return text[len(shown) :] if text.startswith(shown) else ""


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
