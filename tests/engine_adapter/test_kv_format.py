"""The e4m3x16 KV block format: the codec's error bound, its bytes, its namespace, and cache-
backed prefill with it against a real cluster, bad blocks included."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from deploy.local_cluster import LocalCluster  # noqa: E402
from engine_adapter import kv_format  # noqa: E402
from engine_adapter.config import RANDOM_PRESETS  # noqa: E402
from engine_adapter.engine import Engine  # noqa: E402
from engine_adapter.kv_layout import KVBlockLayout  # noqa: E402
from engine_adapter.paged_kv import PagedKVCache  # noqa: E402
from tests.engine_adapter.store_harness import CONFIG  # noqa: E402

PROMPT = [(i * 41 + 3) % 1000 for i in range(170)]  # 10 full blocks and a 10-token tail
# One block per land_batch call: a block of the wrong size fails its whole call.
E4M3 = dataclasses.replace(CONFIG, kv_format="e4m3x16", fetch_chunk_blocks=1)


def wide_range_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values spanning 12 decades (groups of very different magnitudes), a few zeros."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 10 ** (12 * torch.rand(shape[:-1]) - 6)[..., None]
    x[..., :3] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_e4m3_rounding(dtype):
    x = wide_range_kv((4, 2, 3, 16, 64), dtype).float().clamp(-5e4, 5e4).to(dtype)
    values, scales = kv_format.quantize(x)
    assert values.dtype == torch.uint8 and scales.dtype == torch.bfloat16
    assert scales.shape[-1] == 4
    out = torch.empty_like(x)
    kv_format.dequantize(values, scales, out)
    scale = scales.double()  # [..., 4]
    err = (out.double() - x.double()).abs().unflatten(-1, (4, 16))
    # half an e4m3 ulp (2**-4 of the value for normals, 2**-10 of the scale for subnormals),
    # then one rounding to the output dtype (an ulp there: the scale has 8 significant bits)
    magnitude, info = x.double().abs().unflatten(-1, (4, 16)), torch.finfo(dtype)
    bound = magnitude / 16 + scale[..., None] * 2.0**-10 + (magnitude + info.tiny) * info.eps
    assert bool((err <= bound).all()), "e4m3x16 lost more than e4m3's rounding"
    reference = values.view(torch.float8_e4m3fn).double().unflatten(-1, (4, 16))
    assert torch.equal(
        out.double().unflatten(-1, (4, 16)), (reference * scale[..., None]).to(dtype).double()
    ), "the bit-level dequantise disagrees with torch's own float8 conversion"


def test_a_groups_largest_value_comes_back_within_2_to_the_minus_7():
    """The scale is amax / 448 rounded up to a bf16 (8 significant bits): the largest |value|
    of each group lands in (444.5, 448], so it rounds to 448 and comes back within 2**-7 (an
    e8m0 scale left it up to 2**-4 off; the accuracy on the real model rests on this:
    docs/engine.md)."""
    x = wide_range_kv((64, 64), torch.float32, seed=3).clamp(-5e4, 5e4)  # below the cap
    values, scales = kv_format.quantize(x)
    assert bool((scales > 0).all()), "a scale of 0 has no inverse"
    out = kv_format.dequantize(values, scales, torch.empty_like(x))
    amax = x.unflatten(-1, (4, 16)).abs().amax(-1)  # [64, 4]
    back = out.unflatten(-1, (4, 16)).abs().amax(-1)
    assert bool(((back - amax).abs() <= amax * 2.0**-7).all()), "a group's largest value moved"
    _, edge = kv_format.quantize(torch.tensor([[448.0] + [0.0] * 15, [0.0] * 16]))
    assert edge.flatten().tolist() == [1.0, kv_format.MIN_SCALE], "448: scale 1; zeros: min"


def test_non_finite_values_give_a_nan_scale_and_the_block_is_refused():
    layout = KVBlockLayout(2, 1, 32, 4, "float32", kv_format="e4m3x16")
    kv = torch.ones(layout.shape)
    good = torch.empty(layout.num_layers, layout.layer_bytes, dtype=torch.uint8)
    kv_format.encode_block(kv, good)
    kv[1, 0, 0, 2, 5] = float("-inf")
    bad = torch.empty_like(good)
    kv_format.encode_block(kv, bad)
    assert kv_format.num_valid_blocks([good, good, bad, good], layout.part_shape) == 2
    kv[1, 0, 0, 2, 5], kv[0, 0, 0, 1, 20] = 1.0, float("nan")
    kv_format.encode_block(kv, bad)
    assert kv_format.num_valid_blocks([good, bad], layout.part_shape) == 1, "NaN got a scale"


def test_stored_bytes_are_at_most_0_5625_of_bf16():
    model = RANDOM_PRESETS["135m"]
    bf16 = KVBlockLayout.for_model(model, 64, "bfloat16")
    e4m3 = KVBlockLayout.for_model(model, 64, "float32", "e4m3x16")
    assert e4m3.block_bytes / bf16.block_bytes == 1.125 / 2 <= 0.5625
    assert e4m3.bytes_per_token * 64 == e4m3.block_bytes
    mla = KVBlockLayout.for_model(RANDOM_PRESETS["mla-small"], 64, "bfloat16", "e4m3x16")
    assert mla.block_bytes == mla.num_elements * 18 // 16
    with pytest.raises(ValueError, match="multiple of 16"):
        KVBlockLayout(2, 1, 40, 4, "float32", kv_format="e4m3x16")


def test_the_format_is_in_the_namespace():
    model = RANDOM_PRESETS["small"]
    raw32 = KVBlockLayout.for_model(model, 16, "float32")
    raw16 = KVBlockLayout.for_model(model, 16, "bfloat16")
    e4m3_32 = KVBlockLayout.for_model(model, 16, "float32", "e4m3x16")
    e4m3_16 = KVBlockLayout.for_model(model, 16, "bfloat16", "e4m3x16")
    spaces = {x.namespace("m") for x in (raw32, raw16, e4m3_32)}
    assert len(spaces) == 3, "each stored format needs its own keys"
    assert e4m3_16.namespace("m") == e4m3_32.namespace("m"), (
        "an e4m3x16 block means the same to an fp32 and a bf16 engine"
    )


@pytest.mark.parametrize("block_ids", [[3, 4, 5], [5, 1, 3]], ids=["consecutive", "scattered"])
def test_save_then_load_places_the_dequantised_block(block_ids):
    layout = KVBlockLayout(3, 2, 32, 4, "float32", kv_format="e4m3x16")
    cache = PagedKVCache(layout, 8, torch.device("cpu"))
    cache.kv.copy_(wide_range_kv(tuple(cache.kv.shape), torch.float32, seed=1))
    blocks = [torch.empty(3, layout.layer_bytes, dtype=torch.uint8) for _ in block_ids]
    for block_id, out in zip(block_ids, blocks, strict=True):
        kv_format.save_block(cache, block_id, out)
    want = cache.kv.clone()
    target = PagedKVCache(layout, 8, torch.device("cpu"))
    target.kv.zero_()
    for layer in range(3):
        kv_format.load_layer(target, layer, block_ids, blocks)
    for block_id in block_ids:
        got = target.kv[:, :, :, block_id * 4 : block_id * 4 + 4]
        ref = want[:, :, :, block_id * 4 : block_id * 4 + 4]
        expected = kv_format.dequantize(*kv_format.quantize(ref), torch.empty_like(ref))
        assert torch.equal(got, expected), f"block {block_id} is not its own dequantised KV"
    untouched = [b for b in range(8) if b not in block_ids]
    assert all(bool((target.kv[:, :, :, b * 4 : b * 4 + 4] == 0).all()) for b in untouched)


# Cache-backed prefill with e4m3x16 blocks against a real 12-node cluster.


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster.start(tmp_path_factory.mktemp("e4m3-cluster"), fsync=False) as cluster:
        yield cluster


def make_engine(loaded, cluster, config=E4M3) -> Engine:
    engine = Engine(loaded, config)
    engine.open_store(cluster.cluster_toml)
    return engine


async def prefill(engine: Engine, prompt: list[int], **kwargs):
    result = await engine.prefill(prompt, **kwargs)
    engine.release(result.sequence)
    await engine.flush()
    return result


@pytest.mark.engine
async def test_e4m3x16_blocks_come_back_and_keep_the_answer(cluster, small_model):
    engine = make_engine(small_model, cluster)
    cold = await prefill(engine, PROMPT, tenant="e4m3", use_cache=False)
    await prefill(engine, PROMPT, tenant="e4m3")
    assert engine.connector.stats.num_written_blocks == 10
    cached = await prefill(engine, PROMPT, tenant="e4m3")
    await engine.close()
    assert cached.num_cached_tokens == 160 and cached.fallback is None, cached.fallback
    assert not torch.equal(cached.logits, cold.logits), "the blocks were not quantised at all"
    assert int(cached.logits.argmax()) == int(cold.logits.argmax())
    assert torch.allclose(cached.logits, cold.logits, atol=0.05 * float(cold.logits.abs().max()))


@pytest.mark.engine
async def test_a_block_is_never_read_in_the_other_format(cluster, small_model):
    quantised = make_engine(small_model, cluster)
    await prefill(quantised, PROMPT, tenant="cross")  # writes e4m3x16 blocks
    raw = make_engine(small_model, cluster, dataclasses.replace(CONFIG, write_back=False))
    result = await prefill(raw, PROMPT, tenant="cross")
    assert result.num_cached_tokens == 0, "a dtype engine read e4m3x16 blocks"
    await prefill(raw, PROMPT, tenant="cross-raw", write_back=True)  # writes fp32 blocks
    reader = make_engine(small_model, cluster, dataclasses.replace(E4M3, write_back=False))
    result = await prefill(reader, PROMPT, tenant="cross-raw")
    for engine in (quantised, raw, reader):
        await engine.close()
    assert result.num_cached_tokens == 0, "an e4m3x16 engine read fp32 blocks"


@pytest.mark.engine
@pytest.mark.parametrize("damage", ["nan_scale", "truncated", "bf16_sized"])
async def test_a_bad_block_is_a_counted_miss(cluster, small_model, damage):
    tenant = f"bad-{damage}"
    engine = make_engine(small_model, cluster, dataclasses.replace(E4M3, write_back=False))
    cold = await prefill(engine, PROMPT, tenant=tenant, use_cache=False)
    await prefill(engine, PROMPT, tenant=tenant, write_back=True)
    keys = engine.connector.keys(PROMPT, tenant)
    kv = await engine.connector.client(tenant)
    block = bytearray(await kv.get(keys[3]))
    layout = engine.layout
    if damage == "nan_scale":
        nan = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8)
        block[-2:] = bytes(nan.tolist())  # the last scale of the last layer
    elif damage == "truncated":
        block = block[: len(block) - 100]
    else:
        block = bytearray(layout.num_elements * 2)
    await kv.delete([keys[3]])
    await kv.put(keys[3], bytes(block))
    result = await prefill(engine, PROMPT, tenant=tenant)
    await engine.close()
    assert result.fallback == "bad_block", f"{damage}: fallback {result.fallback}"
    assert result.num_cached_tokens == 3 * 16, "only the blocks before the bad one may be used"
    assert engine.connector.stats.num_bad_blocks == 1
    assert not bool(torch.isnan(result.logits).any())
    assert int(result.logits.argmax()) == int(cold.logits.argmax())
