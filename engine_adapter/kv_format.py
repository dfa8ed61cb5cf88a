"""KV block formats: how a block's values are encoded in the store, and the codec between that
encoding and the paged cache.

Two formats (``KVBlockLayout.kv_format``):

- ``dtype`` (the default): raw values of the engine's compute dtype (``kv_layout``'s diagram).
- ``e4m3x16``: DeepSeek's per-16 FP8 format ("close to NVFP4 without the global scale"):
  every 16 consecutive values along the head dimension share one scale; each value is a
  float8_e4m3fn, each scale an e8m0 byte (a power of two, 2**(byte - 127), MX's encoding).
  1 + 1/16 = 1.0625 bytes per value, 0.53 of bf16. Still layer-major, so layer-wise loads
  work as before::

    block = [layer 0 | layer 1 | ... | layer L-1]
    layer = [values: P*H*T*D e4m3 bytes | scales: P*H*T*(D/16) e8m0 bytes]
    values in (parts, kv_heads, block_tokens, head_dim) order; the scale of values
    [..., 16g : 16g+16] is scales[..., g]

Why e8m0 and not bf16 scales: a power-of-two scale makes quantising and dequantising exact
multiplications (only the e4m3 rounding loses precision, at most 2**-4 relative); e4m3 has the
same relative precision at every normal magnitude, so a scale that is not a power of two buys
nothing but one binade of headroom for a group's smallest values, and it would cost one more
byte per 16 values (1.125 bytes per value). The scale of a group is the smallest power of two
that puts its largest magnitude at or below 448 (e4m3's largest), so nothing saturates.
Byte 255 is e8m0's NaN: the quantiser writes it for a group holding inf or NaN, and a reader
treats any block holding it as a miss (:func:`num_valid_blocks`). Scales are capped at 2**7
(magnitudes up to 57,344; fp16 tops out at 65,504) so that dequantising needs no second
multiply (see :func:`dequantize`); larger values saturate.

Quantise where the KV lives (the device, or the CPU), in batch; dequantise after the bytes
land, layer by layer, straight into the pool (on the swap-in's side stream on CUDA).
"""

from __future__ import annotations

import torch

from engine_adapter.kv_layout import E4M3X16_GROUP_VALUES as GROUP_VALUES
from engine_adapter.kv_layout import KV_FORMATS
from engine_adapter.paged_kv import PagedKVCache

DTYPE_FORMAT, E4M3X16 = KV_FORMATS
E4M3_MAX = 448.0
SCALE_NAN = 255  # e8m0's only special value
_MAX_SCALE_BYTE = 127 + 7  # scales up to 2**7: the dequantise multiplier stays finite
_E4M3_TO_BF16_BIAS = 120  # bf16 exponent bias 127 minus e4m3's 7


