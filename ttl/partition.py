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

    trace --trace_units--> units --split_unit (one task per unit)--> per unit: its requests in
      time order and one BlockPiece per partition --merge_requests (the driver)--> every
      request's place in the whole trace --simulate_pieces (one task per partition:
      assemble_partition, then simulate_partition per grid point)--> SimCounts
      --CountsTotal--> ttl.simulator.sim_result per grid point

No step holds the whole trace's blocks: a split task holds one unit, a partition task its own
blocks and the requests that have blocks in it; the driver holds every request's metadata
(tens of bytes per request against 8 per block access). Each step is one pass. A split, with
the store's placement (``StorePlacement``) and ``ttl/_simloop.so`` built, is one C pass over
the accesses (``simloop.split_unit``: identities, distinct blocks by an open-addressing hash
table, each distinct block placed once, a stable counting sort by partition); otherwise the
same steps in numpy (Arrow's dictionary encoding, the placement function, a radix sort of
16-bit keys). The driver merges the units' time-ordered requests (a stable sort of sorted runs
is a merge). A partition's task assembles it once for every grid point: one unit's block
numbers are the partition's already; several units' are mapped with one hash pass over their
distinct blocks, re-sorting nothing when the units come in time order. The grid's capacities
need the distinct blocks before any pass: one unit's are counted by its split, several units'
by a small task per partition (``count_blocks``).

Block identity: Mooncake ids already name a block with its prefix; per-block ids (Bailian,
sessions) are chained here by hashing (``chain_identities``: a 64-bit hash of the previous
identity and the id; sessions start from the file's index, as their ids are local to a
file), so a split task needs no other unit to name its blocks. The loaders number blocks by
the same identities (``ttl.traces.chain_identities``), so two blocks are the same here exactly
when they are in one process (and the same up to 64-bit hash collisions).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from ttl import simloop
from ttl.simulator import CountsTotal, SimConfig, SimCounts, simulate_counts
from ttl.traces import (
    LoadOptions,
    RawRequests,
    Trace,
    TraceUnit,
    chain_identities,
    dense_ids,
    parse_unit,
    reorder_segments,
)

PartitionFn = Callable[[np.ndarray, int], np.ndarray]  # identities (uint64), P -> partition ids


@dataclass(frozen=True)
class RequestPiece:
    """One unit's requests in time order (stable): what the driver merges."""

    time_s: np.ndarray  # float64
    class_labels: tuple[str, ...]
    class_codes: np.ndarray  # int32, into class_labels
    input_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64
    hashed_tokens: np.ndarray  # int64
    num_blocks: np.ndarray  # int64: cacheable blocks of each whole request
    block_tokens: int
    num_skipped: int
    num_distinct: int  # distinct blocks of the unit


@dataclass(frozen=True)
class BlockPiece:
    """One unit's block accesses that fall in one partition, in request then position order:
    ``lengths[i]`` of them for the unit's request ``rows[i]`` (8 bytes per access travel; each
    distinct block's identity once)."""

    rows: np.ndarray  # int32: the unit's requests (time order) with blocks here, increasing
    lengths: np.ndarray  # int32 [rows]
    positions: np.ndarray  # int32: position in the whole request
    local_ids: np.ndarray  # int32: index into distinct
    distinct: np.ndarray  # uint64: identities of this piece's distinct blocks


@dataclass(frozen=True)
class StorePlacement:
    """The store's placement as a ``PartitionFn``: rendezvous over each block identity's key,
    the groups weighing ``weights`` (None: equal). ``place(identities, P, weights)`` is the
    store's own hash (``kvstore.cli.sim_partitions``: ttl imports no kvstore); where
    ``ttl/_simloop.so`` is built, a split computes the same hash inside its one C pass
    (``simloop.split_unit``) instead of calling it, and tests check the two agree."""

    place: Callable[[np.ndarray, int, tuple[int, ...] | None], np.ndarray]
    weights: tuple[int, ...] | None = None

    def __call__(self, identities: np.ndarray, num_partitions: int) -> np.ndarray:
        return self.place(identities, num_partitions, self.weights)


