"""Request traces: Mooncake, Qwen-Bailian and session files, loaded into one columnar ``Trace``.

Formats (one record per request):

* ``mooncake`` (JSONL): ``timestamp`` (milliseconds), ``input_length``, ``output_length``
  (optional, 0), ``hash_ids`` (prefix-chained block ids: an id names its block together with
  everything before it) and an optional ``class``; records without one get ``--class``. The
  block size comes from ``--block-tokens`` (512 for Mooncake's published traces).
* ``bailian`` (JSONL, Alibaba Qwen-Bailian): ``chat_id``, ``parent_chat_id``, ``timestamp``
  (seconds), ``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids`` of 16-token
  blocks hashed per block, not chained. ``type`` maps to a class by ``--type-class TYPE=CLASS``;
  unmapped types get ``--class``.
* ``sessions`` (one JSON document per conversation; a file or a folder of ``*.json`` files)::

      {"block_size": 16, "t": 0, "class": "agent",        # t (s) and class are optional
       "requests": [
         {"t": 0.0, "in": 5012, "out": 230, "hash_ids": [0, 1, 2]},
         {"t": 41.5, "requests": [                          # a sub-agent: its own start t,
           {"t": 0.0, "in": 800, "out": 90, "hash_ids": [0, 7]}]}]}  # inner t from that start

  ``t`` counts from the start of the enclosing list; a ``class`` applies to everything under
  it. Ids are local to the file.

Block identity. The store's keys are chained (a block's key covers every token before it), so
every block gets a dense id (``0 .. num_blocks-1``) naming the block *with its prefix*. Mooncake
ids are already chained and are only renumbered. Bailian and session ids are per block, so the
loader chains them: the same id after a different prefix is a different block, and a request's
prefix hit stops at its first missing block exactly as in the store.

Partial blocks. A request of ``L`` input tokens has ``L // B`` full blocks; its hash ids may
also name the trailing partial block (Mooncake's do). ``PARTIAL_DROP`` (the default) keeps
full blocks only, which is what the store and the engine cache (``block_keys`` covers full
blocks; the tail is recomputed); ``PARTIAL_COUNT`` keeps the partial block as a cacheable
block of ``L - i*B`` tokens, the way published trace figures count. Either way the token hit
ratio's denominator (``Trace.hashed_tokens``) covers every token the hash ids name.

Files larger than memory are read in chunks of whole lines and parsed by pyarrow; only dense
integer arrays are kept. Requests are put in time order (stable for equal timestamps). A
malformed line raises ``TraceFormatError`` naming the file and line; with ``skip_bad`` it is
skipped, counted in ``Trace.num_skipped`` and logged. Nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from msgspec import UNSET, UnsetType

from ttl import simloop
from ttl.errors import TraceFormatError

log = logging.getLogger(__name__)

MOONCAKE, BAILIAN, SESSIONS = "mooncake", "bailian", "sessions"
FORMATS = (MOONCAKE, BAILIAN, SESSIONS)
PARTIAL_DROP, PARTIAL_COUNT = "drop", "count"
PARTIAL_BLOCKS = (PARTIAL_DROP, PARTIAL_COUNT)
DEFAULT_BLOCK_TOKENS = {MOONCAKE: 512, BAILIAN: 16}
MiB = 1 << 20
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

# time_s, class label, input tokens, output tokens, raw block ids
_Record = tuple[float, str, int, int, "np.ndarray | list[int]"]


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


def load_trace(
    path: str | Path,
    fmt: str,
    options: LoadOptions | None = None,
    progress: BytesProgress | None = None,
) -> Trace:
    """Load a trace file (or a folder of session files) in one of ``FORMATS``; ``progress``
    sees the bytes read as the loader goes."""
    options = options or LoadOptions()
    path = _check_source(Path(path), fmt)
    progress = progress or (lambda done, total: None)
    if fmt == SESSIONS:
        return _load_sessions(path, options, progress)
    return _load_jsonl(path, _JSONL_FORMATS[fmt], options, progress)


def trace_from_records(
    records: list[tuple[float, str, int, int, list[int]]],
    block_tokens: int,
    chain: bool,
    partial_blocks: str = PARTIAL_DROP,
) -> Trace:
    """A trace from ``(time_s, class, input_tokens, output_tokens, block_ids)`` records;
    ``chain`` treats the ids as per-block (like Bailian's) rather than prefix-chained."""
    columns = _Columns()
    columns.add_records(list(records), 1.0)
    return columns.finish(block_tokens, chain=chain, partial_blocks=partial_blocks)


def parse_type_map(specs: list[str]) -> dict[str, str]:
    """``["text=chat", "search=agent"]`` -> ``{"text": "chat", "search": "agent"}``."""
    mapping = {}
    for spec in specs:
        name, sep, traffic_class = spec.partition("=")
        if not sep or not name or not traffic_class:
            raise ValueError(f"bad --type-class {spec!r}: expected TYPE=CLASS, e.g. text=chat")
        mapping[name] = traffic_class
    return mapping


# --- units: a trace in pieces that tasks parse on their own (ttl.partition) ---------------------


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


def trace_units(path: str | Path, fmt: str, unit_bytes: int = 64 * MiB) -> list[TraceUnit]:
    """Split a trace into units of about ``unit_bytes``, cut at line (or file) boundaries."""
    path = _check_source(Path(path), fmt)
    if fmt == SESSIONS:
        files = _session_files(path)
        units, current, size = [], [], 0
        for index, file in enumerate(files):
            current.append((index, file))
            size += file.stat().st_size
            if size >= unit_bytes:
                units.append(TraceUnit(path, session_files=tuple(current)))
                current, size = [], 0
        if current:
            units.append(TraceUnit(path, session_files=tuple(current)))
        return units
    size = path.stat().st_size
    cuts = [0]
    with path.open("rb") as f:
        for guess in range(unit_bytes, size, unit_bytes):
            if guess <= cuts[-1]:
                continue
            f.seek(guess)
            tail = f.readline()  # the rest of the line the guess fell in
            cut = guess + len(tail)
            if cut < size:
                cuts.append(cut)
    return [TraceUnit(path, a, b) for a, b in zip(cuts, [*cuts[1:], size], strict=True)]


def parse_unit(unit: TraceUnit, fmt: str, options: LoadOptions) -> RawRequests:
    """Parse one unit of a trace (see ``trace_units``) into raw columns."""
    if fmt == SESSIONS:
        columns = _Columns()
        block_sizes, roots = _read_session_files(unit.session_files, options, columns)
        block_tokens = _session_block_tokens(unit.path, block_sizes, options.block_tokens)
        return columns.raw(block_tokens, options.partial_blocks, roots)
    jsonl = _JSONL_FORMATS[fmt]
    columns = _Columns()
    # Lines are numbered from the unit's start; the unit's own first line number (a count of
    # the file's lines before it) is only needed, and counted, for an error message.
    chunks = _read_line_chunks(unit.path, options.chunk_bytes, unit.start, unit.end)
    lines_before = functools.cache(lambda: _line_number(unit.path, unit.start) - 1)
    _parse_jsonl_chunks(chunks, unit.path, jsonl, options, columns, lines_before)
    block_tokens = options.block_tokens or DEFAULT_BLOCK_TOKENS[jsonl.name]
    roots = None if jsonl.chained else np.zeros(columns.num_requests(), np.int64)
    return columns.raw(block_tokens, options.partial_blocks, roots)


def _line_number(path: Path, offset: int) -> int:
    """The 1-based number of the line that starts at byte ``offset``."""
    count = 1
    with path.open("rb") as f:
        left = offset
        while left > 0 and (block := f.read(min(16 * MiB, left))):
            count += block.count(b"\n")
            left -= len(block)
    return count


def _check_source(path: Path, fmt: str) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if not path.exists():
        raise FileNotFoundError(f"no trace at {path}")
    if fmt != SESSIONS and path.is_dir():
        raise TraceFormatError(
            f"{path} is a folder; only --format sessions reads a folder (of *.json files)"
        )
    return path


# --- JSONL formats (mooncake, bailian) ---------------------------------------------------------


@dataclass(frozen=True)
class _JsonlFormat:
    name: str
    schema: pa.Schema
    seconds_per_time_unit: float
    label_field: str  # raw label column: mooncake "class", bailian "type"
    chained: bool  # ids already name their prefix

    def class_label(self, raw: str | None, options: LoadOptions) -> str:
        if self.label_field == "type":
            return options.type_to_class.get(raw, options.default_class)
        return raw if raw is not None else options.default_class


_COMMON_FIELDS = [
    ("timestamp", pa.float64()),
    ("input_length", pa.int64()),
    ("output_length", pa.int64()),
    ("hash_ids", pa.list_(pa.int64())),
]
_JSONL_FORMATS = {
    MOONCAKE: _JsonlFormat(
        MOONCAKE, pa.schema([*_COMMON_FIELDS, ("class", pa.string())]), 1e-3, "class", True
    ),
    BAILIAN: _JsonlFormat(
        BAILIAN, pa.schema([*_COMMON_FIELDS, ("type", pa.string())]), 1.0, "type", False
    ),
}


def _load_jsonl(
    path: Path, fmt: _JsonlFormat, options: LoadOptions, progress: BytesProgress
) -> Trace:
    columns = _Columns()
    total, done = path.stat().st_size, 0

    def counted(chunks: Iterator[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
        nonlocal done
        for chunk in chunks:
            yield chunk
            done += len(chunk[1])
            progress(done, total)

    chunks = counted(_read_line_chunks(path, options.chunk_bytes))
    _parse_jsonl_chunks(chunks, path, fmt, options, columns)
    block_tokens = options.block_tokens or DEFAULT_BLOCK_TOKENS[fmt.name]
    return columns.finish(block_tokens, not fmt.chained, options.partial_blocks)


def _parse_jsonl_chunks(
    chunks: Iterator[tuple[int, bytes]],
    path: Path,
    fmt: _JsonlFormat,
    options: LoadOptions,
    columns: _Columns,
    lines_before: Callable[[], int] = lambda: 0,
) -> None:
    """Parse chunks numbered from line 1 of their unit (``lines_before()``: the file's lines
    before the unit)."""
    for first_line, chunk in chunks:
        table = _parse_chunk_arrow(chunk, fmt)
        if table is not None:
            columns.add_table(table, fmt, options)
        else:  # pyarrow refused the chunk: find the bad lines one by one
            line = first_line + lines_before()
            records = _parse_chunk_python(chunk, line, path, fmt, options, columns)
            columns.add_records(records, fmt.seconds_per_time_unit)


def _read_line_chunks(
    path: Path, chunk_bytes: int, start: int = 0, end: int | None = None, first_line: int = 1
) -> Iterator[tuple[int, bytes]]:
    """Chunks of whole lines (about ``chunk_bytes``) of bytes ``[start, end)`` of ``path``, with
    the 1-based number of their first line (``first_line`` is that of ``start``)."""
    line_no, rest = first_line, b""
    with path.open("rb") as f:
        f.seek(start)
        left = math.inf if end is None else end - start
        while left > 0 and (block := f.read(int(min(chunk_bytes, left)))):
            left -= len(block)
            data = rest + block
            cut = data.rfind(b"\n") + 1
            rest = data[cut:]
            if cut:
                yield line_no, data[:cut]
                line_no += data.count(b"\n", 0, cut)
    if rest.strip():
        yield line_no, rest + b"\n"


def _parse_chunk_arrow(chunk: bytes, fmt: _JsonlFormat) -> pa.Table | None:
    """The chunk as a table, or None when any record is malformed (pyarrow gives no line)."""
    options = pj.ParseOptions(explicit_schema=fmt.schema, unexpected_field_behavior="ignore")
    try:
        table = pj.read_json(io.BytesIO(chunk), parse_options=options)
    except pa.ArrowInvalid:
        return None
    return table if _table_is_valid(table) else None


def _table_is_valid(table: pa.Table) -> bool:
    """No nulls where values are required, finite times, non-negative token counts."""
    required = ("timestamp", "input_length", "hash_ids")
    if any(table[name].null_count for name in required):
        return False
    if pc.list_flatten(table["hash_ids"]).null_count:
        return False
    if not table.num_rows:
        return True
    finite = pc.all(pc.is_finite(table["timestamp"])).as_py()
    min_output = pc.min(table["output_length"]).as_py()
    return finite and pc.min(table["input_length"]).as_py() >= 0 and (min_output or 0) >= 0


def _parse_chunk_python(
    chunk: bytes,
    first_line: int,
    path: Path,
    fmt: _JsonlFormat,
    options: LoadOptions,
    columns: _Columns,
) -> list[_Record]:
    records = []
    for offset, line in enumerate(chunk.split(b"\n")):
        if not line.strip():
            continue
        try:
            records.append(_record_from_json_line(line, fmt, options))
        except ValueError as exc:
            columns.reject(f"{path}:{first_line + offset}: {exc}", options.skip_bad)
    return records


def _record_from_json_line(line: bytes, fmt: _JsonlFormat, options: LoadOptions) -> _Record:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    label = obj.get(fmt.label_field)
    if label is not None and not isinstance(label, str):
        raise ValueError(f"{fmt.label_field!r}: expected a string, got {label!r}")
    return (
        _finite(obj, "timestamp"),
        fmt.class_label(label, options),
        _count(obj, "input_length"),
        _count(obj, "output_length", default=0),
        _id_list(obj, "hash_ids"),
    )


# --- sessions ----------------------------------------------------------------------------------


def _session_files(path: Path) -> list[Path]:
    # Sorted by name (the order of Paths in one folder), not by Path: comparing Paths costs
    # more than reading a small file.
    files = sorted(path.glob("*.json"), key=lambda file: file.name) if path.is_dir() else [path]
    if not files:
        raise TraceFormatError(f"{path}: no *.json session files in this folder")
    return files


def _load_sessions(path: Path, options: LoadOptions, progress: BytesProgress) -> Trace:
    files = _session_files(path)
    sizes = np.cumsum([0, *(file.stat().st_size for file in files)])
    columns = _Columns()
    block_sizes, file_of_request = _read_session_files(
        list(enumerate(files)), options, columns, lambda num: progress(sizes[num], sizes[-1])
    )
    block_tokens = _session_block_tokens(path, block_sizes, options.block_tokens)
    return columns.finish(block_tokens, True, options.partial_blocks, file_of_request)


_SESSION_BATCH = 256  # files whose requests the fast path converts to arrays together


def _read_session_files(
    files: Sequence[tuple[int, Path]],
    options: LoadOptions,
    columns: _Columns,
    progress: Callable[[int], None] | None = None,
) -> tuple[set[int], np.ndarray]:
    """Add the requests of ``files`` ((index, path), in order) to ``columns``: the block sizes
    seen and each request's file index (int64). ``progress`` sees the files done.

    The fast path decodes each file with msgspec against ``_SessionDocument`` (types and
    ranges checked in C) and converts a batch of files to arrays at once (ids: one numpy parse
    per batch); a file it does not take goes through ``_read_session_file``, whose checking
    path accepts it or says exactly what is wrong."""
    block_sizes: set[int] = set()
    file_of_request: list[np.ndarray] = []
    pending: list[tuple[int, Path, int, list]] = []  # index, path, block size, requests

    def add_checked(index: int, file: Path) -> None:
        num_before = columns.num_requests()
        block_size = _read_session_file(file, options, columns)
        if block_size is not None:
            block_sizes.add(block_size)
            file_of_request.append(np.full(columns.num_requests() - num_before, index))

    def flush(num_done: int) -> None:
        if _add_sessions_fast([requests for *_, requests in pending], columns):
            for index, _, block_size, requests in pending:
                block_sizes.add(block_size)
                file_of_request.append(np.full(len(requests), index))
        else:  # an id numpy would not take: file by file, to find and name it
            for index, file, _, _ in pending:
                add_checked(index, file)
        pending.clear()
        if progress is not None:
            progress(num_done)

    for num_done, (index, file) in enumerate(files):
        fast = _session_requests_fast(file.read_bytes(), options.default_class)
        if fast is None:
            flush(num_done)
            add_checked(index, file)
        else:
            pending.append((index, file, *fast))
            if len(pending) >= _SESSION_BATCH:
                flush(num_done + 1)
    flush(len(files))
    parts = file_of_request
    return block_sizes, np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)


def _add_sessions_fast(batch: list[list], columns: _Columns) -> bool:
    """Add the fast path's requests of several files (False, adding nothing, where an id
    list does not parse)."""
    requests = [request for requests in batch for request in requests]
    if not requests:
        return True
    parsed = _session_ids([ids for *_, ids in requests])
    if parsed is None:
        return False
    times, labels, inputs, outputs, _ = zip(*requests, strict=True)
    columns.add_columns(times, labels, inputs, outputs, *parsed)
    return True


def _read_session_file(file: Path, options: LoadOptions, columns: _Columns) -> int | None:
    """Add one session file's requests to ``columns``; its block size, or None if skipped:
    the fast path (``_read_session_files``) for one file, else the checking path."""
    raw = file.read_bytes()
    fast = _session_requests_fast(raw, options.default_class)
    if fast is not None and _add_sessions_fast([fast[1]], columns):
        return fast[0]
    parsed = _parse_session_file(file, raw, options, columns)
    if parsed is None:
        return None
    block_size, records = parsed
    columns.add_records(records, 1.0)
    return block_size


class _SessionEntry(msgspec.Struct):
    """A request, or a sub-agent with ``requests`` of its own, as the fast path decodes it."""

    t: float
    requests: list[_SessionEntry] | UnsetType = UNSET
    num_in: Annotated[int, msgspec.Meta(ge=0)] | UnsetType = msgspec.field(name="in", default=UNSET)
    num_out: Annotated[int, msgspec.Meta(ge=0)] = msgspec.field(name="out", default=0)
    hash_ids: msgspec.Raw | UnsetType = UNSET  # parsed by numpy, all of a file's at once
    label: str | UnsetType = msgspec.field(name="class", default=UNSET)


class _SessionDocument(msgspec.Struct):
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    requests: list[_SessionEntry]
    t: float = 0.0
    label: str | UnsetType = msgspec.field(name="class", default=UNSET)


_SESSION_DECODER = msgspec.json.Decoder(_SessionDocument)
_INT64_LIMITS = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)  # numpy saturates to these


def _session_requests_fast(raw: bytes, default_class: str) -> tuple[int, list] | None:
    """One session file's block size and requests (time, class, in, out, raw id list), or
    None where the checking path must read it."""
    try:
        doc = _SESSION_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    label = default_class if doc.label is UNSET else doc.label
    requests: list[tuple[float, str, int, int, bytes]] = []
    if not _walk_session_fast(doc.requests, doc.t, label, requests) or not requests:
        return None
    return doc.block_size, requests


def _session_ids(id_lists: Sequence[bytes]) -> tuple[list[int], np.ndarray] | None:
    """Raw JSON id lists (``b'[1,2,3]'``) as their lengths and one flat int64 array, parsed by
    numpy in one call; None where a token is not a 64-bit integer."""
    lengths, contents = [], []
    for ids in id_lists:  # '[1,2,3]' -> '1,2,3' and its count; '[]' -> 0
        if ids[:1] != b"[" or ids[-1:] != b"]":
            return None
        inner = ids[1:-1]
        count = inner.count(b",") + 1 if inner.strip() else 0
        lengths.append(count)
        if count:
            contents.append(inner)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            flat = np.fromstring(b",".join(contents), np.int64, sep=",")
    except (ValueError, DeprecationWarning):  # a token that is not an integer
        return None
    if len(flat) != sum(lengths):
        return None
    if len(flat) and (flat.min() == _INT64_LIMITS[0] or flat.max() == _INT64_LIMITS[1]):
        return None  # out of range, or at its limit: the checking path tells them apart
    return lengths, flat


def _walk_session_fast(entries: list[_SessionEntry], start_s: float, label: str, out: list) -> bool:
    """Append ``entries``' requests (sub-agents recursed) with absolute times, as
    ``_walk_session`` does; False where an entry is neither a request nor a sub-agent."""
    for entry in entries:
        time_s = start_s + entry.t
        entry_label = label if entry.label is UNSET else entry.label
        if entry.requests is not UNSET:
            if not _walk_session_fast(entry.requests, time_s, entry_label, out):
                return False
        elif entry.num_in is UNSET or entry.hash_ids is UNSET or not math.isfinite(time_s):
            return False
        else:
            out.append((time_s, entry_label, entry.num_in, entry.num_out, bytes(entry.hash_ids)))
    return True


def _parse_session_file(
    file: Path, raw: bytes, options: LoadOptions, columns: _Columns
) -> tuple[int, list[_Record]] | None:
    """The checking path: Python's json and a check of every field, for the files the fast
    path does not take; a malformed file is rejected with the field that is wrong."""
    # Without a JSON boolean in the file, numpy can check id lists wholesale (a boolean is
    # the one non-integer it would take for an integer); with one, each id is checked.
    check_each_id = b"true" in raw or b"false" in raw
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        columns.reject(f"{file}:{exc.lineno}: {exc.msg}", options.skip_bad)
        return None
    try:
        if not isinstance(doc, dict):
            raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
        block_size = _count(doc, "block_size")
        if block_size < 1:
            raise ValueError(f"'block_size' must be >= 1, got {block_size}")
        records: list[_Record] = []
        label = _label(doc, options.default_class)
        start_s = _finite(doc, "t", default=0.0)
        _walk_session(doc, start_s, label, "", records, check_each_id)
    except ValueError as exc:
        columns.reject(f"{file}: {exc}", options.skip_bad)
        return None
    return block_size, records


def _walk_session(
    node: dict, start_s: float, label: str, where: str, out: list[_Record], check_each_id: bool
) -> None:
    """Append the requests under ``node`` (recursing into sub-agents) with absolute times."""
    requests = node.get("requests")
    if not isinstance(requests, list):
        raise ValueError(f"{where or 'top level'}: expected a 'requests' list")
    for i, req in enumerate(requests):
        here = f"{where}requests[{i}]"
        time_s, req_label = _session_entry_start(req, start_s, label, here)
        if "requests" in req:
            _walk_session(req, time_s, req_label, here + ".", out, check_each_id)
        else:
            out.append(_session_request(req, time_s, req_label, here, check_each_id))


def _session_entry_start(req: Any, start_s: float, label: str, here: str) -> tuple[float, str]:
    try:
        if not isinstance(req, dict):
            raise ValueError(f"expected an object, got {type(req).__name__}")
        return start_s + _finite(req, "t"), _label(req, label)
    except ValueError as exc:
        raise ValueError(f"{here}: {exc}") from None


def _session_request(
    req: dict, time_s: float, label: str, here: str, check_each_id: bool
) -> _Record:
    try:
        num_in, num_out = _count(req, "in"), _count(req, "out", 0)
        return (time_s, label, num_in, num_out, _id_list(req, "hash_ids", check_each_id))
    except ValueError as exc:
        raise ValueError(f"{here}: {exc}") from None


def _session_block_tokens(path: Path, block_sizes: set[int], requested: int | None) -> int:
    if len(block_sizes) > 1:
        raise TraceFormatError(
            f"{path}: session files disagree on block_size ({sorted(block_sizes)}); "
            "simulate files of one block size at a time"
        )
    found = next(iter(block_sizes), requested or 16)
    if requested is not None and requested != found:
        raise TraceFormatError(
            f"{path}: session files say block_size={found} but --block-tokens is {requested}; "
            "drop --block-tokens (sessions carry their own block size)"
        )
    return found


# --- field checks (python path) ----------------------------------------------------------------


def _finite(obj: dict, name: str, default: float | None = None) -> float:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name!r}: expected a finite number, got {value!r}")
    return float(value)


