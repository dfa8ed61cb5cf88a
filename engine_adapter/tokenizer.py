"""Tokenizer and chat template, with control-token safety.

The tokenizer is GPT-2 style byte-level BPE, built with the ``tokenizers`` library from GGUF
metadata (``tokenizer.ggml.tokens``/``merges``/``token_type``) or loaded from a model
directory's ``tokenizer.json``. The chat template is the model's own Jinja template
(``tokenizer.chat_template``), rendered in a sandbox.

Control-token safety: text from users or tools is untrusted and must never become a control
token such as ``<|im_start|>``. ``encode`` never matches special tokens in text (they encode
as the ordinary characters they are made of). ``apply_chat_template`` renders the template
with each message's content replaced by a placeholder, tokenizes the template's own text
with special tokens allowed, and encodes each content as untrusted text between them. So
only the template inserts special token ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvstore.errors import InvalidArgument

GGUF_TOKEN_CONTROL = 3  # llama.cpp token types: 1 normal, 3 control, 4 user-defined
GGUF_TOKEN_USER_DEFINED = 4
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")  # private-use characters
_ROLE_RE = re.compile(r"^[a-z][a-z_]{0,31}$")

Message = Mapping[str, str]


def bpe_from_gguf(fields: Mapping[str, Any]) -> Tokenizer:
    """Byte-level BPE ``Tokenizer`` from GGUF tokenizer metadata (``tokenizer.ggml.*``)."""
    if fields.get("tokenizer.ggml.model") != "gpt2":
        raise InvalidArgument(
            f"GGUF tokenizer model {fields.get('tokenizer.ggml.model')!r} is not supported; "
            "the engine reads GPT-2 style byte-level BPE ('gpt2')"
        )
    tokens = list(fields["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    types = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    added = [
        AddedToken(token, special=kind == GGUF_TOKEN_CONTROL, normalized=False)
        for token, kind in zip(tokens, types, strict=True)
        if kind in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)
    ]
    tokenizer.add_tokens(added)
    return tokenizer


class ChatTokenizer:
    """Encode untrusted text, decode ids, and apply the model's chat template safely."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
    ) -> None:
        self._trusted = Tokenizer.from_str(tokenizer.to_str())  # template text only
        self._untrusted = Tokenizer.from_str(tokenizer.to_str())
        self._untrusted.encode_special_tokens = True  # "<|im_start|>" in text stays text
        self.chat_template = chat_template
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self._template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> ChatTokenizer:
        return cls(
            bpe_from_gguf(fields),
            fields.get("tokenizer.chat_template"),
            fields.get("tokenizer.ggml.bos_token_id"),
            fields.get("tokenizer.ggml.eos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTokenizer:
        """From ``tokenizer.json`` (+ ``tokenizer_config.json`` for the chat template)."""
        path = Path(path)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        bos, eos = (_token_id(tokenizer, config.get(k)) for k in ("bos_token", "eos_token"))
        return cls(tokenizer, config.get("chat_template"), bos, eos)

    @property
    def vocab_size(self) -> int:
        return self._trusted.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of untrusted ``text``; never produces a special (control) token."""
        return self._untrusted.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._trusted.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._trusted.token_to_id(token)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        """Prompt ids for a conversation; only the template inserts special tokens."""
        if self._template is None:
            raise InvalidArgument("this model has no chat template; pass token ids or text")
        contents = [_check_message(m) for m in messages]
        rendered = self._template.render(
            messages=[
                {"role": m["role"], "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)
            ],
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
        )
        ids: list[int] = []
        for i, piece in enumerate(_PLACEHOLDER_RE.split(rendered)):
            if i % 2:  # odd pieces are the captured message indexes
                ids += self.encode(contents[int(piece)])
            elif piece:
                ids += self._trusted.encode(piece, add_special_tokens=False).ids
        return ids

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._trusted.id_to_token(token_id) or ""


def _check_message(message: Message) -> str:
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not _ROLE_RE.match(role):
        raise InvalidArgument(
            f"chat message role {role!r}: expected a lowercase name such as 'user', "
            "'assistant', 'system' or 'tool'"
        )
    if not isinstance(content, str):
        raise InvalidArgument(f"chat message content must be a str, got {type(content)}")
    return content


def _compile_template(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidArgument(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _token_id(tokenizer: Tokenizer, token: Any) -> int | None:
    if isinstance(token, dict):  # tokenizer_config.json may hold AddedToken dicts
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) else None
