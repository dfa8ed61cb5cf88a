"""Bounded, typed request bodies: every field refuses out-of-range values and wrong types
with an error that names the field, and whatever passes fits the wire format."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from pydantic import ValidationError

from engine_adapter.serving.openai_api import _validation_message
from engine_adapter.serving.openai_protocol import (
    INT32_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engine_adapter.serving.request import Request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
HUGE = 2**70
# field -> values each endpoint must refuse (400), beside its wrong types
BAD_VALUES = {
    "max_tokens": [HUGE, 2**32, 0, -1, 1.5, "5", True, [1]],
    "seed": [HUGE, 2**64, -(2**63) - 1, 1.5, "7"],
    "top_k": [HUGE, -2, 2**31, "3"],
    "n": [2, 0, HUGE, "1"],
    "temperature": [-0.1, 2.5, "hot", float("nan"), float("inf")],
    "top_p": [0.0, 1.5, -1, "x"],
    "logprobs": [HUGE, -1, 21, "yes", [1]],
    "top_logprobs": [HUGE, -1, 21],
    "presence_penalty": [3.0, -3.0, "x"],
    "frequency_penalty": [3.0, -3.0],
    "stop": [["a"] * 5, "x" * 2000, [1], {"a": 1}],
    "cache_salt": ["s" * 1000, 5],
    "traffic_class": ["", "c" * 100, 3],
    "stream": ["maybe", 2, "yes", "true", 1, 0, "on"],  # OpenAI's booleans are strict
    "model": [5, "m" * 1000],
    "logit_bias": ["x", [1]],
}


def _refused(model: type, body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as error:
        model(**body)
    errors = error.value.errors()
    message, param = _validation_message(errors)
    assert param == field, f"{field}={body.get(field)!r}: the error names {param!r}"
    assert message.startswith(field), message


@pytest.mark.parametrize("field", sorted(BAD_VALUES))
@pytest.mark.parametrize("endpoint", [ChatCompletionRequest, CompletionRequest])
def test_every_bad_value_is_refused_naming_its_field(endpoint, field):
    base = CHAT if endpoint is ChatCompletionRequest else COMPLETION
    for value in BAD_VALUES[field]:
        _refused(endpoint, {**base, field: value}, field)


@pytest.mark.parametrize(
    "prompt",
    [[-1], [2**40], [HUGE], [1, "a"], [True], [], [[]], [[1], [2]], ["a", "b"], 5, None, {"a": 1}],
)
def test_bad_prompts_are_refused(prompt):
    _refused(CompletionRequest, {**COMPLETION, "prompt": prompt}, "prompt")


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"content": "no role"}], [{"role": "user", "content": 5}],
     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     [{"role": "user", "content": [{"type": "text", "text": 5}]}],
     [{"role": "r" * 1000, "content": "x"}], [{"role": "hacker", "content": "x"}],
     [{"role": "User", "content": "x"}], [{"role": 5, "content": "x"}]],
)  # fmt: skip
def test_bad_messages_are_refused(messages):
    _refused(ChatCompletionRequest, {**CHAT, "messages": messages}, "messages")


def test_good_values_pass_and_fit_the_wire():
    chat = ChatCompletionRequest(
        **CHAT,
        max_tokens=INT32_MAX,
        seed=-1,
        top_k=-1,
        stop="END",
        logprobs=False,
        messages_extra=1,  # unknown fields are ignored, as OpenAI's API does
    )
    assert chat.seed_u64() == 2**64 - 1, "a negative int64 seed wraps to the wire's uint64"
    assert chat.stop_strings() == ["END"] and chat.unserved_field() is None
    assert ChatCompletionRequest(**CHAT).stop_strings() == [], "no stop given: none"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = ChatCompletionRequest(**{**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert chat.messages[0].text() == "ab"
    for prompt, expected in (([1, 2], [1, 2]), ([[3]], [3]), (["text"], "text"), ("t", "t")):
        assert CompletionRequest(**{**COMPLETION, "prompt": prompt}).prompt == expected
    completion = CompletionRequest(**COMPLETION, seed=2**64 - 1, logprobs=3)
    assert completion.unserved_field() == "logprobs", "logprobs must be refused, not ignored"
    request = Request(token_ids=[INT32_MAX], max_new_tokens=INT32_MAX, seed=completion.seed_u64())
    request.to_proto().SerializeToString()  # every bound fits the protobuf fields


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant", "tool"])
def test_openai_roles_pass(role):
    ChatCompletionRequest(**{**CHAT, "messages": [{"role": role, "content": "x"}]})


@pytest.mark.parametrize(
    "model, body, field",
    [
        (ChatCompletionRequest, {**CHAT, "stream_options": {"include_usage": "yes"}},
         "stream_options"),
        (CompletionRequest, {**COMPLETION, "echo": "yes"}, "echo"),
        (TokenizeRequest, {"prompt": "x", "add_generation_prompt": 1}, "add_generation_prompt"),
        (TokenizeRequest, {"prompt": "x", "return_token_strs": "true"}, "return_token_strs"),
    ],
)  # fmt: skip
def test_every_boolean_is_strict(model, body, field):
    _refused(model, body, field)


def test_tokenizer_bodies():
    assert TokenizeRequest(prompt="hi").prompt == "hi"
    assert DetokenizeRequest(tokens=[1, 2]).tokens == [1, 2]
    for tokens in ([-1], [2**40], ["a"], [True]):
        _refused(DetokenizeRequest, {"tokens": tokens}, "tokens")
    _refused(TokenizeRequest, {"messages": []}, "messages")