def _count(obj: dict, name: str, default: int | None = None) -> int:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name!r}: expected a non-negative integer, got {value!r}")
    return value


def _id_list(obj: dict, name: str, check_each: bool = True) -> np.ndarray:
    """The list ``obj[name]`` of 64-bit integers as int64; ``check_each=False`` lets numpy
    check them wholesale, which takes a boolean for an integer (the caller rules them out)."""
    ids = obj.get(name)
    if isinstance(ids, list):
        if check_each:
            if all(type(i) is int and -(2**63) <= i < 2**63 for i in ids):
                return np.array(ids, np.int64)
        else:
            try:
                array = np.array(ids) if ids else np.empty(0, np.int64)
            except (ValueError, OverflowError):  # ragged or out of range
                array = None
            if array is not None and array.dtype == np.int64 and array.ndim == 1:
                return array
    raise ValueError(f"{name!r}: expected a list of 64-bit integers, got {str(ids)[:60]}")


def _label(obj: dict, default: str) -> str:
    label = obj.get("class", default)
    if not isinstance(label, str):
        raise ValueError(f"'class': expected a string, got {label!r}")
    return label


# --- column assembly ---------------------------------------------------------------------------


class _Columns:
    """Parsed chunks as numpy arrays; ``finish`` concatenates, sorts and renumbers them once."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {
            n: [] for n in ("time_s", "label", "input", "output", "length", "ids")
        }
        self.label_to_code: dict[str, int] = {}
        self.num_skipped = 0
        self._num_requests = 0

    def reject(self, message: str, skip_bad: bool) -> None:
        """A malformed record: raise, or count and log it when skipping is allowed."""
        if not skip_bad:
            raise TraceFormatError(f"{message} (pass --skip-bad-lines to skip and count)")
        self.num_skipped += 1
        log.warning("skipped malformed record: %s", message)

    def code(self, label: str) -> int:
        return self.label_to_code.setdefault(label, len(self.label_to_code))

    def add_table(self, table: pa.Table, fmt: _JsonlFormat, options: LoadOptions) -> None:
        ids = table["hash_ids"].combine_chunks()
        self._add(
            time_s=table["timestamp"].to_numpy() * fmt.seconds_per_time_unit,
            label=self._label_codes(table[fmt.label_field], fmt, options),
            input=table["input_length"].to_numpy(),
            output=table["output_length"].fill_null(0).to_numpy(),
            length=pc.list_value_length(ids).to_numpy(zero_copy_only=False),
            ids=pc.list_flatten(ids).to_numpy(zero_copy_only=False),
        )

    def _label_codes(
        self, column: pa.ChunkedArray, fmt: _JsonlFormat, options: LoadOptions
    ) -> np.ndarray:
        encoded = column.combine_chunks().dictionary_encode()
        raw_labels = [*encoded.dictionary.to_pylist(), None]
        codes = np.array([self.code(fmt.class_label(r, options)) for r in raw_labels], np.int32)
        indices = encoded.indices.fill_null(len(raw_labels) - 1)
        return codes[indices.to_numpy(zero_copy_only=False)]

    def add_records(self, records: list[_Record], seconds_per_time_unit: float) -> None:
        if not records:
            return
        times, labels, inputs, outputs, id_lists = zip(*records, strict=True)
        self._add(
            time_s=np.array(times, np.float64) * seconds_per_time_unit,
            label=np.array([self.code(label) for label in labels], np.int32),
            input=np.array(inputs, np.int64),
            output=np.array(outputs, np.int64),
            length=np.array([len(ids) for ids in id_lists], np.int64),
            ids=np.concatenate([np.asarray(ids, np.int64) for ids in id_lists]),
        )

    def add_columns(
        self,
        times: Sequence[float],
        labels: Sequence[str],
        inputs: Sequence[int],
        outputs: Sequence[int],
        lengths: Sequence[int],
        ids: np.ndarray,
    ) -> None:
        """One file's requests, columns already checked (the session fast path)."""
        codes = {label: self.code(label) for label in dict.fromkeys(labels)}  # first-seen order
        self._add(
            time_s=np.array(times, np.float64),
            label=np.fromiter(map(codes.__getitem__, labels), np.int32, len(labels)),
            input=np.array(inputs, np.int64),
            output=np.array(outputs, np.int64),
            length=np.asarray(lengths, np.int64),
            ids=ids,
        )

    def _add(self, **arrays: np.ndarray) -> None:
        self._num_requests += len(arrays["time_s"])
        for name, array in arrays.items():
            self.parts[name].append(array)

    def num_requests(self) -> int:
        return self._num_requests

    def raw(
        self, block_tokens: int, partial_blocks: str, chain_roots: np.ndarray | None
    ) -> RawRequests:
        """The columns as parsed (file order), the partial tail cut when dropping."""
        if block_tokens < 1:
            raise ValueError(f"block tokens must be >= 1, got {block_tokens}")
        lengths, ids = self._concat("length", np.int64), self._concat("ids", np.int64)
        input_tokens = self._concat("input", np.int64)
        hashed_tokens = np.minimum(lengths * block_tokens, input_tokens)
        if partial_blocks == PARTIAL_DROP:
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            offsets, ids = cut_partial_blocks(offsets, ids, input_tokens // block_tokens)
            lengths = np.diff(offsets)
        return RawRequests(
            time_s=self._concat("time_s", np.float64),
            class_labels=tuple(self.label_to_code),
            class_codes=self._concat("label", np.int32),
            input_tokens=input_tokens,
            output_tokens=self._concat("output", np.int64),
            hashed_tokens=hashed_tokens,
            lengths=lengths,
            ids=ids,
            chain_roots=chain_roots,
            block_tokens=block_tokens,
            num_skipped=self.num_skipped,
        )

    def _concat(self, name: str, dtype: Any) -> np.ndarray:
        parts = self.parts[name]
        return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)

    def finish(
        self,
        block_tokens: int,
        chain: bool,
        partial_blocks: str = PARTIAL_DROP,
        chain_roots: np.ndarray | None = None,
    ) -> Trace:
        """The parsed requests in time order (stable) with dense ids; with ``chain`` the ids
        name single blocks and are chained first (``chain_identities``, from each request's
        ``chain_roots``, 0 by default: sessions pass their file's index)."""
        raw = self.raw(block_tokens, partial_blocks, None)
        order = np.argsort(raw.time_s, kind="stable")
        offsets = np.concatenate([[0], np.cumsum(raw.lengths)])
        offsets, raw_ids = reorder_segments(order, offsets, raw.ids)
        if chain:
            roots = np.zeros(len(order), np.int64) if chain_roots is None else chain_roots[order]
            raw_ids = chain_identities(offsets, raw_ids, roots)
        block_ids, distinct = dense_ids(raw_ids)
        num_blocks = len(distinct)
        class_names, class_ids = self._sorted_classes(raw.class_codes[order])
        return Trace(
            time_s=raw.time_s[order],
            class_ids=class_ids,
            input_tokens=raw.input_tokens[order],
            output_tokens=raw.output_tokens[order],
            hashed_tokens=raw.hashed_tokens[order],
            block_offsets=offsets,
            block_ids=block_ids,
            class_names=class_names,
            block_tokens=block_tokens,
            num_blocks=num_blocks,
            num_skipped=self.num_skipped,
        )

    def _sorted_classes(self, codes: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
        names = sorted(self.label_to_code)
        code_to_sorted = np.array([names.index(n) for n in self.label_to_code], np.int32)
        return tuple(names), code_to_sorted[codes] if len(codes) else codes


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
