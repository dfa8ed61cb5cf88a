"""The KV block layout: how one block's KV for all layers becomes one store block.

One store block holds ``block_tokens`` tokens of every layer's KV cache, raw values of
``dtype`` in native (little-endian) byte order, C order, no header. Two kinds of cache:

Llama-style attention (``gqa``): K and V per KV head::

    block = [layer 0 | layer 1 | ... | layer L-1]            L = num_layers
    layer = [K | V]                                          each [num_kv_heads, T, head_dim]
    K     = [head 0: T x head_dim | head 1 | ... ]           T = block_tokens
    shape (num_layers, 2, num_kv_heads, block_tokens, head_dim)

DeepSeek's multi-head latent attention (``mla``): one latent vector per token and layer,
shared by every head (no head split)::

    block  = [layer 0 | layer 1 | ... | layer L-1]
    layer  = [token 0: latent | token 1: latent | ...]       each latent_dim values
    latent = [compressed KV (kv_lora_rank), after its RMSNorm | RoPE key (rope dim), after RoPE]
    shape (num_layers, 1, 1, block_tokens, latent_dim)

Both are ``(num_layers, num_parts, num_kv_heads, block_tokens, head_dim)`` with
``num_parts`` 2 (K, V) or 1 (the latent), so one paged cache, swap-in and write-back serve
both. Layer-major, so the first layers of a block can be placed on the device (and used)
while later layers are still being copied. K is stored after RoPE, as attention consumes it.
The store's checksums guard the bytes; the *meaning* of the bytes is guarded by the
namespace given to ``block_keys``: it names the model fingerprint, this layout's version and
shape, the dtype and the block size, so a different model, layout, dtype or block size can
never hit another's blocks. Pure code, no torch.

``kv_format`` says how the values are encoded: ``dtype`` (raw values of ``dtype``, above) or
``e4m3x16`` (FP8 values with one bf16 scale per 16, still layer-major: ``kv_format.py`` has
its diagram). The format is part of the namespace, so a block stored in one format is never
read as the other; an e4m3x16 block means the same to an fp32 engine as to a bf16 one, so
their namespaces agree (the compute dtype is left out of an e4m3x16 namespace).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapter.config import BYTES_PER_DTYPE, KV_FORMATS, ModelConfig

LAYOUT_VERSION = "kv-layer-major-v1"
E4M3X16_GROUP_VALUES = 16
# e4m3x16's name in the namespace, with its scale encoding: blocks of the first encoding
# (e8m0 scales, 1.0625 bytes per value) are never looked up by this one
E4M3X16_ENCODING = "e4m3x16:bf16-scales"
MLA_LAYOUT_VERSION = "mla-latent-layer-major-v1"


def e4m3x16_bytes(num_values: int) -> int:
    """Bytes of ``num_values`` values in e4m3x16: one byte a value, a bf16 scale per 16."""
    return num_values + num_values // E4M3X16_GROUP_VALUES * 2


@dataclass(frozen=True)
class KVBlockLayout:
    """Shape, dtype and size of one serialised KV block (see the module doc)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int  # per head; for MLA the latent's width
    block_tokens: int
    dtype: str
    latent: bool = False  # MLA: one latent per token and layer instead of per-head K and V
    kv_format: str = "dtype"  # how a stored block encodes the values (see the module doc)

    def __post_init__(self) -> None:
        if self.dtype not in BYTES_PER_DTYPE:
            raise ValueError(f"KV dtype {self.dtype!r}: choose one of {sorted(BYTES_PER_DTYPE)}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_tokens) <= 0:
            raise ValueError(f"every KV layout dimension must be > 0, got {self}")
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"an MLA latent has no heads: num_kv_heads must be 1, got {self}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"KV format {self.kv_format!r}: choose one of {KV_FORMATS}")
        if self.quantized and self.head_dim % E4M3X16_GROUP_VALUES:
            raise ValueError(
                f"e4m3x16 scales 16 values along the head dimension: head_dim={self.head_dim} "
                "is not a multiple of 16; use kv_format='dtype' for this model"
            )

    @classmethod
    def for_model(
        cls, model: ModelConfig, block_tokens: int, dtype: str, kv_format: str = "dtype"
    ) -> KVBlockLayout:
        if model.is_mla:
            return cls(model.num_layers, 1, model.latent_dim, block_tokens, dtype, True, kv_format)
        return cls(
            model.num_layers, model.num_kv_heads, model.head_dim, block_tokens, dtype,
            kv_format=kv_format,
        )  # fmt: skip

    @property
    def quantized(self) -> bool:
        """Stored as e4m3x16 (FP8 values and scales) rather than raw ``dtype`` values."""
        return self.kv_format == "e4m3x16"

    @property
    def stored_format(self) -> str:
        """What a stored block holds: the compute dtype's name, or ``e4m3x16``."""
        return self.kv_format if self.quantized else self.dtype

    @property
    def part_shape(self) -> tuple[int, int, int, int]:
        """One layer of one block: ``(num_parts, num_kv_heads, block_tokens, head_dim)``."""
        _, parts, heads, tokens, dim = self.shape
        return (parts, heads, tokens, dim)

    @property
    def num_parts(self) -> int:
        """Tensors cached per layer and token: 2 (K and V) or 1 (MLA's latent)."""
        return 1 if self.latent else 2

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, num_parts, num_kv_heads, block_tokens, head_dim)``."""
        return (
            self.num_layers,
            self.num_parts,
            self.num_kv_heads,
            self.block_tokens,
            self.head_dim,
        )

    @property
    def num_elements(self) -> int:
        layers, parts, heads, tokens, dim = self.shape
        return layers * parts * heads * tokens * dim

    @property
    def block_bytes(self) -> int:
        if self.quantized:
            return e4m3x16_bytes(self.num_elements)
        return self.num_elements * BYTES_PER_DTYPE[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Stored bytes of one token's KV, all layers (``kv_bytes_per_token`` in records)."""
        return self.block_bytes // self.block_tokens

    @property
    def layer_bytes(self) -> int:
        return self.block_bytes // self.num_layers

    def namespace(self, model_fingerprint: str) -> str:
        """The ``block_keys`` namespace: model, layout version and shape, stored format
        (the dtype, or e4m3x16 with its scale encoding), block size."""
        shape = "x".join(str(n) for n in self.shape)
        version = MLA_LAYOUT_VERSION if self.latent else LAYOUT_VERSION
        stored = E4M3X16_ENCODING if self.quantized else self.dtype
        return (
            f"kvstore-engine;model={model_fingerprint};layout={version}:{shape};"
            f"dtype={stored};block_tokens={self.block_tokens}"
        )
