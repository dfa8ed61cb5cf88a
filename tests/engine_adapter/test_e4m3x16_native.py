"""The e4m3x16 codec's C kernels (engine_adapter/e4m3x16.c) against the torch ops they replace
on CPU: the same bits for every input, strided views of the paged cache included, from every
kernel this CPU runs (the portable loops everywhere; the AVX-512 ones where the CPU has them)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine_adapter import e4m3x16_native, kv_format  # noqa: E402
from tests.engine_adapter.test_kv_format import wide_range_kv  # noqa: E402

pytestmark = pytest.mark.skipif(
    not e4m3x16_native.NATIVE, reason="engine_adapter/_e4m3x16.so not built (make native)"
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KERNELS = e4m3x16_native.AVAILABLE_KERNELS


def awkward_values(dtype: torch.dtype) -> torch.Tensor:
    """[G, 16] groups that hit the edges: e4m3 ties (odd and even), subnormals and the
    values that round to 0 or to the smallest normal, 448 and just past it, the scale cap,
    signed zeros, amax with a mantissa at and just past 1.75, fp32 subnormals."""
    edges = [
        [448.0, 464.0, 2.0**-6, 2.0**-7 * 1.5, 2.0**-10, 2.0**-10 * 1.001, 9.0, 9.5],
        [448.0 * 2.0**7, 6e4, 1e5, -1e5, 3.0, -0.0, 0.0, 2.0**-9 * 2.5],
        [1.75, 1.75 * (1 + 2.0**-7), 1.0, 0.5, 0.25, 1.0 + 2.0**-4, 1.0 + 3 * 2.0**-4, -2.0],
        [1e-38, 1e-39, 1e-45, -1e-40, 2.0**-126, 0.0, 0.0, 0.0],
    ]
    groups = torch.tensor([row * 2 for row in edges])  # [4, 16]
    scales = torch.tensor([1.0, 2.0**-3, 3.7, 1e-30, 2.0**20, 448.0 / 3]).repeat_interleave(4)
    return (groups.repeat(6, 1) * scales[:, None]).to(dtype)  # [24, 16]


def assert_same_codes(x: torch.Tensor, kernel: str) -> None:
    values, scales = e4m3x16_native.quantize(x, kernel=kernel)
    want_values, want_scales = kv_format.torch_quantize(x)
    assert torch.equal(scales.view(torch.int16), want_scales.view(torch.int16)), "scales differ"
    finite = torch.isfinite(want_scales).repeat_interleave(16, dim=-1)
    assert torch.equal(values[finite], want_values[finite]), "e4m3 bytes differ from torch's"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantise_gives_torchs_bits(dtype, kernel):
    kv = wide_range_kv((3, 2, 3, 16, 64), dtype).float().clamp(-6e4, 6e4).to(dtype)
    assert_same_codes(kv, kernel)
    assert_same_codes(awkward_values(dtype), kernel)  # 24 groups: 16 at once, then 8 one by one
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[1, 7], x[3, 40] = float("inf"), float("nan")
    assert_same_codes(x, kernel)  # the non-finite groups: the NaN scale, in both


def every_bit_pattern(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[G, 16] groups of bit patterns of ``dtype``: all 65,536 of a 16-bit type (both in order,
    so a group's values share an exponent, and shuffled), or 2**18 random fp32 ones; every
    exponent, subnormals, inf and NaN, saturation at the clamped scale 2**7."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        bits = torch.randint(-(2**31), 2**31, (2**18,), generator=generator, dtype=torch.int64)
        return bits.to(torch.int32).view(torch.float32).reshape(-1, 16)
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    shuffled = bits[torch.randperm(len(bits), generator=generator)]
    return torch.cat([bits, shuffled]).view(dtype).reshape(-1, 16)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_bit_pattern_quantises_as_torch_does(dtype, kernel):
    assert_same_codes(every_bit_pattern(dtype, seed=3).reshape(-1, 256), kernel)
    groups = every_bit_pattern(dtype, seed=4)
    assert_same_codes(groups[: len(groups) // 21 * 21].reshape(-1, 16 * 21), kernel)  # tails


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_and_scale_dequantises_as_torch_does(dtype, kernel):
    """All 256 codes (16 groups, one block of the AVX-512 kernels) under every 8th bf16 scale
    from 2**-126 to 2**7: results that are subnormal in the output dtype (scales below 2**-117
    for bf16, whose AVX512_BF16 rounding flushes them) and the largest ones."""
    exponents = torch.arange(-126, 8, dtype=torch.float64)
    mantissas = 1 + torch.arange(0, 128, 8, dtype=torch.float64) / 128
    scales = (2 ** exponents[:, None] * mantissas).reshape(-1).to(torch.bfloat16)  # exact
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(len(scales), 1)
    grouped = scales[:, None].expand(-1, 16).contiguous()  # [S, 16]: one scale per row's groups
    got = e4m3x16_native.dequantize(
        values, grouped, torch.empty_like(values, dtype=dtype), kernel=kernel
    )
    want = kv_format.torch_dequantize(values, grouped, torch.empty_like(values, dtype=dtype))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "dequantised bits differ"
    ragged = (values[:, :240], grouped[:, :15])  # rows of 15 groups: the one-by-one tails
    out = torch.empty_like(ragged[0], dtype=dtype)
    got = e4m3x16_native.dequantize(*ragged, out, kernel=kernel)
    want = kv_format.torch_dequantize(*ragged, torch.empty_like(out))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "the tails' bits differ"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantise_gives_torchs_bits(dtype, kernel):
    x = torch.cat([wide_range_kv((40, 64), torch.float32).clamp(-6e4, 6e4).to(dtype),
                   awkward_values(dtype).reshape(6, 64)])  # fmt: skip
    values, scales = kv_format.torch_quantize(x)
    values[0, :16] = torch.arange(256, dtype=torch.int32)[::16].to(torch.uint8)  # every code
    values[1] = torch.arange(256, dtype=torch.int32)[64:128].to(torch.uint8)
    got = e4m3x16_native.dequantize(values, scales, torch.empty_like(x), kernel=kernel)
    want = kv_format.torch_dequantize(values, scales, torch.empty_like(x))
    finite = torch.isfinite(scales).repeat_interleave(16, dim=-1)  # a NaN scale's block: a miss
    assert int(finite.sum()) >= 40 * 64, "the test compared nothing"
    assert torch.equal(got[finite].view(torch.uint8), want[finite].view(torch.uint8)), (
        "dequantised bits differ"
    )


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_of_the_pool_go_in_one_call(dtype, kernel):
    """What the engine hands the codec: one block of every layer (a slice of the pool's token
    dimension), and blocks [n, L, P, H, T, D] landing in a permuted view of the pool."""
    pool = wide_range_kv((3, 2, 2, 8 * 4, 32), torch.float32, seed=5).clamp(-6e4, 6e4).to(dtype)
    block = pool[:, :, :, 8:12]  # [L, P, H, T, D]: block 2 of every layer
    assert_same_codes(block, kernel)
    values, scales = kv_format.torch_quantize(block)
    out, want = torch.zeros_like(pool), torch.zeros_like(pool)
    dest = out[:, :, :, 4:12].unflatten(3, (2, 4)).permute(3, 0, 1, 2, 4, 5)  # [2, L, P, H, T, D]
    ref = want[:, :, :, 4:12].unflatten(3, (2, 4)).permute(3, 0, 1, 2, 4, 5)
    stacked = (values.expand(2, *values.shape), scales.expand(2, *scales.shape))
    e4m3x16_native.dequantize(*stacked, dest, kernel=kernel)
    kv_format.torch_dequantize(*stacked, ref)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), "a strided view differs"
    assert bool((out[:, :, :, :4] == 0).all() and (out[:, :, :, 12:] == 0).all()), "wrote outside"


def test_rows_merge_the_dense_trailing_dimensions():
    x = torch.empty(2, 3, 4, 32)[:, :, 1:3]  # [2, 3, 2, 32]: rows of 64 values
    row, (offsets,) = e4m3x16_native.rows(tuple(x.shape), x.stride())
    assert row == 64 and offsets.tolist() == [128 * i for i in range(6)], "from data_ptr()"
    dense = torch.empty(2, 3, 4, 32)
    row, (offsets,) = e4m3x16_native.rows(tuple(dense.shape), dense.stride())
    assert row == dense.numel() and offsets.tolist() == [0], "a dense tensor is one row"
