"""zfec Reed-Solomon: the portable backend (pure C extension, no SIMD, any k+m <= 256).

zfec returns new ``bytes`` for every parity or recovered payload, so this backend copies them
into the codec's buffers; at zfec's speed (about 1.2-1.5 GB/s per core) the copy is noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import zfec

Buffer = bytes | bytearray | memoryview


class ZfecBackend:
    """Parity and reconstruction with zfec; outputs are copied into the caller's buffers."""

    name = "zfec"

    def __init__(self, k: int, m: int) -> None:
        self.k, self.m = k, m
        self._encoder = zfec.Encoder(k, k + m)  # zfec's "m" is the total number of shards
        self._decoder = zfec.Decoder(k, k + m)
        self._parity_ids = tuple(range(k, k + m))

    def encode_parity(self, data: Sequence[Buffer], parity: Sequence[memoryview]) -> None:
        """Write the m parity payloads of the k equal-length ``data`` payloads into ``parity``."""
        for dest, payload in zip(
            parity, self._encoder.encode(tuple(data), self._parity_ids), strict=True
        ):
            dest[:] = payload

    def reconstruct(
        self, sources: Mapping[int, Buffer], wanted_ids: Sequence[int], out: Sequence[memoryview]
    ) -> None:
        """Write data payloads ``wanted_ids`` into ``out`` from exactly k ``sources``."""
        source_ids = tuple(sources)
        data = self._decoder.decode(tuple(sources[i] for i in source_ids), source_ids)
        for dest, index in zip(out, wanted_ids, strict=True):
            dest[:] = data[index]
