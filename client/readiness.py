"""Which parts of each block of a batch read are in place: shards in, blocks and layers out.

``KVClient.land_batch(..., on_landed=...)`` reports, as each node's answer comes in, the data
shards now at their place in their blocks (client/batch_read.py). An engine wants blocks or
layers instead: :class:`Readiness` turns one into the other. Pure code, no I/O::

    block of L bytes, k data shards of P = ceil(L / k) bytes     shard i = bytes [i*P, (i+1)*P)
    segments of S bytes each (a layer-major KV block: S = one layer's K and V)
    segment s of a block is in place once every shard covering [s*S, (s+1)*S) is
    the block is in place once every data shard holding block bytes is

With the 10+2 code and a layer-major layout, data shard i holds a fixed range of layers, so a
node's answer completes that range of layers for the blocks it carried. (Nodes answer in
parallel, so in a healthy read every range completes at about the same time; a slow node
holds back only its own range.)

Readiness is not verification: the block checksum is checked once the block is complete, and
``Landing.rewritten`` names the blocks whose bytes changed after they were reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Readiness:
    """Arrivals of the data shards of ``num_blocks`` blocks of ``block_bytes`` each."""

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        k: int,
        segment_bytes: int | None = None,
        on_blocks: Callable[[list[int]], None] | None = None,
    ) -> None:
        if num_blocks < 0 or block_bytes <= 0 or k <= 0:
            raise ValueError(
                f"need num_blocks >= 0, block_bytes > 0 and k > 0, got {num_blocks}, "
                f"{block_bytes}, {k}"
            )
        self.payload_bytes = -(-block_bytes // k)
        # Data shards that hold block bytes (the rest are all padding for tiny blocks).
        self.num_data_shards = min(k, -(-block_bytes // self.payload_bytes))
        self.segment_bytes = segment_bytes or block_bytes
        self.num_segments = -(-block_bytes // self.segment_bytes)
        self._block_bytes = block_bytes
        self._landed = [0] * num_blocks  # per block: bitmask of data shards in place
        self._complete_mask = (1 << self.num_data_shards) - 1
        self._on_blocks = on_blocks
        # Per segment: the mask of shards covering it, and how many blocks have it.
        self._segment_masks = [self._shards_covering(s) for s in range(self.num_segments)]
        self.num_blocks_with_segment = [0] * self.num_segments
        # Per data shard: the (segment, mask) pairs it covers, the only ones its arrival can
        # complete (a shard covers a few of a model's 16-60 layers: called per shard).
        self._shard_segments = [
            [(s, mask) for s, mask in enumerate(self._segment_masks) if mask >> index & 1]
            for index in range(self.num_data_shards)
        ]

    def _shards_covering(self, segment: int) -> int:
        start = segment * self.segment_bytes
        end = min(start + self.segment_bytes, self._block_bytes)
        first, last = start // self.payload_bytes, (end - 1) // self.payload_bytes
        return ((1 << (last + 1)) - 1) ^ ((1 << first) - 1)

    def landed(self, pairs: Sequence[tuple[int, int]], base: int = 0) -> list[int]:
        """Data shards (``base`` + block, shard index) are in place; the blocks this
        completed, in the order given (``on_blocks`` called once with them: one node's answer
        completes many blocks at once, which an engine copies to the GPU as runs, not one by
        one). A plain loop: a few hundred nanoseconds a shard, less than numpy's calls cost
        for one answer's pairs."""
        completed: list[int] = []
        landed, with_segment, complete_mask = (
            self._landed,
            self.num_blocks_with_segment,
            self._complete_mask,
        )
        for block, shard_index in pairs:
            if shard_index >= self.num_data_shards:
                continue
            block += base
            before = landed[block]
            after = before | 1 << shard_index
            if after == before:
                continue
            landed[block] = after
            for segment, mask in self._shard_segments[shard_index]:
                if after & mask == mask:  # it was not complete before: the shard was missing
                    with_segment[segment] += 1
            if after == complete_mask:
                completed.append(block)
        if completed and self._on_blocks is not None:
            self._on_blocks(completed)
        return completed

    def any_landed(self, block: int) -> bool:
        """Whether some data shard of ``block`` is in place."""
        return self._landed[block] != 0

    def block_complete(self, block: int) -> bool:
        return self._landed[block] == self._complete_mask

    def segment_everywhere(self, segment: int) -> bool:
        """Whether ``segment`` (a layer) is in place in every block of the read."""
        return self.num_blocks_with_segment[segment] == len(self._landed)
