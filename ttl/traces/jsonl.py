"""The JSONL formats (Mooncake, Qwen-Bailian): chunks of whole lines parsed by pyarrow, and a
line-by-line Python path that names a malformed line."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from ttl.traces.columns import Columns, check_count, check_finite, check_id_list
from ttl.traces.model import (
    BAILIAN,
    DEFAULT_BLOCK_TOKENS,
    MOONCAKE,
    BytesProgress,
    LoadOptions,
    Record,
    Trace,
)


@dataclass(frozen=True)
class JsonlFormat:
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
JSONL_FORMATS = {
    MOONCAKE: JsonlFormat(
        MOONCAKE, pa.schema([*_COMMON_FIELDS, ("class", pa.string())]), 1e-3, "class", True
    ),
    BAILIAN: JsonlFormat(
        BAILIAN, pa.schema([*_COMMON_FIELDS, ("type", pa.string())]), 1.0, "type", False
    ),
}


def load_jsonl(
    path: Path, fmt: JsonlFormat, options: LoadOptions, progress: BytesProgress
) -> Trace:
    columns = Columns()
    total, done = path.stat().st_size, 0

    def counted(chunks: Iterator[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
        nonlocal done
        for chunk in chunks:
            yield chunk
            done += len(chunk[1])
            progress(done, total)

    chunks = counted(read_line_chunks(path, options.chunk_bytes))
    parse_jsonl_chunks(chunks, path, fmt, options, columns)
    block_tokens = options.block_tokens or DEFAULT_BLOCK_TOKENS[fmt.name]
    return columns.finish(block_tokens, not fmt.chained, options.partial_blocks)


def parse_jsonl_chunks(
    chunks: Iterator[tuple[int, bytes]],
    path: Path,
    fmt: JsonlFormat,
    options: LoadOptions,
    columns: Columns,
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


def read_line_chunks(
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


def _parse_chunk_arrow(chunk: bytes, fmt: JsonlFormat) -> pa.Table | None:
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
    fmt: JsonlFormat,
    options: LoadOptions,
    columns: Columns,
) -> list[Record]:
    records = []
    for offset, line in enumerate(chunk.split(b"\n")):
        if not line.strip():
            continue
        try:
            records.append(_record_from_json_line(line, fmt, options))
        except ValueError as exc:
            columns.reject(f"{path}:{first_line + offset}: {exc}", options.skip_bad)
    return records


def _record_from_json_line(line: bytes, fmt: JsonlFormat, options: LoadOptions) -> Record:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    label = obj.get(fmt.label_field)
    if label is not None and not isinstance(label, str):
        raise ValueError(f"{fmt.label_field!r}: expected a string, got {label!r}")
    return (
        check_finite(obj, "timestamp"),
        fmt.class_label(label, options),
        check_count(obj, "input_length"),
        check_count(obj, "output_length", default=0),
        check_id_list(obj, "hash_ids"),
    )
