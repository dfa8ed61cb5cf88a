"""``CodecConfig``: the ``[codec]`` section of ``cluster.toml``, validated. Pure."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class CodecConfig:
    k: int = 10
    m: int = 2
    backend: str = "isal"
    max_block_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        if self.k < 1 or self.m < 0 or self.k + self.m > 255:
            raise ValueError(
                f"invalid erasure code k={self.k}, m={self.m}: need k >= 1, "
                "m >= 0 and k + m <= 255 (the default is k=10, m=2)"
            )
        if self.backend not in ("isal", "zfec"):
            raise ValueError(f"codec backend {self.backend!r}: choose 'isal' or 'zfec'")
        if self.max_block_bytes <= 0:
            raise ValueError(f"max_block_bytes must be > 0, got {self.max_block_bytes}")

    @property
    def num_shards(self) -> int:
        return self.k + self.m
