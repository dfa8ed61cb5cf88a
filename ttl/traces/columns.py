"""Parsed records into numpy columns: the Python path's field checks and ``Columns``, which
concatenates, sorts and renumbers a format's chunks once."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ttl.errors import TraceFormatError
from ttl.traces.ids import chain_identities, cut_partial_blocks, dense_ids, reorder_segments
from ttl.traces.model import PARTIAL_DROP, LoadOptions, RawRequests, Record, Trace

if TYPE_CHECKING:  # jsonl builds on these columns
    from ttl.traces.jsonl import JsonlFormat

log = logging.getLogger(__name__)


def check_finite(obj: dict, name: str, default: float | None = None) -> float:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name!r}: expected a finite number, got {value!r}")
    return float(value)


def check_count(obj: dict, name: str, default: int | None = None) -> int:
    value = obj.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name!r}: expected a non-negative integer, got {value!r}")
    return value


def check_id_list(obj: dict, name: str, check_each: bool = True) -> np.ndarray:
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


def check_label(obj: dict, default: str) -> str:
    label = obj.get("class", default)
    if not isinstance(label, str):
        raise ValueError(f"'class': expected a string, got {label!r}")
    return label


# --- column assembly ---------------------------------------------------------------------------


class Columns:
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

    def add_table(self, table: pa.Table, fmt: JsonlFormat, options: LoadOptions) -> None:
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
        self, column: pa.ChunkedArray, fmt: JsonlFormat, options: LoadOptions
    ) -> np.ndarray:
        encoded = column.combine_chunks().dictionary_encode()
        raw_labels = [*encoded.dictionary.to_pylist(), None]
        codes = np.array([self.code(fmt.class_label(r, options)) for r in raw_labels], np.int32)
        indices = encoded.indices.fill_null(len(raw_labels) - 1)
        return codes[indices.to_numpy(zero_copy_only=False)]

    def add_records(self, records: list[Record], seconds_per_time_unit: float) -> None:
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
