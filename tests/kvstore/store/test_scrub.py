"""The background scrub: bit rot found without any read, reported once, repairable; pacing."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstore.config import NodeConfig, TTLConfig
from kvstore.errors import IndexUnusable
from kvstore.node.scrubber import scrub_forever
from kvstore.store.scrub import MIN_RECORD_COST_BYTES, ScrubStep, pause_s
from kvstore.store.segments import record_bytes
from kvstore.store.shard_store import ShardStore, Status
from tests.kvstore.node_harness import DAY_S, make_shard
from tests.kvstore.store_harness import (
    CLASSES,
    STRESS_INDEX_RESERVE_BYTES,
    T0,
    MakeStore,
    damage_index_pages,
)
from ttl.clock import ManualClock


def _node(tmp_path: Path, **fields: object) -> NodeConfig:
    return NodeConfig("n0", "127.0.0.1:1", 0, "d0", str(tmp_path), fsync=False, **fields)


@pytest.fixture
def store(make_store: MakeStore) -> ShardStore:
    return make_store(segment_max_bytes=30_000)  # several segments


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def _payload(i: int) -> bytes:
    return bytes([65 + i]) * (2000 + i)


def _full_pass(store: ShardStore, max_bytes: int = 1 << 30) -> list[ScrubStep]:
    steps = [store.scrub(max_bytes)]
    while not steps[-1].pass_done:
        steps.append(store.scrub(max_bytes))
    return steps


def _flip(tmp_path: Path, needle: bytes, delta: int) -> None:
    """Flip one bit ``delta`` bytes after the first occurrence of ``needle`` in any segment."""
    for segment in (tmp_path / "segments").glob("*.seg"):
        data = bytearray(segment.read_bytes())
        if (where := data.find(needle)) >= 0:
            data[where + delta] ^= 0x01
            segment.write_bytes(bytes(data))
            return
    raise AssertionError("needle not found: the test data is not where the test expects")


def test_scrub_finds_bitrot_without_any_read(store: ShardStore, tmp_path: Path) -> None:
    items = [(_key(i), make_shard(_payload(i))) for i in range(20)]
    store.put("acme", "chat", items)
    _flip(tmp_path, _payload(7), 100)  # inside the shard payload of key 7
    _flip(tmp_path, _key(12), 3)  # inside the record header of key 12 (its key field)
    steps = _full_pass(store)
    stats = store.stats()
    assert stats.corrupt_shards == 2, "the scrub missed a flipped bit"
    assert (stats.hits, stats.misses) == (0, 0), "a scrub must not count as a read"
    total_bytes = sum(record_bytes(len(shard), "acme", "chat") for _, shard in items)
    assert stats.scrubbed_bytes == total_bytes, "the pass did not read every record once"
    assert (stats.num_scrub_passes, stats.last_full_pass_s) == (1, T0)
    assert len(steps) == 2 and steps[-1] == ScrubStep(0, pass_done=True)
    _full_pass(store)
    assert store.stats().corrupt_shards == 2, "a corrupt shard found twice was counted twice"
    store.flush()
    assert store.contains("acme", [_key(7), _key(12)]) == [[], []], "corrupt entry kept"
    assert store.stats().corrupt_shards == 2, "quarantine counted a scrub finding again"
    assert store.put("acme", "chat", [items[7], items[12]]).num_stored == 2, "repair refused"
    results = store.get("acme", [k for k, _ in items])
    assert [r.shards for r in results] == [(s,) for _, s in items], "wrong bytes after repair"


def test_scrub_finds_a_damaged_leaf_before_stepping_onto_it(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A pass starts by reading the index through in a child process: lmdb aborts a process
    whose cursor steps from one leaf onto a damaged one (the scrub's by_seg scan would)."""
    store = ShardStore(_node(tmp_path), TTLConfig(classes=CLASSES), clock)
    try:
        items = [(i.to_bytes(16, "big"), make_shard(_payload(i % 100))) for i in range(400)]
        store.put("acme", "chat", items)
        assert damage_index_pages(tmp_path, items[300][0]) > 0
        with pytest.raises(IndexUnusable, match=r"damaged|died"):
            store.scrub(1 << 30)
    finally:
        with contextlib.suppress(IndexUnusable):
            store.close()


def test_scrub_steps_respect_the_budget(store: ShardStore) -> None:
    shard = make_shard(bytes(100_000))  # records above MIN_RECORD_COST_BYTES: cost = size
    store.put("acme", "chat", [(_key(i), shard) for i in range(10)])
    cost_bytes = record_bytes(len(shard), "acme", "chat")
    assert cost_bytes > MIN_RECORD_COST_BYTES
    steps = _full_pass(store, max_bytes=int(2.5 * cost_bytes))
    assert [s.cost_bytes for s in steps] == [2 * cost_bytes] * 5 + [0], "budget not applied"
    steps = _full_pass(store, max_bytes=1)
    assert len(steps) == 11, "a step must verify at least one record, however small its budget"
    assert store.stats().scrubbed_bytes == 20 * cost_bytes