def split_unit(
    unit: TraceUnit,
    fmt: str,
    options: LoadOptions,
    num_partitions: int,
    partition_of: PartitionFn,
) -> tuple[Any, ...]:
    """Parse ``unit`` and split its block accesses: ``(RequestPiece, BlockPiece x P)``."""
    raw = _in_time_order(parse_unit(unit, fmt, options))
    if simloop.NATIVE and isinstance(partition_of, StorePlacement):
        pieces = _native_pieces(raw, num_partitions, partition_of.weights)
        return (_request_piece(raw, sum(len(piece.distinct) for piece in pieces)), *pieces)
    offsets = np.concatenate([[0], np.cumsum(raw.lengths)])
    identities = block_identities(raw, offsets)
    # Requests share prefixes, so most accesses repeat a block: place each block once.
    block_of_access, distinct = dense_ids(identities)
    group = partition_of(distinct, num_partitions) if len(distinct) else np.empty(0, np.int64)
    local_of_distinct, distinct_by_group, group_bounds = _rank_within_groups(group, num_partitions)
    # One stable radix sort of the accesses by partition; each keeps request then position
    # order inside its partition, and the pieces are slices.
    where = group[block_of_access]
    order = np.argsort(where.astype(np.uint16), kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(where, minlength=num_partitions))])
    request_of = np.repeat(np.arange(len(raw.lengths), dtype=np.int32), raw.lengths)
    positions = (np.arange(len(identities)) - offsets[:-1][request_of]).astype(np.int32)[order]
    request_of = request_of[order]
    local_ids = local_of_distinct[block_of_access[order]]
    pieces = []
    for p in range(num_partitions):
        mine = slice(bounds[p], bounds[p + 1])
        rows, lengths = _runs(request_of[mine])
        mine_distinct = distinct[distinct_by_group[group_bounds[p] : group_bounds[p + 1]]]
        pieces.append(BlockPiece(rows, lengths, positions[mine], local_ids[mine], mine_distinct))
    return (_request_piece(raw, len(distinct)), *pieces)


def _native_pieces(
    raw: RawRequests, num_partitions: int, weights: tuple[int, ...] | None
) -> list[BlockPiece]:
    """The split's one C pass (identities, distinct blocks, placement, counting sort)."""
    split = simloop.split_unit(raw.lengths, raw.ids, raw.chain_roots, num_partitions, weights)

    def part(bounds: np.ndarray, array: np.ndarray, p: int) -> np.ndarray:
        return array[bounds[p] : bounds[p + 1]]

    runs, accesses, blocks = split.run_bounds, split.access_bounds, split.distinct_bounds
    return [
        BlockPiece(
            part(runs, split.run_rows, p),
            part(runs, split.run_lengths, p),
            part(accesses, split.positions, p),
            part(accesses, split.local_ids, p),
            part(blocks, split.distinct, p),
        )
        for p in range(num_partitions)
    ]


def _in_time_order(raw: RawRequests) -> RawRequests:
    """The unit's requests sorted by time (stable), blocks and chain roots with them."""
    order = np.argsort(raw.time_s, kind="stable")
    if np.array_equal(order, np.arange(len(order))):
        return raw
    offsets = np.concatenate([[0], np.cumsum(raw.lengths)])
    _, ids = reorder_segments(order, offsets, raw.ids)
    return replace(
        raw,
        time_s=raw.time_s[order],
        class_codes=raw.class_codes[order],
        input_tokens=raw.input_tokens[order],
        output_tokens=raw.output_tokens[order],
        hashed_tokens=raw.hashed_tokens[order],
        lengths=raw.lengths[order],
        ids=ids,
        chain_roots=None if raw.chain_roots is None else raw.chain_roots[order],
    )


def _rank_within_groups(
    group: np.ndarray, num_partitions: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each distinct block's index among its group's (int32), the distinct blocks ordered by
    group, and the group boundaries in that order."""
    by_group = np.argsort(group.astype(np.uint16), kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(group, minlength=num_partitions))])
    local = np.empty(len(group), np.int32)
    local[by_group] = np.arange(len(group)) - np.repeat(bounds[:-1], np.diff(bounds))
    return local, by_group, bounds


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of equal values in a non-decreasing array: each run's value and length (int32)."""
    if not len(values):
        return np.empty(0, np.int32), np.empty(0, np.int32)
    starts = np.concatenate([[0], np.flatnonzero(values[1:] != values[:-1]) + 1])
    lengths = np.diff(np.append(starts, len(values))).astype(np.int32)
    return values[starts].astype(np.int32), lengths


def _request_piece(raw: RawRequests, num_distinct: int) -> RequestPiece:
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
        num_distinct,
    )


def block_identities(raw: RawRequests, offsets: np.ndarray) -> np.ndarray:
    """uint64 identity of every block access (module docstring)."""
    if raw.chain_roots is None:
        return raw.ids.astype(np.uint64)
    return chain_identities(offsets, raw.ids, raw.chain_roots)


@dataclass(frozen=True)
class MergedRequests:
    """Every request of a split trace in time order (``requests``, a ``Trace`` without blocks)
    and, per unit, where each of its requests went (int64 indexes into ``requests``)."""

    requests: Trace
    unit_request_ids: list[np.ndarray]


