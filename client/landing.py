"""Where a node's batch answer lands: each payload at its place in the caller's block, or apart.

A node answers a batch read with a table of shard entries and their payloads back to back
(kvstore/wire/batch_answer.py). The client reads the table first and decides, per HIT entry,
where its payload goes (:func:`landing_regions`)::

    entry: key j, shard index i, payload_len P, block_len L, version V
      out_j given, i < k, (i+1)*P <= L = len(out_j),        -> out_j[i*P : (i+1)*P]
      i is the index this node holds for key j, first such entry of key j in this answer
      anything else (parity, the zero-padded last data shard, -> None: it lands apart (scratch
      another version of the same length, plain get)            or the received chunk)

The zero-padded last data shard of key j lands apart, and the local and stream links then copy
its real bytes to the block's tail (:func:`fill_tails`), gRPC's :class:`StreamLander` too, so
the block is whole in place.

Over UCX each payload is received into its region (one group receive per node); over
gRPC :class:`StreamLander` copies each chunk's bytes into them as chunks arrive (and a padded
last data shard's real bytes to its block's tail once it is whole). With every
data shard present the block is then complete without a copy by the decoder
(erasure/codec.py skips payloads already in place).
The decision is made from the header before any byte lands, so a payload is never written
into a block it does not belong to; the shard checksum is still verified once it landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from erasure import fastsum
from erasure.isal_backend import buffer_address
from kvstore.byte_arena import ByteArena, Region
from kvstore.wire import batch_answer


@dataclass(frozen=True)
class Wanted:
    """What one request asks a node for: request key i is batch key ``positions[i]``, of
    which this node holds shard ``shard_indexes[i]``; ``pool_offsets[i]``: where that key's
    buffer starts in the client's landing pool (None: not in the pool; the whole list None
    when the client has no pool), located once per batch; ``payload_bytes``: the payloads'
    bytes the request can bring, as the batch read sized it (None: not given)."""

    positions: list[int]
    shard_indexes: list[int]
    pool_offsets: list[int | None] | None = None
    payload_bytes: int | None = None


def landing_regions(
    entries: np.ndarray,
    wanted: Wanted,
    outs: Sequence[memoryview | None],
    k: int,
    *,
    tails: list[tuple[int, memoryview]] | None = None,
) -> list[memoryview | None]:
    """Per HIT entry (in table order), its place in the caller's block or None (apart).

    ``tails``, when given, collects ``(row, the block's tail)`` for each key's zero-padded
    last data shard (a block whose length is not a multiple of k): it lands apart, since
    its padding would run past the block, and :func:`fill_tails` copies its real bytes to
    the tail once its checksum held."""
    regions: list[memoryview | None] = []
    placed: set[int] = set()
    hits = entries[entries["status"] == batch_answer.HIT]
    for row, (key_index, shard_index, payload_len, block_len) in enumerate(
        zip(
            hits["key_index"].tolist(),
            hits["shard_index"].tolist(),
            hits["payload_len"].tolist(),
            hits["block_len"].tolist(),
            strict=True,
        )
    ):
        out = outs[wanted.positions[key_index]]
        start = shard_index * payload_len
        ours = (
            out is not None
            and key_index not in placed
            and shard_index == wanted.shard_indexes[key_index]
            and shard_index < k
            and block_len == len(out)
            and payload_len == -(-block_len // k)
        )
        region = None
        if ours and start + payload_len <= block_len:
            assert out is not None
            placed.add(key_index)
            region = out[start : start + payload_len]
        elif ours and tails is not None and start < block_len:
            assert out is not None
            placed.add(key_index)
            tails.append((row, out[start:block_len]))
        regions.append(region)
    return regions


def fill_tails(
    tails: Sequence[tuple[int, memoryview]],
    payloads: Sequence[memoryview],
    in_place: list[bool],
) -> None:
    """Copy each padded last data shard's real bytes (``tails``, from :func:`landing_regions`),
    from where they landed apart, to its block's tail, and count it in place: the block
    is then whole, so its check starts while the read goes on (client/batch_decode.py), not
    in one pass after it. The payload itself stays where it is (a parity decode may need it
    whole). One native call for the lot (erasure.fastsum.copy_many): a receiver that took
    the GIL back after each copy waited for it behind the other receivers and the event loop."""
    rows = [(row, tail) for row, tail in tails if not in_place[row]]
    if not rows:  # no tails, or each in place already (a pool slot's slack took it)
        return
    sources = [buffer_address(payloads[row]) for row, _ in rows]
    targets = [buffer_address(tail) for _, tail in rows]
    fastsum.copy_many(sources, targets, [len(tail) for _, tail in rows])
    for row, _ in rows:
        in_place[row] = True


@dataclass
class NodeAnswer:
    """A node's answer as the batch read uses it: the table, each HIT payload's bytes (in
    table order, where they landed), and the scratch to release after decoding. No transport
    checks a payload's shard checksum: the block checksum is its one check unless the block
    fails it (client/batch_read.py)."""

    entries: np.ndarray
    payloads: Sequence[memoryview]
    in_place: list[bool]  # per HIT payload: it landed at its place in the caller's block
    scratch: list[Region] = field(default_factory=list)
    # CLOCK_MONOTONIC ns, for the read timeline (client/read_timeline.py), where known: the
    # node's read (start, end), and the client's landing of the answer (start, end).
    node_read_ns: tuple[int, int] | None = None
    landed_ns: tuple[int, int] | None = None

    def release(self) -> None:
        for region in self.scratch:
            region.release()
        self.scratch.clear()


def fill_apart(regions: list[memoryview | None], sizes: list[int], arena: ByteArena) -> Region:
    """Give every None region a place in one scratch region (for the UCX receives)."""
    scratch = arena.take(
        sum(size for region, size in zip(regions, sizes, strict=True) if region is None)
    )
    position = 0
    for i, (region, size) in enumerate(zip(regions, sizes, strict=True)):
        if region is None:
            regions[i] = scratch.view[position : position + size]
            position += size
    return scratch


class StreamLander:
    """Lands a batch answer that arrives as a byte stream in chunks (gRPC's ReadBatch).

    Feed each chunk's bytes in order; the table is taken as soon as it is complete, then each
    payload is copied into its region, or kept as a view of its chunk when it has none (a
    payload cut across chunks is joined into a buffer of its own).
    """

    def __init__(self, wanted: Wanted, outs: Sequence[memoryview | None], k: int) -> None:
        self._wanted, self._outs, self._k = wanted, outs, k
        self._head = bytearray()  # the table's bytes until it is complete
        self._entries: np.ndarray | None = None
        self._regions: list[memoryview | None] = []
        self._tails: dict[int, memoryview] = {}  # row -> its block's tail (landing_regions)
        self._sizes: list[int] = []
        self._payloads: list[memoryview] = []
        self._partial: list[memoryview] = []  # pieces of the payload being received
        self._filled = 0  # bytes of the current payload received

    def feed(self, data: memoryview) -> None:
        if self._entries is None:
            data = self._take_table(data)
            if self._entries is None:
                return
        while len(data):
            data = self._land(data)

    def _take_table(self, data: memoryview) -> memoryview:
        """Take the table's bytes from ``data``; return what follows it (payload bytes)."""
        before = len(self._head)
        self._head += data[: max(0, batch_answer.TABLE_HEAD.size - before)]
        if len(self._head) < batch_answer.TABLE_HEAD.size:
            return memoryview(b"")
        size = batch_answer.table_bytes(self._head)
        self._head += data[len(self._head) - before : size - before]
        if len(self._head) < size:
            return memoryview(b"")
        entries, _ = batch_answer.decode_table(bytes(self._head), len(self._wanted.positions))
        hits = entries["status"] == batch_answer.HIT
        self._entries = entries
        tails: list[tuple[int, memoryview]] = []
        self._regions = landing_regions(entries, self._wanted, self._outs, self._k, tails=tails)
        self._tails = dict(tails)
        self._sizes = entries["payload_bytes"][hits].tolist()
        return data[size - before :]

    def _land(self, data: memoryview) -> memoryview:
        index = len(self._payloads)
        if index >= len(self._sizes):
            raise ValueError(f"batch answer carries {len(data)} bytes beyond its payloads")
        size, region = self._sizes[index], self._regions[index]
        take = min(size - self._filled, len(data))
        piece, rest = data[:take], data[take:]
        if region is not None:
            region[self._filled : self._filled + take] = piece
        else:
            self._partial.append(piece)
        self._filled += take
        if self._filled == size:
            payload = region if region is not None else self._joined()
            tail = self._tails.get(index)
            if tail is not None:  # unchecked here, as every payload: the block check covers it
                tail[:] = payload[: len(tail)]
            self._payloads.append(payload)
            self._filled = 0
        return rest

    def _joined(self) -> memoryview:
        pieces, self._partial = self._partial, []
        if len(pieces) == 1:
            return pieces[0]
        return memoryview(b"".join(pieces))

    def finish(self) -> NodeAnswer:
        """The answer; ValueError if the stream ended early."""
        if self._entries is None or len(self._payloads) != len(self._sizes):
            raise ValueError("batch answer stream ended before its last payload")
        in_place = [r is not None or row in self._tails for row, r in enumerate(self._regions)]
        return NodeAnswer(self._entries, self._payloads, in_place)