def test_scrub_skips_expired_and_refreshes_nothing(store: ShardStore, clock: ManualClock) -> None:
    store.put("acme", "agent", [(_key(1), make_shard(b"agent"))])
    store.put("acme", "chat", [(_key(2), make_shard(b"chat"))])
    clock.advance(2 * DAY_S)
    _full_pass(store)
    clock.advance(DAY_S)  # the agent block expires now: the scrub at day 2 did not refresh it
    assert store.contains("acme", [_key(1)]) == [[]], "the scrub refreshed a TTL"
    before = store.stats().scrubbed_bytes
    _full_pass(store)
    assert store.stats().scrubbed_bytes - before == record_bytes(
        len(make_shard(b"chat")), "acme", "chat"
    )
    assert store.get("acme", [_key(2)])[0].status == Status.HIT


def test_scrub_racing_moves_and_expiry_reports_no_false_corruption(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store(
        max_bytes=150_000, segment_max_bytes=40_000, index_reserve_bytes=STRESS_INDEX_RESERVE_BYTES
    )
    stop, num_steps, errors = threading.Event(), [0], []

    def scrub() -> None:
        while not stop.is_set():
            try:
                store.scrub(20_000)
            except Exception as exc:
                errors.append(exc)
            num_steps[0] += 1

    scrubber = threading.Thread(target=scrub)
    scrubber.start()
    rng = random.Random(9)
    try:
        for step in range(200):
            i = rng.randrange(100)
            payload = i.to_bytes(4, "big") * (100 + i * 7)
            store.put("acme", rng.choice(["agent", "chat"]), [(_key(i), make_shard(payload))])
            store.get("acme", [_key(rng.randrange(100))])  # refreshes: carry-forward later
            if step % 20 == 0:
                clock.advance(rng.uniform(0, DAY_S))
                store.tick()
    finally:
        stop.set()
        scrubber.join()
    assert not errors, f"a scrub step racing a move failed: {errors[:3]}"
    assert num_steps[0] > 0, "the scrub never ran: the test exercised nothing"
    assert store.stats().corrupt_shards == 0, "a scrub racing a move reported a good shard"


def test_scrub_after_close_does_nothing(tmp_path: Path, clock: ManualClock) -> None:
    store = ShardStore(_node(tmp_path), TTLConfig(), clock)
    store.put("acme", "chat", [(_key(1), make_shard(b"x"))])
    store.close()
    assert store.scrub(1 << 20) == ScrubStep(0, pass_done=True), "scrubbed a closed store"


def test_pause_math(tmp_path: Path) -> None:
    node = _node(tmp_path, scrub_bytes_per_s=1000, scrub_pass_interval_s=60.0)
    assert pause_s(ScrubStep(500, pass_done=False), node, 0.0, 10.0) == 0.5
    assert pause_s(ScrubStep(0, pass_done=True), node, 100.0, 130.0) == 30.0
    assert pause_s(ScrubStep(0, pass_done=True), node, 100.0, 170.0) == 0.0


def test_scrub_config_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="scrub_bytes_per_s"):
        _node(tmp_path, scrub_bytes_per_s=-1)
    with pytest.raises(ValueError, match="scrub_pass_interval_s"):
        _node(tmp_path, scrub_pass_interval_s=0)


async def test_scrub_forever_is_paced_and_off_at_zero(tmp_path: Path) -> None:
    calls: list[int] = []

    def step(max_bytes: int) -> ScrubStep:
        calls.append(max_bytes)
        return ScrubStep(max_bytes, pass_done=False)  # every step uses its whole budget

    with ThreadPoolExecutor(1) as executor:
        await scrub_forever(step, _node(tmp_path, scrub_bytes_per_s=0), executor)
        assert calls == [], "a rate of 0 must disable the scrub"
        node = _node(tmp_path, scrub_bytes_per_s=10_000)
        started_s = time.monotonic()
        task = asyncio.create_task(scrub_forever(step, node, executor))
        while not calls:  # the first step, however long a loaded machine takes to run it
            assert time.monotonic() - started_s < 60, "the scrub never took a step"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.45)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        elapsed_s = time.monotonic() - started_s
    # Paced: a step of 0.1 s budget at most every 0.1 s (load only makes the steps fewer).
    assert len(calls) <= elapsed_s / 0.1 + 2, (
        f"{len(calls)} steps of 0.1 s budget in {elapsed_s:.2f} s: not paced"
    )
    assert set(calls) == {1000}, "a step's budget must be a tenth of a second at the rate"
