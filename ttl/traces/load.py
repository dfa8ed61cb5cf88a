"""Loading a trace: a whole file (``load_trace``), records (``trace_from_records``), or a
trace cut into units that tasks parse on their own (``trace_units``, ``parse_unit``)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from ttl.errors import TraceFormatError
from ttl.traces.columns import Columns
from ttl.traces.jsonl import JSONL_FORMATS, load_jsonl, parse_jsonl_chunks, read_line_chunks
from ttl.traces.model import (
    DEFAULT_BLOCK_TOKENS,
    FORMATS,
    PARTIAL_DROP,
    SESSIONS,
    BytesProgress,
    LoadOptions,
    MiB,
    RawRequests,
    Trace,
    TraceUnit,
)
from ttl.traces.sessions import (
    load_sessions,
    read_session_files,
    session_block_tokens,
    session_files,
)


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
        return load_sessions(path, options, progress)
    return load_jsonl(path, JSONL_FORMATS[fmt], options, progress)


def trace_from_records(
    records: list[tuple[float, str, int, int, list[int]]],
    block_tokens: int,
    chain: bool,
    partial_blocks: str = PARTIAL_DROP,
) -> Trace:
    """A trace from ``(time_s, class, input_tokens, output_tokens, block_ids)`` records;
    ``chain`` treats the ids as per-block (like Bailian's) rather than prefix-chained."""
    columns = Columns()
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


def trace_units(path: str | Path, fmt: str, unit_bytes: int = 64 * MiB) -> list[TraceUnit]:
    """Split a trace into units of about ``unit_bytes``, cut at line (or file) boundaries."""
    path = _check_source(Path(path), fmt)
    if fmt == SESSIONS:
        files = session_files(path)
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
        columns = Columns()
        block_sizes, roots = read_session_files(unit.session_files, options, columns)
        block_tokens = session_block_tokens(unit.path, block_sizes, options.block_tokens)
        return columns.raw(block_tokens, options.partial_blocks, roots)
    jsonl = JSONL_FORMATS[fmt]
    columns = Columns()
    # Lines are numbered from the unit's start; the unit's own first line number (a count of
    # the file's lines before it) is only needed, and counted, for an error message.
    chunks = read_line_chunks(unit.path, options.chunk_bytes, unit.start, unit.end)
    lines_before = functools.cache(lambda: _line_number(unit.path, unit.start) - 1)
    parse_jsonl_chunks(chunks, unit.path, jsonl, options, columns, lines_before)
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
