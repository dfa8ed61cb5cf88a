"""e4m3x16 for adapters whose store blocks are runs of the engine's own KV memory (SGLang's
host-pool pages and their K and V runs): a block of N values of the pool's dtype is stored as
``[N e4m3 bytes | N/16 bf16 scales]`` (engine_adapter/kv_format.py's codec, groups of 16
consecutive values: along the head dimension, the innermost in every layout SGLang has).

    encode_runs(views, dtype)            -> the quantised blocks to put (one new buffer each)
    staging_for(views, dtype)            -> buffers of the quantised size to read into
    decode_runs(staging, views, dtype)   -> dequantised into the views; False for a block
                                            holding a non-finite scale (the quantiser's mark
                                            for KV that held inf or NaN): a miss, never KV
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine_adapter import kv_format
from engine_adapter.kv_layout import E4M3X16_GROUP_VALUES as GROUP_VALUES
from engine_adapter.kv_layout import e4m3x16_bytes


def _values(view: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """``view``'s bytes as [N / 16, 16] values of ``dtype`` (no copy)."""
    values = torch.frombuffer(view, dtype=torch.uint8).view(dtype)
    if values.numel() % GROUP_VALUES:
        raise ValueError(
            f"e4m3x16 needs whole groups of {GROUP_VALUES} values; a block of "
            f"{values.numel()} values has a partial one"
        )
    return values.view(-1, GROUP_VALUES)


def encode_runs(views: Sequence[memoryview], dtype: torch.dtype) -> list[memoryview]:
    """Each view's values quantised into a new ``[values | scales]`` buffer."""
    out = []
    for view in views:
        values = _values(view, dtype)
        block = torch.empty(e4m3x16_bytes(values.numel()), dtype=torch.uint8)
        codes, scales = kv_format.split_layer(block, (1, 1, *values.shape))
        codes, scales = codes.view(values.shape), scales.view(-1, 1)
        got_codes, got_scales = kv_format.quantize(values)
        codes.copy_(got_codes)
        scales.copy_(got_scales)
        out.append(memoryview(block.numpy()))
    return out


def staging_for(views: Sequence[memoryview], dtype: torch.dtype) -> list[memoryview]:
    """A buffer of each view's quantised size, to read its stored block into."""
    size = torch.empty((), dtype=dtype).element_size()
    return [
        memoryview(torch.empty(e4m3x16_bytes(v.nbytes // size), dtype=torch.uint8).numpy())
        for v in views
    ]


def decode_runs(
    staging: Sequence[memoryview],
    views: Sequence[memoryview],
    dtype: torch.dtype,
    landed: Sequence[bool],
) -> list[bool]:
    """Dequantise each landed block of ``staging`` into its view; the blocks now in place
    (a block with a non-finite scale stays out and reads as a miss)."""
    placed = []
    for block, view, ok in zip(staging, views, landed, strict=True):
        if not ok:
            placed.append(False)
            continue
        values = _values(view, dtype)
        raw = torch.frombuffer(block, dtype=torch.uint8)
        codes, scales = kv_format.split_layer(raw, (1, 1, *values.shape))
        codes, scales = codes.view(values.shape), scales.view(-1, 1)
        if not bool(torch.isfinite(scales).all()):
            placed.append(False)
            continue
        kv_format.dequantize(codes, scales, values)
        placed.append(True)
    return placed
