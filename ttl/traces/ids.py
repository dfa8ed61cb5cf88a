"""Block ids: CSR segment helpers, dense numbering of distinct blocks, chained identities."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ttl import simloop
from ttl.errors import TraceFormatError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def reorder_segments(
    order: np.ndarray, offsets: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Permute the variable-length segments of a CSR array (``order[i]`` goes to slot ``i``)."""
    if np.array_equal(order, np.arange(len(order))):
        return offsets, values
    lengths = np.diff(offsets)[order]
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    shift = np.repeat(offsets[:-1][order] - new_offsets[:-1], lengths)
    return new_offsets, values[np.arange(new_offsets[-1]) + shift]


def cut_partial_blocks(
    offsets: np.ndarray, values: np.ndarray, max_lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Keep at most ``max_lengths[r]`` leading values of each CSR segment ``r``."""
    lengths = np.diff(offsets)
    kept = np.minimum(lengths, max_lengths)
    if np.array_equal(kept, lengths):
        return offsets, values
    position = np.arange(len(values)) - np.repeat(offsets[:-1], lengths)
    keep = position < np.repeat(kept, lengths)
    return np.concatenate([[0], np.cumsum(kept)]), values[keep]


def dense_ids(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(inverse, distinct)``: ``values == distinct[inverse]``, distinct values numbered in
    order of first appearance (int32). A hash pass (Arrow's dictionary encoding), not a sort."""
    if not len(values):
        return np.empty(0, np.int32), values[:0]
    encoded = pa.array(values).dictionary_encode()
    distinct = encoded.dictionary.to_numpy()
    if len(distinct) >= 2**31:
        raise TraceFormatError(
            f"{len(distinct):,} distinct blocks: more than the simulator's 2**31; "
            "split the trace by time"
        )
    return encoded.indices.to_numpy().astype(np.int32, copy=False), distinct


def chain_identities(offsets: np.ndarray, ids: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """uint64 ``identity_j = mix64(identity_{j-1}, id_j)`` along each request, from
    ``mix64(root, 0)``: a block named together with its prefix (and its root: session ids are
    local to their file, whose index is the root). One C pass where ``ttl/_simloop.so`` is
    built; else position by position across all requests at once. Two blocks are the same when
    their identities are (up to 64-bit hash collisions)."""
    lengths = np.diff(offsets)
    if simloop.NATIVE:
        return simloop.chain_identities(lengths, ids, roots)
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
