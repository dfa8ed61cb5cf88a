"""The e4m3x16 codec's CPU kernels compiled: ``engine_adapter/e4m3x16.c`` through ctypes.

``kv_format.py``'s torch ops are the reference of the semantics and the GPU path; on CPU
they make about eight passes over the KV to quantise and four to dequantise, each waiting
for torch's intra-op threads (6-12 CPU-s per GB of bf16 KV on the 2-core VM). The C kernels
make one pass each way on the calling thread (ctypes lets go of the GIL meanwhile) and give
the same bits (``tests/engine_adapter/test_e4m3x16_native.py``): AVX-512 ones where the CPU
has them (:data:`KERNEL`), else portable loops; ``kernel=`` picks one (the tests run each).
``make native`` builds ``engine_adapter/_e4m3x16.so``; without it (no compiler, or
``KVSTORE_NATIVE=0``) the torch ops run.

Tensors reach C as rows: a row is a run of values contiguous in every tensor of the call (the
trailing dimensions that are dense everywhere, merged), and each tensor gets one offset per
row (:func:`rows`). So a strided view of the paged cache (one block of every layer, or
consecutive blocks of a layer range) is one call, with no copy; the offsets of a shape are
built once and cached (the engine repeats a few shapes).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

LIBRARY_PATH = Path(__file__).with_name("_e4m3x16.so")
GROUP_VALUES = 16
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # e4m3x16.c's DTYPE_*


def _load() -> ctypes.CDLL | None:
    if os.environ.get("KVSTORE_NATIVE", "1") == "0" or not LIBRARY_PATH.exists():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY_PATH))
    except OSError as exc:
        log.warning("not using %s (%s): the e4m3x16 codec runs torch ops", LIBRARY_PATH, exc)
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.e4m3x16_quantize.argtypes = [ptr, ctypes.c_int, *[ptr] * 5, i64, i64, ctypes.c_int]
    lib.e4m3x16_quantize.restype = None
    lib.e4m3x16_dequantize.argtypes = [*[ptr] * 5, ctypes.c_int, ptr, i64, i64, ctypes.c_int]
    lib.e4m3x16_dequantize.restype = None
    lib.e4m3x16_simd.restype = ctypes.c_int
    return lib


_lib = _load()
NATIVE = _lib is not None
#: e4m3x16.c's kernels by level: the plain C loops; AVX-512 (F, BW, DQ, VBMI); the same with
#: AVX512_BF16's rounding for bf16 dequantisation. Every one gives the same bits.
KERNELS = ("portable", "avx512", "avx512bf16")
#: the kernels this CPU runs, the fastest (every call's default) last; () without the library
AVAILABLE_KERNELS = () if _lib is None else KERNELS[: _lib.e4m3x16_simd() + 1]
KERNEL = AVAILABLE_KERNELS[-1] if AVAILABLE_KERNELS else None


def _level(kernel: str | None) -> int:
    return len(AVAILABLE_KERNELS) - 1 if kernel is None else KERNELS.index(kernel)


def rows(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[int, list[torch.Tensor]]:
    """Cut tensors of one logical ``shape`` (each given by its ``strides``, last one 1) into
    rows: (values per row, one int64 offset tensor per tensor, an element offset per row).

    Trailing dimensions merge into the row while every tensor is dense across them; the
    leading ones enumerate the rows (few: e.g. layers x parts x heads of a block)."""
    row, lead = shape[-1], len(shape) - 1
    while lead > 0 and (shape[lead - 1] == 1 or all(s[lead - 1] == row for s in strides)):
        lead -= 1
        row *= shape[lead]
    offsets = [torch.zeros(1, dtype=torch.int64) for _ in strides]
    for dim in range(lead):
        index = torch.arange(shape[dim], dtype=torch.int64)
        offsets = [
            (o[:, None] + index * s[dim]).reshape(-1) for o, s in zip(offsets, strides, strict=True)
        ]
    return row, offsets


class _Rows(NamedTuple):
    """One call's rows (:func:`rows`): the offset tensors, kept alive with their addresses."""

    row_values: int
    num_rows: int
    addresses: tuple[int, int, int]  # the offset arrays of (the fp tensor, values, scales)
    offsets: tuple[torch.Tensor, ...]


@functools.lru_cache(maxsize=512)
def _rows_of(
    shape: tuple[int, ...], data: tuple[int, ...], values: tuple[int, ...], scales: tuple[int, ...]
) -> _Rows:
    """:func:`rows` for one call's fp tensor, e4m3 values and bf16 scales (strides ``data``,
    ``values``, ``scales``), scale offsets in scales. Cached: the engine's calls repeat a few
    shapes (one block; a layer range of n blocks), and building the offsets is several small
    torch ops, 0.1 ms: about what the kernel takes for one SmolLM2 block."""
    scale_strides = (*(s * GROUP_VALUES for s in scales[:-1]), 1)  # in values: rows merge alike
    row, offsets = rows(shape, data, values, scale_strides)
    offsets[2] //= GROUP_VALUES  # in scales
    addresses = (offsets[0].data_ptr(), offsets[1].data_ptr(), offsets[2].data_ptr())
    return _Rows(row, len(offsets[0]), addresses, tuple(offsets))


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: all on CPU, the last dimension dense."""
    return NATIVE and all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def quantize(x: torch.Tensor, *, kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kv_format.quantize` in one pass: ``x`` [..., D] (fp32, bf16 or fp16, on CPU)
    -> (e4m3 bytes [..., D], bf16 scales [..., D/16]), both new and dense. ``kernel``: one
    of :data:`AVAILABLE_KERNELS` (the tests run each), by default the fastest."""
    values = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // GROUP_VALUES), dtype=torch.bfloat16)
    return quantize_into(x, values, scales, kernel=kernel)


def quantize_into(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, *, kernel: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` into given ``values`` and ``scales`` of any strides but a dense last
    dimension (e.g. the two parts of a host slot's layers: no allocation, no copy)."""
    assert _lib is not None and x.dtype in _DTYPE_CODES, f"not for {x.dtype} on {x.device}"
    if x.numel():
        plan = _rows_of(tuple(x.shape), x.stride(), values.stride(), scales.stride())
        source, value, scale = plan.addresses
        _lib.e4m3x16_quantize(
            x.data_ptr(), _DTYPE_CODES[x.dtype], source, values.data_ptr(), value,
            scales.data_ptr(), scale, plan.num_rows, plan.row_values, _level(kernel),
        )  # fmt: skip
    return values, scales


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, kernel: str | None = None
) -> torch.Tensor:
    """:func:`kv_format.dequantize` in one pass, into ``out`` (any strides but a dense last
    dimension: e.g. a permuted view of the pool)."""
    assert _lib is not None and out.dtype in _DTYPE_CODES, f"not for {out.dtype}"
    if out.numel():
        plan = _rows_of(tuple(out.shape), out.stride(), values.stride(), scales.stride())
        dest, value, scale = plan.addresses
        _lib.e4m3x16_dequantize(
            values.data_ptr(), value, scales.data_ptr(), scale, out.data_ptr(),
            _DTYPE_CODES[out.dtype], dest, plan.num_rows, plan.row_values, _level(kernel),
        )  # fmt: skip
    return out
