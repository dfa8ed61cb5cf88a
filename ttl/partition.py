"""Simulation past one machine: the block space split into independent partitions.

A cluster divides its capacity by placement: every block key belongs to one placement group,
and each group evicts within its own disks. Splitting a trace's blocks the same way (the
caller injects the store's placement as ``partition_of``) and giving each partition its share
of the capacity simulates the cluster itself, not an approximation of one cache. Every
partition keeps every request (its time, class and tokens) and only its own blocks, with their
positions in the request; ``ttl.simulator.SimCounts`` says why the partitions' counts combine
exactly.

Pipeline (each step a plain function, so any executor can run it: in this process, or as Ray
tasks in ``kvstore/cli/sim_partitions.py``)::

    trace --trace_units--> units --split_unit (one task per unit)--> per unit: requests and
      one BlockPiece per partition --assemble_partition (one task per partition)--> partition
      Traces --simulate_partition (one task per partition and grid point)--> SimCounts
      --combine--> ttl.simulator.sim_result per grid point

No step holds the whole trace: a split task holds one unit, a partition task its own blocks
and the requests' metadata (tens of bytes per request against 12 per block access).

Block identity: Mooncake ids already name a block with its prefix; per-block ids (Bailian,
sessions) are chained here by hashing (``chain_identities``: a 64-bit hash of the previous
identity and the id; sessions start from the file's index, as their ids are local to a
file), so a split task needs no other unit to name its blocks. Two blocks are the same when
their identities are, as in ``ttl.traces``' dense chaining (up to 64-bit hash collisions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from ttl.simulator import SimConfig, SimCounts, simulate_counts
from ttl.traces import LoadOptions, RawRequests, Trace, TraceUnit, parse_unit

PartitionFn = Callable[[np.ndarray, int], np.ndarray]  # identities (uint64), P -> partition ids
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class RequestPiece:
    """One unit's requests in file order: what every partition and the merge need."""

    time_s: np.ndarray  # float64
    class_labels: tuple[str, ...]
    class_codes: np.ndarray  # int32, into class_labels
    input_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64
    hashed_tokens: np.ndarray  # int64
    num_blocks: np.ndarray  # int64: cacheable blocks of each whole request
    block_tokens: int
    num_skipped: int


@dataclass(frozen=True)
class BlockPiece:
    """One unit's block accesses that fall in one partition, in request then position order:
    ``lengths[r]`` of them for the unit's request ``r`` (12 bytes per access travel)."""

    lengths: np.ndarray  # int32 [unit requests]
    positions: np.ndarray  # int32: position in the whole request
    identities: np.ndarray  # uint64


def split_unit(
    unit: TraceUnit,
    fmt: str,
    options: LoadOptions,
    num_partitions: int,
    partition_of: PartitionFn,
) -> tuple[Any, ...]:
    """Parse ``unit`` and split its block accesses: ``(RequestPiece, BlockPiece x P)``."""
    raw = parse_unit(unit, fmt, options)
    offsets = np.concatenate([[0], np.cumsum(raw.lengths)])
    identities = block_identities(raw, offsets)
    requests = np.repeat(np.arange(len(raw.lengths), dtype=np.int64), raw.lengths)
    positions = (np.arange(len(raw.ids)) - offsets[:-1][requests]).astype(np.int32)
    # Requests share prefixes, so most accesses repeat a block: place each block once.
    distinct, inverse = np.unique(identities, return_inverse=True)
    where = partition_of(distinct, num_partitions)[inverse] if len(distinct) else requests
    # One stable radix sort by partition (accesses keep their order inside each), then slices:
    # O(accesses) whatever the number of partitions.
    order = np.argsort(where.astype(np.uint16), kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(where, minlength=num_partitions))])
    pieces = []
    for p in range(num_partitions):
        mine = order[bounds[p] : bounds[p + 1]]
        lengths = np.bincount(requests[mine], minlength=len(raw.lengths)).astype(np.int32)
        pieces.append(BlockPiece(lengths, positions[mine], identities[mine]))
    return (_request_piece(raw), *pieces)


def _request_piece(raw: RawRequests) -> RequestPiece:
    return RequestPiece(
        raw.time_s,
        raw.class_labels,
        raw.class_codes,
        raw.input_tokens,
        raw.output_tokens,
        raw.hashed_tokens,
        raw.lengths,
        raw.block_tokens,
        raw.num_skipped,
    )


