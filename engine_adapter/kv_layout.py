"""The KV block layout: how one block's KV for all layers becomes one store block.

One store block holds ``block_tokens`` tokens of K and V of every layer, raw values of
``dtype`` in native (little-endian) byte order, C order, no header::

    block = [layer 0 | layer 1 | ... | layer L-1]            L = num_layers
    layer = [K | V]                                          each [num_kv_heads, T, head_dim]
    K     = [head 0: T x head_dim | head 1 | ... ]           T = block_tokens

    shape (num_layers, 2, num_kv_heads, block_tokens, head_dim)
    bytes = num_layers * 2 * num_kv_heads * block_tokens * head_dim * sizeof(dtype)

Layer-major, so the first layers of a block can be placed on the device (and used) while
later layers are still being copied. K is stored after RoPE, as attention consumes it.
The store's checksums guard the bytes; the *meaning* of the bytes is guarded by the
namespace given to ``block_keys``: it names the model fingerprint, this layout's version and
shape, the dtype and the block size, so a different model, layout, dtype or block size can
never hit another's blocks. Pure code, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_adapter.config import BYTES_PER_DTYPE, ModelConfig

LAYOUT_VERSION = "kv-layer-major-v1"


@dataclass(frozen=True)
class KVBlockLayout:
    """Shape, dtype and size of one serialised KV block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in BYTES_PER_DTYPE:
            raise ValueError(f"KV dtype {self.dtype!r}: choose one of {sorted(BYTES_PER_DTYPE)}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_tokens) <= 0:
            raise ValueError(f"every KV layout dimension must be > 0, got {self}")

    @classmethod
    def for_model(cls, model: ModelConfig, block_tokens: int, dtype: str) -> KVBlockLayout:
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, block_tokens, dtype)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, num_kv_heads, block_tokens, head_dim)``."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def num_elements(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.block_tokens * self.head_dim

    @property
    def block_bytes(self) -> int:
        return self.num_elements * BYTES_PER_DTYPE[self.dtype]

    @property
    def layer_bytes(self) -> int:
        return self.block_bytes // self.num_layers

    def namespace(self, model_fingerprint: str) -> str:
        """The ``block_keys`` namespace: model, layout version and shape, dtype, block size."""
        shape = "x".join(str(n) for n in self.shape)
        return (
            f"kvstore-engine;model={model_fingerprint};layout={LAYOUT_VERSION}:{shape};"
            f"dtype={self.dtype};block_tokens={self.block_tokens}"
        )
