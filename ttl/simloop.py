"""The simulator's per-access loop compiled: ``ttl/simloop.c`` through ctypes.

``ttl/sim_python.py``'s ``PythonPass`` is the pure-Python pass and the reference of the semantics;
this runs the same algorithm over the same arrays in C (``make native`` builds
``ttl/_simloop.so``). Without the library (no compiler, or ``KVSTORE_NATIVE=0``) the simulator
runs the Python pass; ``tests/ttl/test_simloop.py`` checks the two agree on random traces.

Why C through ctypes and not numba: the loop is ~200 lines of plain C with no dependency; the
project already builds its native helpers that way (``make native``), a build takes a second,
and loading costs nothing per process. Numba would add llvmlite (~100 MB) to the ``sim`` extra
and compile the loop in every process that runs it (a second or more per Ray worker, which is
what the partitions must not pay).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

LIBRARY_PATH = Path(__file__).with_name("_simloop.so")
MAX_CLASSES = 64  # the C state's per-class arrays


def _load() -> ctypes.CDLL | None:
    if os.environ.get("KVSTORE_NATIVE", "1") == "0" or not LIBRARY_PATH.exists():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY_PATH))
    except OSError as exc:
        log.warning("not using %s (%s): the simulator runs its Python pass", LIBRARY_PATH, exc)
        return None
    ptr, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    lib.sim_new.argtypes = [i64, i64, i64, *[ptr] * 6, i64, ctypes.c_int, f64]
    lib.sim_new.restype = ptr
    lib.sim_free.argtypes = [ptr]
    lib.sim_free.restype = None
    lib.sim_visit.argtypes = [ptr, i64, i64]
    lib.sim_visit.restype = ctypes.c_int
    lib.sim_start_window.argtypes = [ptr]
    lib.sim_start_window.restype = None
    lib.sim_finish.argtypes = [ptr, f64]
    lib.sim_finish.restype = ctypes.c_int
    lib.sim_sizes.argtypes = [ptr, ptr]
    lib.sim_sizes.restype = None
    lib.sim_results.argtypes = [ptr] * 7
    lib.sim_results.restype = None
    lib.sim_split_unit.argtypes = [i64, ptr, ptr, ptr, i64, i64, *[ptr] * 9]
    lib.sim_split_unit.restype = ctypes.c_int
    lib.sim_rendezvous.argtypes = [i64, ptr, i64, ptr, ptr]
    lib.sim_rendezvous.restype = None
    lib.sim_chain.argtypes = [i64, ptr, ptr, ptr, ptr]
    lib.sim_chain.restype = None
    return lib


_lib = _load()
NATIVE = _lib is not None


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


class NativePass:
    """One pass's state in C. The arrays given stay referenced here while the C state reads
    them; ``close`` frees the state (``results`` first)."""

    def __init__(
        self,
        times: np.ndarray,
        classes: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        block_ids: np.ndarray,
        num_blocks: int,
        ttl_s: list[float],
        capacity_blocks: int | None,
        lru: bool,
        window_start_s: float,
    ) -> None:
        assert _lib is not None, "the compiled loop needs ttl/_simloop.so (make native)"
        if len(ttl_s) > MAX_CLASSES:
            raise ValueError(f"the compiled loop takes at most {MAX_CLASSES} traffic classes")
        self._arrays = (
            np.ascontiguousarray(times, np.float64),
            np.ascontiguousarray(classes, np.int32),
            np.ascontiguousarray(starts, np.int64),
            np.ascontiguousarray(lengths, np.int64),
            np.ascontiguousarray(block_ids, np.int32),
            np.asarray(ttl_s, np.float64).reshape(-1),
        )
        self.num_classes = len(ttl_s)
        capacity = -1 if capacity_blocks is None else capacity_blocks
        self._state = _lib.sim_new(
            len(times), self.num_classes, num_blocks, *map(_address, self._arrays),
            capacity, int(lru), window_start_s,
        )  # fmt: skip
        if not self._state:
            raise MemoryError(f"no memory for the simulator's state of {num_blocks:,} blocks")

    def visit(self, begin: int, end: int) -> None:
        self._check(_lib.sim_visit(self._state, begin, end))

    def start_window(self) -> None:
        _lib.sim_start_window(self._state)

    def finish(self, end_s: float) -> None:
        self._check(_lib.sim_finish(self._state, end_s))

    def results(self) -> dict[str, np.ndarray]:
        """``misses`` [n, 3] (visit, index in the visit, inserted), ``evictions`` [n, 3]
        (visit, class, blocks), ``expiries`` [n, 3] (instant, class, blocks; float64) and per
        class ``block_seconds``, ``expired``, ``evicted``."""
        sizes = np.zeros(3, np.int64)
        _lib.sim_sizes(self._state, _address(sizes))
        misses = np.empty((sizes[0], 3), np.int64)
        evictions = np.empty((sizes[1], 3), np.int64)
        expiries = np.empty((sizes[2], 3), np.int64)
        block_seconds = np.empty(self.num_classes, np.float64)
        expired = np.empty(self.num_classes, np.int64)
        evicted = np.empty(self.num_classes, np.int64)
        out = (misses, evictions, expiries, block_seconds, expired, evicted)
        _lib.sim_results(self._state, *map(_address, out))
        instants = expiries[:, 0].copy().view(np.float64)  # the C side stores the double's bits
        expiry_rows = np.column_stack([instants, expiries[:, 1:].astype(np.float64)])
        return {
            "misses": misses,
            "evictions": evictions,
            "expiries": expiry_rows.reshape(-1, 3),
            "block_seconds": block_seconds,
            "expired": expired,
            "evicted": evicted,
        }

    def close(self) -> None:
        if self._state:
            _lib.sim_free(self._state)
            self._state = None

    def _check(self, failed: int) -> None:
        if failed == 1:
            raise MemoryError("the simulator's compiled loop ran out of memory")
        assert not failed, "evict() with no resident block: the live count is off"


@dataclass(frozen=True)
class SplitUnit:
    """A unit's accesses sorted by partition (stable): partition ``p`` has accesses
    ``access_bounds[p]:access_bounds[p + 1]`` (``positions`` in their request, ``local_ids``:
    indexes into its distinct blocks), runs ``run_bounds[p]:run_bounds[p + 1]`` (``run_rows``:
    the request, ``run_lengths``: its accesses there) and distinct blocks
    ``distinct_bounds[p]:distinct_bounds[p + 1]`` of ``distinct`` (identities, in order of
    first appearance)."""

    access_bounds: np.ndarray  # int64 [partitions + 1]
    run_bounds: np.ndarray  # int64 [partitions + 1]
    distinct_bounds: np.ndarray  # int64 [partitions + 1]
    positions: np.ndarray  # int32 [accesses]
    local_ids: np.ndarray  # int32 [accesses]
    run_rows: np.ndarray  # int32 [runs]
    run_lengths: np.ndarray  # int32 [runs]
    distinct: np.ndarray  # uint64 [distinct blocks]


def split_unit(
    lengths: np.ndarray,
    ids: np.ndarray,
    roots: np.ndarray | None,
    num_partitions: int,
    weights: Sequence[int] | None,
) -> SplitUnit:
    """A unit's identities, distinct blocks, their placement and the counting sort of its
    accesses by partition, in one C pass (``ttl/simloop.c``, ``sim_split_unit``): the store's
    rendezvous over ``identity_keys`` of each block's identity (``weights``: the groups'
    integer weights; None: equal). ``roots``: chain the ids from these (None: ids are
    identities)."""
    assert _lib is not None, "split_unit needs ttl/_simloop.so (make native)"
    inputs = [np.ascontiguousarray(lengths, np.int64), np.ascontiguousarray(ids, np.int64)]
    inputs.append(None if roots is None else np.ascontiguousarray(roots, np.int64))
    weight_array = _weights(weights, num_partitions)
    num_accesses = len(inputs[1])
    bounds = [np.empty(num_partitions + 1, np.int64) for _ in range(3)]
    per_access = [np.empty(num_accesses, np.int32) for _ in range(4)]  # runs: cut below
    distinct = np.empty(num_accesses, np.uint64)
    failed = _lib.sim_split_unit(
        len(inputs[0]), *(None if x is None else _address(x) for x in inputs), num_accesses,
        num_partitions, None if weight_array is None else _address(weight_array),
        *map(_address, [*bounds, *per_access, distinct]),
    )  # fmt: skip
    if failed:
        raise MemoryError("no memory to split the accesses")
    num_runs, num_distinct = int(bounds[1][-1]), int(bounds[2][-1])
    positions, local_ids, run_rows, run_lengths = per_access
    return SplitUnit(
        *bounds, positions, local_ids, run_rows[:num_runs].copy(),
        run_lengths[:num_runs].copy(), distinct[:num_distinct].copy(),
    )  # fmt: skip


def _weights(weights: Sequence[int] | None, num_groups: int) -> np.ndarray | None:
    if weights is None:
        return None
    array = np.ascontiguousarray(weights, np.int64)
    if array.shape != (num_groups,) or np.any(array < 1):
        raise ValueError(f"expected {num_groups} group weights >= 1, got {list(weights)}")
    return array


def rendezvous_groups(
    keys: np.ndarray, num_groups: int, weights: Sequence[int] | None = None
) -> np.ndarray:
    """``kvstore.placement.group_of_key`` for uint64 [n, 2] keys, in C (int64 [n]); with
    ``weights`` (the groups' integer weights) the weighted rendezvous, bit for bit as the
    Python one computes it."""
    assert _lib is not None, "rendezvous_groups needs ttl/_simloop.so (make native)"
    keys = np.ascontiguousarray(keys, np.uint64)
    weight_array = _weights(weights, num_groups)
    out = np.empty(len(keys), np.int64)
    weights_at = None if weight_array is None else _address(weight_array)
    _lib.sim_rendezvous(len(keys), _address(keys), num_groups, weights_at, _address(out))
    return out


def chain_identities(lengths: np.ndarray, ids: np.ndarray, roots: np.ndarray) -> np.ndarray:
    """``ttl.traces.chain_identities`` in one C pass: uint64 identity of every access."""
    assert _lib is not None, "chain_identities needs ttl/_simloop.so (make native)"
    inputs = (
        np.ascontiguousarray(lengths, np.int64),
        np.ascontiguousarray(ids, np.int64),
        np.ascontiguousarray(roots, np.int64),
    )
    out = np.empty(len(inputs[1]), np.uint64)
    _lib.sim_chain(len(inputs[0]), *map(_address, inputs), _address(out))
    return out
