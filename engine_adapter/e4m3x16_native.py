"""The e4m3x16 codec's CPU kernels compiled: ``engine_adapter/e4m3x16.c`` through ctypes.

``kv_format.py``'s torch ops are the reference of the semantics and the GPU path; on CPU
they make about eight passes over the KV to quantise and four to dequantise, each waiting
for torch's intra-op threads (6-12 CPU-s per GB of bf16 KV on the 2-core VM). The C kernel
makes one pass each way on the calling thread (ctypes lets go of the GIL meanwhile) and gives
the same bits (``tests/engine_adapter/test_e4m3x16_native.py``). ``make native`` builds
``engine_adapter/_e4m3x16.so``; without it (no compiler, or ``KVSTORE_NATIVE=0``) the torch
ops run.

Tensors reach C as rows: a row is a run of values contiguous in every tensor of the call (the
trailing dimensions that are dense everywhere, merged), and each tensor gets one offset per
row (:func:`rows`). So a strided view of the paged cache (one block of every layer, or
consecutive blocks of a layer range) is one call, with no copy.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

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
    lib.e4m3x16_quantize.argtypes = [ptr, ctypes.c_int, *[ptr] * 5, i64, i64]
    lib.e4m3x16_quantize.restype = None
    lib.e4m3x16_dequantize.argtypes = [*[ptr] * 5, ctypes.c_int, ptr, i64, i64]
    lib.e4m3x16_dequantize.restype = None
    return lib


_lib = _load()
NATIVE = _lib is not None


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


def _scale_strides(scales: torch.Tensor) -> tuple[int, ...]:
    """``scales`` [..., D/16]'s strides in value units: one scale stands for 16 values, so the
    rows of values and of scales merge alike."""
    return (*(s * GROUP_VALUES for s in scales.stride()[:-1]), 1)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: all on CPU, the last dimension dense."""
    return NATIVE and all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)


def _address(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kv_format.quantize` in one pass: ``x`` [..., D] (fp32, bf16 or fp16, on CPU)
    -> (e4m3 bytes [..., D], bf16 scales [..., D/16]), both new and dense."""
    values = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // GROUP_VALUES), dtype=torch.bfloat16)
    return quantize_into(x, values, scales)


def quantize_into(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` into given ``values`` and ``scales`` of any strides but a dense last
    dimension (e.g. the two parts of a host slot's layers: no allocation, no copy)."""
    assert _lib is not None and x.dtype in _DTYPE_CODES, f"not for {x.dtype} on {x.device}"
    if x.numel():
        row, (source, value, scale) = rows(
            tuple(x.shape), x.stride(), values.stride(), _scale_strides(scales)
        )
        scale //= GROUP_VALUES  # in scales
        _lib.e4m3x16_quantize(
            _address(x), _DTYPE_CODES[x.dtype], _address(source), _address(values),
            _address(value), _address(scales), _address(scale), len(source), row,
        )  # fmt: skip
    return values, scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`kv_format.dequantize` in one pass, into ``out`` (any strides but a dense last
    dimension: e.g. a permuted view of the pool)."""
    assert _lib is not None and out.dtype in _DTYPE_CODES, f"not for {out.dtype}"
    if out.numel():
        row, (value, scale, dest) = rows(
            tuple(out.shape), values.stride(), _scale_strides(scales), out.stride()
        )
        scale //= GROUP_VALUES  # in scales
        _lib.e4m3x16_dequantize(
            _address(values), _address(value), _address(scales), _address(scale),
            _address(out), _DTYPE_CODES[out.dtype], _address(dest), len(value), row,
        )  # fmt: skip
    return out
