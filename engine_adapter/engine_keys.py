"""The key namespace of an external engine's KV pages: everything that decides what the bytes
of one stored page mean, so that a key can only ever hit bytes of the same format.

An engine's own block keys hash tokens only (SGLang's page hashes once omitted even the KV
dtype and reused wrong-format bytes: sglang #33268). Each adapter therefore names, from its
engine's config, the engine, model, KV dtype, byte layout with its shape, page size in
tokens, and the tensor/pipeline-parallel rank whose heads or layers the page holds; the
store key of an engine key is ``client.keys.namespaced_keys(keys, namespace.text, tenant,
part)``. The text looks like::

    kvstore-vllm;model=meta-llama/Llama-3.2-1B;dtype=bfloat16;
        layout=vllm-BHNC-v1:16x8x16x128;page_tokens=16;tp=0/2;pp=0/1

Pure code: no torch, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from client.keys import namespaced_keys


@dataclass(frozen=True)
class EngineKeyNamespace:
    """What one stored page is; ``text`` is hashed into every key (see the module doc)."""

    engine: str  # "vllm", "sglang", "lmcache"
    model: str
    dtype: str  # the KV cache dtype, e.g. "bfloat16", "fp8_e4m3"
    layout: str  # the stored bytes' layout with its shape, e.g. "vllm-BHNC-v1:16x8x16x128"
    page_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    extra: tuple[tuple[str, str], ...] = ()  # engine-specific facts, e.g. (("mla", "1"),)

    def __post_init__(self) -> None:
        for name in ("engine", "model", "dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or ";" in value:
                raise ValueError(f"namespace {name} must be a non-empty string without ';'")
        if self.page_tokens <= 0:
            raise ValueError(f"page_tokens must be > 0, got {self.page_tokens}")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(
                f"ranks out of range: tp {self.tp_rank}/{self.tp_size}, "
                f"pp {self.pp_rank}/{self.pp_size}"
            )

    @property
    def text(self) -> str:
        fields = [
            f"kvstore-{self.engine}",
            f"model={self.model}",
            f"dtype={self.dtype}",
            f"layout={self.layout}",
            f"page_tokens={self.page_tokens}",
            f"tp={self.tp_rank}/{self.tp_size}",
            f"pp={self.pp_rank}/{self.pp_size}",
            *(f"{k}={v}" for k, v in self.extra),
        ]
        return ";".join(fields)

    def keys(
        self, engine_keys: Sequence[str | bytes], salt: str | bytes, part: str | bytes = b""
    ) -> list[bytes]:
        """The store keys of ``engine_keys`` (salt: the tenant, and any per-request salt)."""
        return namespaced_keys(engine_keys, self.text, salt, part)