def block_identities(raw: RawRequests, offsets: np.ndarray) -> np.ndarray:
    """uint64 identity of every block access (module docstring)."""
    if raw.chain_roots is None:
        return raw.ids.astype(np.uint64)
    return chain_identities(offsets, raw.ids, raw.chain_roots)


def chain_identities(offsets: np.ndarray, ids: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """``identity_j = mix64(identity_{j-1}, id_j)`` along each request, from its root.

    Position by position across all requests at once, as ``ttl.traces.chain_block_ids``."""
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")  # longest first: active requests are a prefix
    neg_sorted_lengths = -lengths[order]
    prev = mix64(roots[order].astype(np.uint64), np.zeros(len(order), np.uint64))
    out = np.empty(len(ids), np.uint64)
    for position in range(int(lengths.max(initial=0))):
        num_active = int(np.searchsorted(neg_sorted_lengths, -position, side="left"))
        where = offsets[order[:num_active]] + position
        out[where] = prev[:num_active] = mix64(prev[:num_active], ids[where].astype(np.uint64))
    return out


def mix64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A 64-bit hash of the pair ``(a, b)``: splitmix64's finaliser over ``a`` and ``b``."""
    return _splitmix64(a * _GOLDEN ^ _splitmix64(b))


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def assemble_partition(
    request_pieces: Sequence[RequestPiece],
    block_pieces: Sequence[BlockPiece],
    time_scale: float = 1.0,
) -> Trace:
    """One partition's ``Trace``: every request in time order (stable, as ``load_trace``), its
    own blocks with their positions. No block pieces: the requests alone (for the merge)."""
    requests = _concat_requests(request_pieces)
    order = np.argsort(requests["time_s"], kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    starts = np.cumsum([0, *(len(piece.time_s) for piece in request_pieces)])
    if block_pieces:
        request_of = np.concatenate(
            [
                np.repeat(np.arange(start, start + len(piece.lengths)), piece.lengths)
                for piece, start in zip(block_pieces, starts, strict=False)
            ]
        )
        positions = np.concatenate([piece.positions for piece in block_pieces])
        identities = np.concatenate([piece.identities for piece in block_pieces])
    else:
        request_of, positions = np.empty(0, np.int64), np.empty(0, np.int32)
        identities = np.empty(0, np.uint64)
    new_request = rank[request_of]
    by_request = np.argsort(new_request, kind="stable")  # keeps position order per request
    counts = np.bincount(new_request, minlength=len(order))
    distinct, dense = np.unique(identities[by_request], return_inverse=True)
    trace = Trace(
        time_s=requests["time_s"][order],
        class_ids=requests["class_ids"][order],
        input_tokens=requests["input_tokens"][order],
        output_tokens=requests["output_tokens"][order],
        hashed_tokens=requests["hashed_tokens"][order],
        block_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        block_ids=dense.astype(np.int32),
        class_names=requests["class_names"],
        block_tokens=request_pieces[0].block_tokens if request_pieces else 1,
        num_blocks=len(distinct),
        num_skipped=sum(piece.num_skipped for piece in request_pieces),
        block_positions=positions[by_request],
        whole_request_blocks=requests["num_blocks"][order],
    )
    return trace.with_time_scale(time_scale) if time_scale != 1.0 else trace


def _concat_requests(pieces: Sequence[RequestPiece]) -> dict[str, Any]:
    """The pieces' requests end to end, with class codes mapped to the sorted class names."""
    block_sizes = {piece.block_tokens for piece in pieces}
    if len(block_sizes) > 1:
        raise ValueError(f"trace units disagree on the block size: {sorted(block_sizes)}")
    names = tuple(sorted({label for piece in pieces for label in piece.class_labels}))
    class_ids = [
        np.array([names.index(label) for label in piece.class_labels], np.int32)[piece.class_codes]
        for piece in pieces
    ]

    def cat(name: str, dtype: Any) -> np.ndarray:
        parts = [getattr(piece, name) for piece in pieces]
        return np.concatenate(parts).astype(dtype) if parts else np.empty(0, dtype)

    return {
        "time_s": cat("time_s", np.float64),
        "class_ids": np.concatenate(class_ids) if class_ids else np.empty(0, np.int32),
        "input_tokens": cat("input_tokens", np.int64),
        "output_tokens": cat("output_tokens", np.int64),
        "hashed_tokens": cat("hashed_tokens", np.int64),
        "num_blocks": cat("num_blocks", np.int64),
        "class_names": names,
    }


def partition_capacity(
    capacity_blocks: int | None, num_partitions: int, partition: int
) -> int | None:
    """Partition ``partition``'s share of ``capacity_blocks``: ``C // P``, and one more block for
    the first ``C % P`` partitions, so the shares add up to ``C``."""
    if capacity_blocks is None:
        return None
    share, extra = divmod(capacity_blocks, num_partitions)
    return share + (partition < extra)


def simulate_partition(
    trace: Trace, config: SimConfig, num_partitions: int, partition: int
) -> SimCounts:
    """Simulate one partition with its share of ``config``'s capacity."""
    capacity = partition_capacity(config.capacity_blocks, num_partitions, partition)
    return simulate_counts(trace, replace(config, capacity_blocks=capacity))


class Executor(Protocol):
    """Runs plain functions as tasks; a handle from ``submit`` may be an argument of a later
    ``submit`` (it arrives as its value), and ``get`` turns handles into values."""

    def submit(self, fn: Callable[..., Any], *args: Any, num_returns: int = 1) -> Any: ...

    def get(self, handles: Sequence[Any]) -> list[Any]: ...


class InlineExecutor:
    """Runs each task at once in this process (tests, and runs without a cluster)."""

    def submit(self, fn: Callable[..., Any], *args: Any, num_returns: int = 1) -> Any:
        result = fn(*args)
        return list(result) if num_returns > 1 else result

    def get(self, handles: Sequence[Any]) -> list[Any]:
        return list(handles)


@dataclass(frozen=True)
class PartitionedTrace:
    """A trace split over partitions: handles to each partition's ``Trace``, the requests alone
    (for merging), and the sizes a grid needs before it runs."""

    partitions: list[Any]
    requests: Trace
    num_accesses: int
    num_blocks: int


MAX_PARTITIONS = 2**16  # partition ids sort as uint16


def split_trace(
    units: Sequence[TraceUnit],
    fmt: str,
    options: LoadOptions,
    num_partitions: int,
    partition_of: PartitionFn,
    executor: Executor,
    time_scale: float = 1.0,
) -> PartitionedTrace:
    """Split and assemble (module docstring) on ``executor``."""
    if not 1 <= num_partitions <= MAX_PARTITIONS:
        raise ValueError(f"partitions must be in [1, {MAX_PARTITIONS}], got {num_partitions}")
    width = num_partitions + 1
    splits = [
        executor.submit(
            split_unit, u, fmt, options, num_partitions, partition_of, num_returns=width
        )
        for u in units
    ]
    request_handles = [split[0] for split in splits]
    partitions, sizes = [], []
    for p in range(num_partitions):
        handle = executor.submit(
            _assemble_and_size, request_handles, [split[p + 1] for split in splits], time_scale,
            num_returns=2,
        )  # fmt: skip
        partitions.append(handle[0])
        sizes.append(handle[1])
    requests = assemble_partition(executor.get(request_handles), [], time_scale)
    measured = executor.get(sizes)
    return PartitionedTrace(
        partitions,
        requests,
        num_accesses=sum(num_accesses for num_accesses, _ in measured),
        num_blocks=sum(num_blocks for _, num_blocks in measured),
    )


def _assemble_and_size(
    request_pieces: Sequence[RequestPiece], block_pieces: Sequence[BlockPiece], time_scale: float
) -> tuple[Trace, tuple[int, int]]:
    trace = assemble_partition(request_pieces, block_pieces, time_scale)
    return trace, (trace.num_accesses, trace.num_blocks)


def simulate_partitioned(
    split: PartitionedTrace,
    configs: Sequence[SimConfig],
    executor: Executor,
    on_done: Callable[[int], None] | None = None,
) -> list[SimCounts]:
    """Every grid point on every partition as its own task; the combined counts per point.
    ``on_done`` sees the number of finished partition tasks."""
    num_partitions = len(split.partitions)
    handles = [
        [
            executor.submit(simulate_partition, trace, config, num_partitions, p)
            for p, trace in enumerate(split.partitions)
        ]
        for config in configs
    ]
    combined, num_done = [], 0
    for point_handles in handles:
        total = None
        for handle in point_handles:  # one at a time: the driver holds two counts at most
            (counts,) = executor.get([handle])
            total = counts if total is None else total.combine(counts)
            num_done += 1
            if on_done is not None:
                on_done(num_done)
        combined.append(total)
    return combined
