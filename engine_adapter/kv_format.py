"""KV block formats: how a block's values are encoded in the store, and the codec between that
encoding and the paged cache.

Two formats (``KVBlockLayout.kv_format``):

- ``dtype`` (the default): raw values of the engine's compute dtype (``kv_layout``'s diagram).
- ``e4m3x16``: DeepSeek's per-16 FP8 format ("close to NVFP4 without the global scale"):
  every 16 consecutive values along the head dimension share one scale; each value is a
  float8_e4m3fn, each scale a bf16. 1 + 2/16 = 1.125 bytes per value, 0.5625 of bf16. Still
  layer-major, so layer-wise loads work as before::

    block = [layer 0 | layer 1 | ... | layer L-1]
    layer = [values: P*H*T*D e4m3 bytes | scales: P*H*T*(D/16) bf16, little-endian]
    values in (parts, kv_heads, block_tokens, head_dim) order; the scale of values
    [..., 16g : 16g+16] is scales[..., g]

Why a bf16 scale and not an e8m0 byte (MX's power of two, 1.0625 bytes per value, the first
encoding): a group's scale is amax / 448 rounded up to a bf16, so its largest value lands in
(444.5, 448] and comes back within 2**-7, where a power-of-two scale leaves it anywhere in
(224, 448] with e4m3's full rounding error (up to 2**-4). Those largest values weigh most in
attention's dot products: on SmolLM2 (``kvstore bench accuracy``, 2,048 positions) top-1 agreement
went from 97.80% to the 98% target and beyond, and no one-byte scale tried reached it
(docs/engine.md has the measurements). Rounding up means nothing saturates below the cap.
Scales are clamped to [2**-126, 2**7]: an all-zero group still has a finite inverse, and
values beyond 448 * 2**7 = 57,344 saturate, so an fp16 engine never reads an inf (fp16 tops
out at 65,504). A NaN scale is the quantiser's mark for a group holding inf or NaN; a reader
treats a block holding a non-finite scale as a miss (:func:`num_valid_blocks`).

Every step is an exact operation or one IEEE rounding to nearest even (the division amax /
448, the reciprocal, the product, the e4m3 cast; dequantising: one product, exact, then the
cast to the compute dtype), so the C kernel (``e4m3x16.c``, the CPU path) gives the torch
ops' bits (the GPU path, and the reference).

Quantise where the KV lives (the device, or the CPU), in batch; dequantise after the bytes
land, layer by layer, straight into the pool (on the swap-in's side stream on CUDA).
"""

from __future__ import annotations

import numpy as np
import torch

from engine_adapter import e4m3x16_native
from engine_adapter.kv_layout import E4M3X16_GROUP_VALUES as GROUP_VALUES
from engine_adapter.kv_layout import KV_FORMATS
from engine_adapter.paged_kv import PagedKVCache

DTYPE_FORMAT, E4M3X16 = KV_FORMATS
E4M3_MAX = 448.0
MIN_SCALE = 2.0**-126  # bf16's smallest normal: an all-zero group still has a finite inverse
MAX_SCALE = 2.0**7  # values up to 448 * 2**7 = 57,344 (fp16 tops out at 65,504); more saturate
_E4M3_BIAS_GAP = 2.0**120  # bf16/fp32 exponent bias 127 minus e4m3's 7
_MIN_SCALE_BITS, _MAX_SCALE_BITS = 0x00800000, 0x43000000  # MIN_SCALE, MAX_SCALE as fp32 bits
_NAN_SCALE_BITS = 0x7FC00000  # the fp32 bits of bf16's NaN 0x7FC0
_BF16_EXPONENT_BITS = 0x7F80  # a bf16 whose exponent bits are all set is inf or NaN


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] (D a multiple of 16) -> (e4m3 values as uint8 [..., D], bf16 scales
    [..., D/16]): the C kernel on CPU when built, else :func:`torch_quantize`."""
    if e4m3x16_native.usable(x):
        return e4m3x16_native.quantize(x)
    return torch_quantize(x)


def torch_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` as one batch of torch ops on ``x``'s device (the GPU path, and the
    reference of the semantics that ``e4m3x16.c`` follows bit for bit)."""
    *lead, dim = x.shape
    groups = x.reshape(*lead, dim // GROUP_VALUES, GROUP_VALUES)  # [..., G, 16]
    low, high = torch.aminmax(groups, dim=-1)  # one pass, no |x| materialised
    amax = torch.maximum(-low, high).float()  # [..., G]
    # amax / 448 rounded up to a bf16 (adding 0xFFFF to the fp32 bits carries unless the low
    # half is zero), so a group's largest value lands within 2**-8 of 448: nearly exact.
    # The clamp and the NaN mark (the quantiser's, for a group holding inf or NaN: its block
    # is a miss) on the bits too: positive floats order as their bits, and a NaN's bits
    # would depend on the conversion that made them.
    bits = ((amax / E4M3_MAX).view(torch.int32) + 0xFFFF).bitwise_and_(-0x10000)
    bits = bits.clamp_(_MIN_SCALE_BITS, _MAX_SCALE_BITS)
    bits = torch.where(torch.isfinite(amax), bits, _NAN_SCALE_BITS)  # [..., G]
    inverse = torch.reciprocal(bits.view(torch.float32)).unsqueeze(-1)  # [..., G, 1] fp32
    scaled = (groups.float() * inverse).clamp_(-E4M3_MAX, E4M3_MAX)  # [..., G, 16]
    values = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*lead, dim)
    return values, (bits >> 16).to(torch.int16).view(torch.bfloat16)  # exact: low half is 0


def dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode ``values`` [..., D] (uint8, e4m3 bits) with ``scales`` [..., D/16] (bf16) into
    ``out`` [..., D] (bf16, fp16 or fp32, any strides: e.g. a permuted view of the pool): the
    C kernel on CPU when built, else :func:`torch_dequantize`."""
    if e4m3x16_native.usable(values, scales, out):
        return e4m3x16_native.dequantize(values, scales, out)
    return torch_dequantize(values, scales, out)


def torch_dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize` as torch ops (the GPU path, and the reference ``e4m3x16.c`` follows).

    torch's fp8 conversion is scalar on CPU, so the bits are moved instead: sign-extending an
    e4m3 byte to 16 bits and shifting it left 4 puts its exponent and mantissa where bf16
    keeps them (bf16 subnormals cover e4m3's): the value times 2**-120. One fp32 multiply by
    2**120 * scale (exact: 4 significant bits times 8) finishes it; then one rounding to
    ``out``'s dtype.
    """
    dim = values.shape[-1]
    bits = values.view(torch.int8).to(torch.int16).bitwise_left_shift_(4)
    as_bf16 = bits.bitwise_and_(0x87F0 - 0x10000).view(torch.bfloat16)  # sign|exp|mantissa
    multiplier = scales.float() * _E4M3_BIAS_GAP  # [..., G] fp32, exact
    grouped = out.unflatten(-1, (dim // GROUP_VALUES, GROUP_VALUES))  # a view: D is dense
    torch.mul(as_bf16.unflatten(-1, grouped.shape[-2:]), multiplier.unsqueeze(-1), out=grouped)
    return out


def split_layer(raw: torch.Tensor, part_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """One layer's bytes ``raw`` [..., layer_bytes] (uint8) as (values [..., P, H, T, D],
    bf16 scales [..., P, H, T, D/16]); ``part_shape`` is (P, H, T, D)."""
    *lead, _ = raw.shape
    num_values = part_shape[0] * part_shape[1] * part_shape[2] * part_shape[3]
    *front, dim = part_shape
    values = raw[..., :num_values].view(*lead, *part_shape)
    scales = raw[..., num_values:].view(torch.bfloat16).view(*lead, *front, dim // GROUP_VALUES)
    return values, scales


def encode_block(kv: torch.Tensor, out: torch.Tensor) -> None:
    """Quantise blocks' KV ``kv`` [..., L, P, H, T, D] (the device's) into ``out`` [..., L,
    layer_bytes] (uint8, e.g. a host slot): on CPU straight into ``out`` (the C kernel), else
    quantised on the device and copied (non_blocking)."""
    values, scales = split_layer(out, tuple(kv.shape[-4:]))
    if e4m3x16_native.usable(kv, values, scales):
        e4m3x16_native.quantize_into(kv, values, scales)
        return
    got_values, got_scales = torch_quantize(kv)
    values.copy_(got_values, non_blocking=True)
    scales.copy_(got_scales, non_blocking=True)


def decode_layer(raw: torch.Tensor, part_shape: tuple[int, ...], out: torch.Tensor) -> None:
    """Dequantise layers of blocks, ``raw`` [..., layer_bytes], into ``out`` [..., P, H, T, D]
    (a view of the pool is fine)."""
    values, scales = split_layer(raw, part_shape)
    dequantize(values, scales, out)


def num_valid_blocks(blocks: list[torch.Tensor], part_shape: tuple[int, ...]) -> int:
    """How many leading e4m3x16 blocks (each [L, layer_bytes] uint8, on the host) have only
    finite scales: a block holding a NaN (the quantiser's mark for a group holding inf or NaN)
    or an inf scale is a miss, never values in the cache.

    numpy, on the calling thread: torch's CPU ops run this size in parallel on every core, and
    on a 16-core GPU host their OpenMP threads then spun beside the nodes' reads (4.2 CPU-s
    per GB of the client for a 256-block fetch, and a slower fetch: docs/runs/wave6-gpu)."""
    num_values = part_shape[0] * part_shape[1] * part_shape[2] * part_shape[3]
    for index, block in enumerate(blocks):
        scale_bits = block.numpy()[:, num_values:].view(np.uint16)  # bf16 scales' bits
        # A bf16 is inf or NaN when its exponent is all ones: magnitude bits >= 0x7F80.
        if int(np.bitwise_and(scale_bits, 0x7FFF).max(initial=0)) >= _BF16_EXPONENT_BITS:
            return index
    return len(blocks)


def save_block(cache: PagedKVCache, block_id: int, out: torch.Tensor) -> None:
    """Serialise all layers of pool block ``block_id`` into ``out`` (``HostSlot.block``) in
    the cache layout's format: quantised on the cache's device for e4m3x16."""
    if not cache.layout.quantized:
        cache.save_block(block_id, out)
        return
    t = cache.layout.block_tokens
    encode_block(cache.kv[:, :, :, block_id * t : (block_id + 1) * t], out)  # [L, P, H, T, D]


def load_layer(
    cache: PagedKVCache, layer: int, block_ids: list[int], blocks: list[torch.Tensor] | torch.Tensor
) -> None:
    """Layer ``layer`` of serialised blocks (``HostSlot.block``s, or a stack of them) into the
    pool blocks ``block_ids``: a copy, or an e4m3x16 dequantisation (:func:`load_layers`)."""
    if not cache.layout.quantized:
        cache.load_layer(layer, block_ids, blocks)
        return
    load_layers(cache, layer, layer + 1, block_ids, blocks)


def load_layers(
    cache: PagedKVCache,
    first_layer: int,
    end_layer: int,
    block_ids: list[int],
    blocks: list[torch.Tensor] | torch.Tensor,
) -> None:
    """Dequantise layers [first_layer, end_layer) of e4m3x16 blocks (``HostSlot.block``s, or a
    stack of them) straight into the pool blocks ``block_ids``: one batch of ops for the whole
    range when the ids are consecutive (few ops matter on a loaded CPU, where every parallel
    op waits for its threads to be scheduled)."""
    layout = cache.layout
    if isinstance(blocks, torch.Tensor):
        raw = blocks[:, first_layer:end_layer]  # [n, layers, layer_bytes]
    else:
        raw = torch.stack([block[first_layer:end_layer] for block in blocks])
    parts, heads, t, dim = layout.part_shape
    first, n, num_layers = block_ids[0] if block_ids else 0, len(block_ids), end_layer - first_layer
    if block_ids == list(range(first, first + n)):
        dest = cache.kv[first_layer:end_layer, :, :, first * t : (first + n) * t]
        dest = dest.view(num_layers, parts, heads, n, t, dim).permute(3, 0, 1, 2, 4, 5)
        decode_layer(raw, layout.part_shape, dest)  # [n, layers, P, H, T, D]
        return
    for index, block_id in enumerate(block_ids):
        dest = cache.kv[first_layer:end_layer, :, :, block_id * t : (block_id + 1) * t]
        decode_layer(raw[index : index + 1], layout.part_shape, dest[None])
