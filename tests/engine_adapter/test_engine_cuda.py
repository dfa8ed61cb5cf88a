"""The CUDA swap-in path: pinned host slots, side-stream copies, per-layer events.

Runs only where CUDA is present (``gpu`` marker); the CPU path is covered by the store tests.
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from engine_adapter.config import EngineConfig  # noqa: E402
from engine_adapter.engine import Engine  # noqa: E402
from engine_adapter.host_buffers import HostBlockPool  # noqa: E402
from engine_adapter.loader import load_model  # noqa: E402
from engine_adapter.swap_in import SwapIn  # noqa: E402

pytestmark = [
    pytest.mark.engine,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PROMPT = [(i * 31 + 7) % 1000 for i in range(200)]  # 12 full blocks of 16 and a tail


def _swap_in_from(engine: Engine, cold, host: HostBlockPool, pinned_why: str):
    """Save the cold prefill's 12 full blocks into ``host``'s slots, swap them into a new
    sequence from there, and compute the tail: (sequence, last logits, first token)."""
    slots = host.acquire(12)
    assert slots[0].block.is_pinned(), pinned_why
    for index, slot in enumerate(slots):
        engine.cache.save_block(cold.sequence.table.block_ids[index], slot.block)
    torch.cuda.synchronize()
    seq = engine._new_sequence(PROMPT, "t", "chat", 0)
    swap_in = SwapIn(engine.cache, seq.table.block_ids, [s.block for s in slots])
    swap_in.blocks_arrived(list(range(12)))
    swap_in.start(num_blocks=12)
    logits, first = engine._compute(seq, 12 * 16, swap_in)
    return seq, logits, first


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_side_stream_swap_in_equals_recompute(dtype):
    # exact chunks: the same kernels on the same shapes whether fetched or not, so the
    # swapped-in KV must give the cold logits bit for bit
    config = EngineConfig(
        block_tokens=16, prefill_chunk_tokens=32, device="cuda", dtype=dtype, exact_chunks=True
    )
    engine = Engine(load_model("random:small", "cuda", dtype, seed=0), config)
    cold = asyncio.run(engine.prefill(PROMPT, use_cache=False))
    host = HostBlockPool(engine.layout, num_slots=12, pin_memory=True)
    seq, logits, first = _swap_in_from(engine, cold, host, "swap-in buffers must be pinned on CUDA")
    assert first == cold.first_token_id
    assert torch.equal(logits, cold.logits), "swapped-in KV gave other logits than recomputing"
    for index in range(12):
        for layer in range(engine.layout.num_layers):
            got = engine.cache.block(layer, seq.table.block_ids[index])
            want = engine.cache.block(layer, cold.sequence.table.block_ids[index])
            assert torch.equal(got, want), f"block {index} layer {layer} placed wrongly"


def test_the_landing_pool_is_registered_and_swaps_in_by_dma():
    """The fetch pool is a memfd the store's nodes write into; registered with CUDA, its
    slots are pinned, so the swap-in's copies are DMA from exactly those bytes."""
    config = EngineConfig(
        block_tokens=16, prefill_chunk_tokens=32, device="cuda", exact_chunks=True
    )
    engine = Engine(load_model("random:small", "cuda", "float32", seed=0), config)
    cold = asyncio.run(engine.prefill(PROMPT, use_cache=False))
    host = HostBlockPool(engine.layout, num_slots=12, pin_memory=True, shared=True)
    try:
        _, logits, first = _swap_in_from(
            engine, cold, host, "the registered landing pool must count as pinned"
        )
        torch.cuda.synchronize()
        assert first == cold.first_token_id
        assert torch.equal(logits, cold.logits), "the landing pool's swap-in changed the logits"
    finally:
        host.close()


def test_cached_prefill_on_cuda_through_a_real_cluster(tmp_path):
    """Cache-backed prefill on the GPU end to end: the local nodes write the blocks into
    the registered pool, the engine copies them to the device and gets the cold answer."""
    from deploy.local_cluster import LocalCluster

    config = EngineConfig(block_tokens=16, prefill_chunk_tokens=32, device="cuda")
    with LocalCluster.start(tmp_path, fsync=False) as cluster:
        engine = Engine(load_model("random:small", "cuda", "float32", seed=0), config)
        engine.open_store(cluster.cluster_toml)

        async def run() -> tuple:
            cold = await engine.prefill(PROMPT, use_cache=False)
            engine.release(cold.sequence)
            await engine.prefill(PROMPT, tenant="gpu")  # writes the blocks
            await engine.flush()
            cached = await engine.prefill(PROMPT, tenant="gpu")
            engine.release(cached.sequence)
            counters = next(iter(engine.connector._clients.values())).local.counters
            await engine.close()
            return cold, cached, counters

        cold, cached, counters = asyncio.run(run())
    assert cached.num_cached_tokens == 192, f"expected 12 blocks from the store: {cached}"
    assert cached.first_token_id == cold.first_token_id
    assert torch.allclose(cached.logits, cold.logits, atol=1e-4), "cached prefill changed logits"
    assert counters.num_placed > 0, "no node wrote into the registered landing pool"