def merge_requests(
    request_pieces: Sequence[RequestPiece], time_scale: float = 1.0
) -> MergedRequests:
    """The units' requests merged into one time order (stable: as ``load_trace`` sorts the
    file's lines). Each unit is in time order, so the stable sort is a merge of sorted runs."""
    requests = _concat_requests(request_pieces)
    order = np.argsort(requests["time_s"], kind="stable")
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    starts = np.cumsum([0, *(len(piece.time_s) for piece in request_pieces)])
    trace = Trace(
        time_s=requests["time_s"][order],
        class_ids=requests["class_ids"][order],
        input_tokens=requests["input_tokens"][order],
        output_tokens=requests["output_tokens"][order],
        hashed_tokens=requests["hashed_tokens"][order],
        block_offsets=np.zeros(len(order) + 1, np.int64),
        block_ids=np.empty(0, np.int32),
        class_names=requests["class_names"],
        block_tokens=request_pieces[0].block_tokens if request_pieces else 1,
        num_blocks=0,
        num_skipped=sum(piece.num_skipped for piece in request_pieces),
        whole_request_blocks=requests["num_blocks"][order],
    )
    if time_scale != 1.0:
        trace = trace.with_time_scale(time_scale)
    return MergedRequests(trace, [rank[a:b] for a, b in itertools.pairwise(starts)])


def assemble_partition(merged: MergedRequests, block_pieces: Sequence[BlockPiece]) -> Trace:
    """One partition's ``Trace``: the requests that have blocks in it, in time order, with its
    blocks numbered densely and their positions in the whole request."""
    rows = np.concatenate(
        [ids[piece.rows] for ids, piece in zip(merged.unit_request_ids, block_pieces, strict=True)]
    ) if block_pieces else np.empty(0, np.int64)  # fmt: skip
    lengths = _concat([piece.lengths for piece in block_pieces], np.int64)
    positions = _concat([piece.positions for piece in block_pieces], np.int32)
    block_ids, num_blocks = _renumber(block_pieces)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if len(block_pieces) > 1 and not np.all(rows[1:] > rows[:-1]):  # units not in time order
        order = np.argsort(rows, kind="stable")
        new_offsets, block_ids = reorder_segments(order, offsets, block_ids)
        _, positions = reorder_segments(order, offsets, positions)
        rows, offsets = rows[order], new_offsets
    requests = merged.requests
    whole = requests.time_s
    return Trace(
        time_s=whole[rows],
        class_ids=requests.class_ids[rows],
        input_tokens=requests.input_tokens[rows],
        output_tokens=requests.output_tokens[rows],
        hashed_tokens=requests.hashed_tokens[rows],
        block_offsets=offsets,
        block_ids=block_ids,
        class_names=requests.class_names,
        block_tokens=requests.block_tokens,
        num_blocks=num_blocks,
        request_ids=rows,
        whole_span_s=(float(whole[0]), float(whole[-1])) if len(whole) else (0.0, 0.0),
        block_positions=positions,
    )


def _renumber(block_pieces: Sequence[BlockPiece]) -> tuple[np.ndarray, int]:
    """The pieces' accesses as the partition's dense block ids (int32), and its number of
    blocks: the units' block numbers mapped by one hash pass over their distinct blocks (none
    when only one unit has blocks here: its numbers are the partition's)."""
    with_blocks = [piece for piece in block_pieces if len(piece.distinct)]
    if len(with_blocks) <= 1:
        local_ids = with_blocks[0].local_ids if with_blocks else np.empty(0, np.int32)
        return local_ids, len(with_blocks[0].distinct) if with_blocks else 0
    all_distinct = _concat([piece.distinct for piece in block_pieces], np.uint64)
    dense_of_distinct, distinct = dense_ids(all_distinct)
    firsts = np.cumsum([0, *(len(piece.distinct) for piece in block_pieces)])
    pieces_ids = [
        dense_of_distinct[first + piece.local_ids]
        for first, piece in zip(firsts, block_pieces, strict=False)
    ]
    return _concat(pieces_ids, np.int32), len(distinct)


