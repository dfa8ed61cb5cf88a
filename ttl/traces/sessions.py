"""Session files (one JSON document per conversation): a msgspec fast path, and a checking
path that names what is wrong in a file the fast path does not take."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import UNSET, UnsetType

from ttl.errors import TraceFormatError
from ttl.traces.columns import (
    Columns,
    check_count,
    check_finite,
    check_id_list,
    check_label,
)
from ttl.traces.model import BytesProgress, LoadOptions, Record, Trace


def session_files(path: Path) -> list[Path]:
    # Sorted by name (the order of Paths in one folder), not by Path: comparing Paths costs
    # more than reading a small file.
    files = sorted(path.glob("*.json"), key=lambda file: file.name) if path.is_dir() else [path]
    if not files:
        raise TraceFormatError(f"{path}: no *.json session files in this folder")
    return files


def load_sessions(path: Path, options: LoadOptions, progress: BytesProgress) -> Trace:
    files = session_files(path)
    sizes = np.cumsum([0, *(file.stat().st_size for file in files)])
    columns = Columns()
    block_sizes, file_of_request = read_session_files(
        list(enumerate(files)), options, columns, lambda num: progress(sizes[num], sizes[-1])
    )
    block_tokens = session_block_tokens(path, block_sizes, options.block_tokens)
    return columns.finish(block_tokens, True, options.partial_blocks, file_of_request)


_SESSION_BATCH = 256  # files whose requests the fast path converts to arrays together


def read_session_files(
    files: Sequence[tuple[int, Path]],
    options: LoadOptions,
    columns: Columns,
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


def _add_sessions_fast(batch: list[list], columns: Columns) -> bool:
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


def _read_session_file(file: Path, options: LoadOptions, columns: Columns) -> int | None:
    """Add one session file's requests to ``columns``; its block size, or None if skipped:
    the fast path (``read_session_files``) for one file, else the checking path."""
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
    file: Path, raw: bytes, options: LoadOptions, columns: Columns
) -> tuple[int, list[Record]] | None:
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
        block_size = check_count(doc, "block_size")
        if block_size < 1:
            raise ValueError(f"'block_size' must be >= 1, got {block_size}")
        records: list[Record] = []
        label = check_label(doc, options.default_class)
        start_s = check_finite(doc, "t", default=0.0)
        _walk_session(doc, start_s, label, "", records, check_each_id)
    except ValueError as exc:
        columns.reject(f"{file}: {exc}", options.skip_bad)
        return None
    return block_size, records


def _walk_session(
    node: dict, start_s: float, label: str, where: str, out: list[Record], check_each_id: bool
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
        return start_s + check_finite(req, "t"), check_label(req, label)
    except ValueError as exc:
        raise ValueError(f"{here}: {exc}") from None


def _session_request(
    req: dict, time_s: float, label: str, here: str, check_each_id: bool
) -> Record:
    try:
        num_in, num_out = check_count(req, "in"), check_count(req, "out", 0)
        return (time_s, label, num_in, num_out, check_id_list(req, "hash_ids", check_each_id))
    except ValueError as exc:
        raise ValueError(f"{here}: {exc}") from None


def session_block_tokens(path: Path, block_sizes: set[int], requested: int | None) -> int:
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
