"""zfec Reed-Solomon: the portable backend (pure C extension, no SIMD, any k+m <= 256).

zfec returns new ``bytes`` for every parity or recovered payload, so this backend copies them
into the codec's buffers; at zfec's speed (docs/design-measurements.md) the copy is noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import zfec


class ZfecBackend:
    """Parity and reconstruction with zfec; outputs are copied into the caller's buffers."""

    def __init__(self, k: int, m: int) -> None:
        self.k, self.m = k, m
        self._encoder = zfec.Encoder(k, k + m)  # zfec's "m" is the total number of shards
        self._decoder = zfec.Decoder(k, k + m)
        self._parity_ids = tuple(range(k, k + m))

    def encode_parity(
        self, data: Sequence[memoryview], parity: memoryview, payload_len: int
    ) -> None:
        """Write the m parity payloads after each other into ``parity``.

        The k data payloads are the consecutive ``payload_len``-byte rows of the ``data``
        regions, in order.
        """
        rows = tuple(
            region[start : start + payload_len]
            for region in data
            for start in range(0, region.nbytes, payload_len)
        )
        for index, payload in enumerate(self._encoder.encode(rows, self._parity_ids)):
            parity[index * payload_len : (index + 1) * payload_len] = payload

    def reconstruct(
        self,
        sources: Mapping[int, memoryview],
        wanted_ids: Sequence[int],
        out: Sequence[memoryview],
    ) -> None:
        """Write data payloads ``wanted_ids`` into ``out`` from exactly k ``sources``."""
        source_ids = tuple(sources)
        data = self._decoder.decode(tuple(sources[i] for i in source_ids), source_ids)
        for dest, index in zip(out, wanted_ids, strict=True):
            dest[:] = data[index]