def _concat(parts: Sequence[np.ndarray], dtype: Any) -> np.ndarray:
    if len(parts) == 1:  # one unit: its array as it is (no copy where the type fits)
        return parts[0].astype(dtype, copy=False)
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)


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
        return _concat([getattr(piece, name) for piece in pieces], dtype)

    return {
        "time_s": cat("time_s", np.float64),
        "class_ids": _concat(class_ids, np.int32),
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
    """Runs plain functions as tasks; a handle from ``submit`` or ``put`` may be an argument
    of a later ``submit`` (it arrives as its value), and ``get`` turns handles into values."""

    def submit(self, fn: Callable[..., Any], *args: Any, num_returns: int = 1) -> Any: ...

    def put(self, value: Any) -> Any: ...

    def get(self, handles: Sequence[Any]) -> list[Any]: ...

    def task_cpu_s(self) -> float: ...


class InlineExecutor:
    """Runs each task at once in this process (tests, and runs without a cluster)."""

    def submit(self, fn: Callable[..., Any], *args: Any, num_returns: int = 1) -> Any:
        result = fn(*args)
        return list(result) if num_returns > 1 else result

    def put(self, value: Any) -> Any:
        return value

    def get(self, handles: Sequence[Any]) -> list[Any]:
        return list(handles)

    def task_cpu_s(self) -> float:
        """CPU seconds of tasks outside this process: none (its tasks are this process's)."""
        return 0.0


@dataclass(frozen=True)
class PartitionedTrace:
    """A trace split over partitions: per partition, handles to its pieces (one per unit) and
    the merged requests they are assembled against (``merged``); every request (for the
    results), and the sizes a grid needs before it runs."""

    partitions: list[list[Any]]
    merged: Any
    requests: Trace
    num_accesses: int
    num_blocks: int


MAX_PARTITIONS = 2**16  # partition ids sort as uint16
SPLITTING, COUNTING = "splitting the trace (units)", "counting blocks (partitions)"
StepProgress = Callable[[str, int, int], None]  # (step, tasks done, tasks in the step)


def split_trace(
    units: Sequence[TraceUnit],
    fmt: str,
    options: LoadOptions,
    num_partitions: int,
    partition_of: PartitionFn,
    executor: Executor,
    time_scale: float = 1.0,
    progress: StepProgress | None = None,
) -> PartitionedTrace:
    """Split the units (module docstring) on ``executor`` and merge their requests;
    ``progress`` sees each step's tasks as they finish. A partition is assembled where it is
    simulated (``simulate_partitioned``); its distinct blocks are counted here, by a task per
    partition where several units may share blocks."""
    progress = progress or (lambda step, done, total: None)
    if not 1 <= num_partitions <= MAX_PARTITIONS:
        raise ValueError(f"partitions must be in [1, {MAX_PARTITIONS}], got {num_partitions}")
    width = num_partitions + 1
    splits = [
        executor.submit(
            split_unit, u, fmt, options, num_partitions, partition_of, num_returns=width
        )
        for u in units
    ]
    request_pieces = []
    for split in splits:  # in order, one at a time: the units are about the same size
        request_pieces += executor.get([split[0]])
        progress(SPLITTING, len(request_pieces), len(splits))
    merged = merge_requests(request_pieces, time_scale)
    pieces = [[split[p + 1] for split in splits] for p in range(num_partitions)]
    if len(splits) == 1:  # one unit's distinct blocks are the partitions' together
        num_blocks = request_pieces[0].num_distinct
    else:
        counts = [executor.submit(count_blocks, mine) for mine in pieces]
        num_blocks = 0
        for done, handle in enumerate(counts, 1):
            num_blocks += executor.get([handle])[0]
            progress(COUNTING, done, num_partitions)
    return PartitionedTrace(
        pieces,
        executor.put(merged),  # once, for every partition's task
        merged.requests,
        num_accesses=int(merged.requests.request_blocks.sum()),
        num_blocks=num_blocks,
    )


def count_blocks(block_pieces: Sequence[BlockPiece]) -> int:
    """Distinct blocks of one partition's pieces (units may share blocks)."""
    distinct = [piece.distinct for piece in block_pieces if len(piece.distinct)]
    if len(distinct) <= 1:
        return sum(map(len, distinct))
    return len(dense_ids(np.concatenate(distinct))[1])


def simulate_pieces(
    merged: MergedRequests,
    block_pieces: Sequence[BlockPiece],
    configs: Sequence[SimConfig],
    num_partitions: int,
    partition: int,
) -> list[SimCounts]:
    """One partition's task: assemble it, then one pass per grid point."""
    trace = assemble_partition(merged, block_pieces)
    return [simulate_partition(trace, c, num_partitions, partition) for c in configs]


def simulate_partitioned(
    split: PartitionedTrace,
    configs: Sequence[SimConfig],
    executor: Executor,
    on_done: Callable[[int], None] | None = None,
) -> list[CountsTotal]:
    """Every partition as one task that assembles it and runs every grid point; the added-up
    counts per point. ``on_done`` sees the number of finished passes (partitions x points)."""
    num_partitions = len(split.partitions)
    handles = [
        executor.submit(simulate_pieces, split.merged, pieces, list(configs), num_partitions, p)
        for p, pieces in enumerate(split.partitions)
    ]
    totals = [CountsTotal(split.requests) for _ in configs]
    num_done = 0
    for handle in handles:  # one partition at a time: the driver holds its passes at most
        (passes,) = executor.get([handle])
        for total, counts in zip(totals, passes, strict=True):
            total.add(counts)
        num_done += len(passes)
        if on_done is not None:
            on_done(num_done)
    return totals