def _pow2(biased_exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2 ** (e - 127) for int32 ``e`` in [1, 254], built from bits (exact, no pow)."""
    if dtype == torch.bfloat16:
        return (biased_exponent.to(torch.int16) << 7).view(torch.bfloat16)
    return (biased_exponent << 23).view(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] (D a multiple of 16) -> (e4m3 values as uint8 [..., D], e8m0 scales
    [..., D/16]). One batch of torch ops on ``x``'s device."""
    *lead, dim = x.shape
    groups = x.reshape(*lead, dim // GROUP_VALUES, GROUP_VALUES)  # [..., G, 16]
    low, high = torch.aminmax(groups, dim=-1)  # one pass, no |x| materialised
    amax = torch.maximum(-low, high).float()  # [..., G]
    # ceil(log2(amax / 448)) + 127, from the float's bits: adding a mantissa's worth of
    # ones carries into the exponent unless the quotient is already a power of two.
    bits = (amax * (1 / E4M3_MAX)).view(torch.int32)
    exponent = ((bits + 0x7FFFFF) >> 23).clamp_(1, _MAX_SCALE_BYTE)
    exponent = torch.where(torch.isfinite(amax), exponent, SCALE_NAN)
    compute = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    inverse = _pow2((254 - exponent).clamp_(1, 254), compute)  # 1 / scale
    scaled = groups.to(compute) * inverse.unsqueeze(-1)  # [..., G, 16]
    # Only groups past the scale cap reach beyond 448 (the CPU skips the pass without one;
    # on a GPU the pass is cheaper than the sync the check would cost).
    if x.device.type != "cpu" or bool((exponent >= _MAX_SCALE_BYTE).any()):
        scaled.clamp_(-E4M3_MAX, E4M3_MAX)
    values = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*lead, dim)
    return values, exponent.to(torch.uint8)


def dequantize(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Decode ``values`` [..., D] (uint8, e4m3 bits) with ``scales`` [..., D/16] into ``out``
    [..., D] (bf16, fp16 or fp32, any strides: e.g. a permuted view of the pool).

    The dense hot path. torch's fp8 conversion is scalar on CPU, so the bits are moved
    instead: sign-extending an e4m3 byte to 16 bits and shifting it left 4 puts its exponent
    and mantissa where bf16 keeps them (bf16 subnormals cover e4m3's), and one multiply by
    2**120 * scale rebiases the exponent and applies the scale.
    """
    dim = values.shape[-1]
    bits = values.view(torch.int8).to(torch.int16).bitwise_left_shift_(4)
    as_bf16 = bits.bitwise_and_(0x87F0 - 0x10000).view(torch.bfloat16)  # sign|exp|mantissa
    multiplier = _pow2(scales.to(torch.int32) + _E4M3_TO_BF16_BIAS, torch.bfloat16)
    if out.dtype != torch.bfloat16:  # fp32 (CPU) or fp16: multiply in fp32
        multiplier = multiplier.float()
    grouped = out.unflatten(-1, (dim // GROUP_VALUES, GROUP_VALUES))  # a view: D is dense
    torch.mul(as_bf16.unflatten(-1, grouped.shape[-2:]), multiplier.unsqueeze(-1), out=grouped)
    return out


def split_layer(raw: torch.Tensor, part_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """One layer's bytes ``raw`` [..., layer_bytes] (uint8) as (values [..., P, H, T, D],
    scales [..., P, H, T, D/16]); ``part_shape`` is (P, H, T, D)."""
    *lead, _ = raw.shape
    num_values = part_shape[0] * part_shape[1] * part_shape[2] * part_shape[3]
    *front, dim = part_shape
    values = raw[..., :num_values].view(*lead, *part_shape)
    scales = raw[..., num_values:].view(*lead, *front, dim // GROUP_VALUES)
    return values, scales


def encode_block(kv: torch.Tensor, out: torch.Tensor) -> None:
    """Quantise one block's KV ``kv`` [L, P, H, T, D] (the device's) into ``out`` [L,
    layer_bytes] (uint8, e.g. a host slot; the copy is non_blocking)."""
    values, scales = quantize(kv)
    num_values = values[0].numel()
    layers = kv.shape[0]
    out[:, :num_values].copy_(values.view(layers, -1), non_blocking=True)
    out[:, num_values:].copy_(scales.view(layers, -1), non_blocking=True)


def decode_layer(raw: torch.Tensor, part_shape: tuple[int, ...], out: torch.Tensor) -> None:
    """Dequantise layers of blocks, ``raw`` [..., layer_bytes], into ``out`` [..., P, H, T, D]
    (a view of the pool is fine)."""
    values, scales = split_layer(raw, part_shape)
    dequantize(values, scales, out)


def num_valid_blocks(blocks: list[torch.Tensor], part_shape: tuple[int, ...]) -> int:
    """How many leading e4m3x16 blocks (each [L, layer_bytes] uint8, on the host) have no NaN
    scale: a block holding one is a miss, never values in the cache."""
    for index, block in enumerate(blocks):
        _, scales = split_layer(block, part_shape)
        if bool((scales == SCALE_NAN).any()):
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
