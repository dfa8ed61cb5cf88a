"""The trace model: ``Trace`` (requests in time order, dense block ids), the load options,
and a unit's raw columns (``TraceUnit``, ``RawRequests``) that ``ttl.partition`` splits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MOONCAKE, BAILIAN, SESSIONS = "mooncake", "bailian", "sessions"
FORMATS = (MOONCAKE, BAILIAN, SESSIONS)
PARTIAL_DROP, PARTIAL_COUNT = "drop", "count"
PARTIAL_BLOCKS = (PARTIAL_DROP, PARTIAL_COUNT)
DEFAULT_BLOCK_TOKENS = {MOONCAKE: 512, BAILIAN: 16}
MiB = 1 << 20

# time_s, class label, input tokens, output tokens, raw block ids
Record = tuple[float, str, int, int, "np.ndarray | list[int]"]


@dataclass(frozen=True)
class Trace:
    """Requests in time order; request ``r`` reads ``block_ids[block_offsets[r]:...[r+1]]``."""

    time_s: np.ndarray  # float64 [num_requests], non-decreasing
    class_ids: np.ndarray  # int32 [num_requests], index into class_names
    input_tokens: np.ndarray  # int64 [num_requests]
    output_tokens: np.ndarray  # int64 [num_requests]
    hashed_tokens: np.ndarray  # int64 [num_requests]: min(hash ids x block_tokens, input)
    block_offsets: np.ndarray  # int64 [num_requests + 1]
    block_ids: np.ndarray  # int32 [num_accesses], dense: 0 .. num_blocks-1
    class_names: tuple[str, ...]
    block_tokens: int
    num_blocks: int  # distinct blocks
    num_skipped: int = 0  # malformed records skipped (only with skip_bad)
    # A partition (ttl.partition) holds the requests that have blocks in it: each row's index
    # in the whole trace (int64 [num_requests]), the first and last request times of the whole
    # trace, and each block's position in its whole request (int32 [num_accesses]). The
    # requests of a split trace, without blocks, carry the whole requests' block counts.
    request_ids: np.ndarray | None = None
    whole_span_s: tuple[float, float] | None = None
    block_positions: np.ndarray | None = None
    whole_request_blocks: np.ndarray | None = None

    @property
    def num_requests(self) -> int:
        return len(self.time_s)

    @property
    def num_accesses(self) -> int:
        return len(self.block_ids)

    @property
    def span_s(self) -> float:
        """Seconds from the first to the last request (0 for fewer than two)."""
        return float(self.time_s[-1] - self.time_s[0]) if self.num_requests else 0.0

    @property
    def request_blocks(self) -> np.ndarray:
        """Cacheable blocks of each request (of the whole request, in a partition)."""
        if self.whole_request_blocks is not None:
            return self.whole_request_blocks
        return np.diff(self.block_offsets)

    def blocks(self, request: int) -> np.ndarray:
        return self.block_ids[self.block_offsets[request] : self.block_offsets[request + 1]]

    def with_time_scale(self, time_scale: float) -> Trace:
        """Stretch the gaps between requests by ``time_scale`` (the first request stays put)."""
        if not time_scale > 0:
            raise ValueError(f"time scale must be > 0, got {time_scale}")
        if not self.num_requests:
            return self
        start_s = self.time_s[0]
        return dataclasses.replace(self, time_s=start_s + (self.time_s - start_s) * time_scale)


@dataclass(frozen=True)
class LoadOptions:
    block_tokens: int | None = None  # None: the format's default (sessions: the file's)
    default_class: str = "chat"  # class of records that name none
    type_to_class: Mapping[str, str] = field(default_factory=dict)  # bailian ``type`` -> class
    skip_bad: bool = False  # skip and count malformed records instead of raising
    chunk_bytes: int = 16 * MiB  # bytes of whole lines parsed at a time
    partial_blocks: str = PARTIAL_DROP  # a request's trailing partial block: drop or count

    def __post_init__(self) -> None:
        if self.partial_blocks not in PARTIAL_BLOCKS:
            raise ValueError(
                f"partial blocks {self.partial_blocks!r}: choose {' or '.join(PARTIAL_BLOCKS)}"
            )


BytesProgress = Callable[[int, int], None]  # (bytes read, bytes in all)


@dataclass(frozen=True)
class TraceUnit:
    """A piece of a trace one task parses: bytes ``[start, end)`` of a JSONL file (whole
    lines), or session files with their index in the trace's sorted file list."""

    path: Path
    start: int = 0
    end: int | None = None
    session_files: tuple[tuple[int, Path], ...] = ()


@dataclass(frozen=True)
class RawRequests:
    """One unit's requests in file order, before sorting and renumbering.

    Request ``r`` has ``lengths[r]`` raw block ids in ``ids`` (int64, flattened, the partial tail
    already cut when dropping), ``hashed_tokens[r]`` and a class ``class_labels[class_codes[r]]``.
    ``chain_roots`` (int64 per request) is set where ids name single blocks and must be chained
    (Bailian: 0; sessions: the file's index, as ids are local to a file); None where ids are
    already chained (Mooncake).
    """

    time_s: np.ndarray
    class_labels: tuple[str, ...]
    class_codes: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    hashed_tokens: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray
    chain_roots: np.ndarray | None
    block_tokens: int
    num_skipped: int
