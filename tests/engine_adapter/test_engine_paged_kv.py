"""Block pool, block tables, block (de)serialisation and the CPU swap-in path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from client.buffer_pool import PAGE_BYTES  # noqa: E402
from engine_adapter.config import RANDOM_PRESETS  # noqa: E402
from engine_adapter.host_buffers import HostBlockPool  # noqa: E402
from engine_adapter.kv_layout import KVBlockLayout  # noqa: E402
from engine_adapter.paged_kv import BlockPool, BlockTable, PagedKVCache  # noqa: E402
from engine_adapter.swap_in import SwapIn, slot_runs  # noqa: E402
from kvstore.errors import CapacityExhausted, InvalidArgument  # noqa: E402

pytestmark = pytest.mark.engine
LAYOUT = KVBlockLayout.for_model(RANDOM_PRESETS["tiny"], 8, "float32")


def filled_cache(num_blocks: int) -> PagedKVCache:
    cache = PagedKVCache(LAYOUT, num_blocks, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def test_pool_hands_out_lowest_ids_and_refuses_overdraw():
    pool = BlockPool(6)
    first, second = pool.allocate(2), pool.allocate(3)
    assert (first, second) == ([0, 1], [2, 3, 4])
    pool.free(first)
    assert pool.allocate(3) == [0, 1, 5], "freed ids must be reused lowest first"
    with pytest.raises(CapacityExhausted, match="free blocks"):
        pool.allocate(1)


def test_consecutive_table_reads_a_view_and_scattered_table_gathers():
    cache = filled_cache(8)
    consecutive, scattered = BlockTable(8, [2, 3, 4]), BlockTable(8, [5, 0, 7])
    view = cache.read(layer=1, table=consecutive, num_tokens=20)
    assert view.data_ptr() == cache.block(1, 2).data_ptr(), "a consecutive table must not copy"
    gathered = cache.read(layer=1, table=scattered, num_tokens=20)  # [2, Hkv, 20, D]
    expected = torch.cat([cache.block(1, 5), cache.block(1, 0), cache.block(1, 7)[:, :, :4]], 2)
    assert torch.equal(gathered, expected), "block-table gather put tokens in the wrong order"


@pytest.mark.parametrize("stacked", [False, True])
def test_save_then_load_round_trips_every_layer(stacked):
    source, target = filled_cache(4), PagedKVCache(LAYOUT, 6, torch.device("cpu"))
    blocks = [torch.empty(LAYOUT.shape) for _ in range(2)]
    for block_id, out in zip([1, 3], blocks, strict=True):
        source.save_block(block_id, out)
    payload = torch.stack(blocks) if stacked else blocks
    for layer in range(LAYOUT.num_layers):
        target.load_layer(layer, [4, 5], payload)
        assert torch.equal(target.block(layer, 4), source.block(layer, 1))
        assert torch.equal(target.block(layer, 5), source.block(layer, 3))


def test_cpu_swap_in_loads_each_layer_once_when_first_needed():
    source, target = filled_cache(2), PagedKVCache(LAYOUT, 4, torch.device("cpu"))
    host_blocks = [torch.empty(LAYOUT.shape) for _ in range(2)]
    for block_id, out in enumerate(host_blocks):
        source.save_block(block_id, out)
    swap_in = SwapIn(target, [2, 3, 0], host_blocks)
    swap_in.start(num_blocks=2)
    swap_in.before_layer(0)
    assert torch.equal(target.block(0, 3), source.block(0, 1))
    assert not torch.equal(target.block(1, 3), source.block(1, 1)), "layer 1 loaded too early"
    swap_in.before_layer(1)
    assert torch.equal(target.block(1, 2), source.block(1, 0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_swap_in_places_runs_of_pool_slots_in_one_copy_each(dtype):
    layout = KVBlockLayout.for_model(RANDOM_PRESETS["tiny"], 8, dtype)
    pool = HostBlockPool(layout, num_slots=6, pin_memory=False, shared=True)
    slots = pool.acquire(6)
    for slot in (slots[2], slots[4]):  # slots 0 1 3 5 taken in order: two runs of slots
        slot.release()
    blocks = [slot.block for slot in (slots[0], slots[1], slots[3], slots[5])]
    generator = torch.Generator().manual_seed(1)
    for block in blocks:
        block.copy_(torch.randn(block.shape, generator=generator))
    block_ids = [4, 5, 6, 0]  # pool blocks: a break in the ids too
    runs = slot_runs(block_ids, blocks)
    assert [ids for ids, _ in runs] == [[4, 5], [6], [0]], (
        "runs must break at a gap in slots or ids"
    )
    assert runs[0][1].data_ptr() == blocks[0].data_ptr(), "a run must view the slots, not copy"
    target = PagedKVCache(layout, 8, torch.device("cpu"))
    swap_in = SwapIn(target, block_ids, blocks)
    swap_in.start(num_blocks=4)
    for layer in range(layout.num_layers):
        swap_in.before_layer(layer)
        for block_id, block in zip(block_ids, blocks, strict=True):
            assert torch.equal(target.block(layer, block_id), block[layer]), (
                f"layer {layer} of pool block {block_id} is not its host slot's"
            )
    for slot in (slots[0], slots[1], slots[3], slots[5]):
        slot.release()
    again = pool.acquire(6)  # the free list is a stack: the slots come back in address order
    assert len(slot_runs(list(range(6)), [slot.block for slot in again])) == 1, (
        "slots freed together must come back as one run"
    )
    pool.close()


def test_host_slots_share_memory_and_are_reused():
    pool = HostBlockPool(LAYOUT, num_slots=3, pin_memory=False)
    first = pool.acquire(2)
    assert [s.index for s in first] == [0, 1] and len(pool.acquire(5)) == 1, "pool overdrawn"
    first[0].view[:4] = b"\x00\x00\x80\x3f"  # 1.0f, written the way get_into writes
    assert first[0].block.flatten()[0].item() == 1.0, "view and tensor must share memory"
    assert first[0].block.shape == LAYOUT.shape and len(first[0].view) == LAYOUT.block_bytes
    assert all(s.block.data_ptr() % PAGE_BYTES == 0 for s in first), "slots must be page aligned"
    first[1].release()
    assert [s.index for s in pool.acquire(1)] == [1]
    with pytest.raises(InvalidArgument, match="twice"):
        first[1].release()
