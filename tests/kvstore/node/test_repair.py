"""The repair planner (pure) and the store's side of a repair: fenced by deletes, no fresh TTL."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from deploy.local_cluster import local_config
from kvstore.errors import InvalidArgument
from kvstore.node.repair import (
    BlockPlan,
    Listed,
    Unrecoverable,
    expires_before_rebuilt,
    group_leader,
    plan_block,
    repair_order,
)
from kvstore.node.tombstones import TombstoneSync
from kvstore.store.index_codec import Tombstone
from kvstore.store.shard_store import PutOptions
from tests.kvstore.node_harness import DAY_S, make_shard
from tests.kvstore.store_harness import MakeStore
from ttl.clock import ManualClock

K, WIDTH, NOW = 10, 12, 1000.0
V1, V2 = b"1" * 16, b"2" * 16


def _listed(positions: range | list[int], version: bytes = V1, **fields: float) -> list[Listed]:
    values = {"written_at_s": 10.0, "expires_at_s": 5000.0, **fields}
    return [
        Listed(p, version, p, values["written_at_s"], values["expires_at_s"], "chat", 4096)
        for p in positions
    ]


def _plan(listed: list[Listed], up: range | list[int] = range(WIDTH)) -> object:
    return plan_block("acme", b"k" * 16, listed, list(up), K, WIDTH, NOW)


def test_a_complete_block_needs_nothing() -> None:
    assert _plan(_listed(range(12))) is None


def test_missing_shards_on_up_nodes_are_missing_on_down_nodes_waiting() -> None:
    plan = _plan(_listed([0, 1, 2, 3, 4, 5, 6, 8, 9, 10]), up=[p for p in range(12) if p != 11])
    assert isinstance(plan, BlockPlan)
    assert (plan.missing, plan.waiting) == ((7,), (11,)), "shards go to their owner, or wait"
    assert plan.holders == (0, 1, 2, 3, 4, 5, 6, 8, 9, 10) and plan.version == V1
    assert plan.expires_at_s == 5000.0, "a rebuilt shard must keep the block's expiry"
    assert plan.cost_bytes == 4096 * (K + 1)


def test_the_newest_readable_version_is_the_target() -> None:
    newer_but_short = _listed([0, 1, 2], V2, written_at_s=20.0)
    older = _listed(range(3, 12), V1)
    plan = _plan(newer_but_short + older)
    assert isinstance(plan, Unrecoverable), "9 shards of V1 and 3 of V2: nothing to rebuild from"
    plan = _plan(_listed(range(0, 10), V1) + _listed([10], V2, written_at_s=20.0))
    assert isinstance(plan, BlockPlan) and plan.version == V1
    assert plan.missing == (11,), "node 10 holds a newer version: it would refuse V1 anyway"


def test_expired_and_misplaced_shards_do_not_count() -> None:
    listed = _listed(range(9)) + _listed([9], expires_at_s=NOW - 1)
    assert isinstance(_plan(listed), Unrecoverable), "an expired shard counted as a survivor"
    misplaced = [Listed(11, V1, 3, 10.0, 5000.0, "chat", 4096)]  # shard 3 on the 12th node
    assert isinstance(_plan(_listed(range(9)) + misplaced), Unrecoverable)
    assert _plan(_listed([], expires_at_s=NOW - 1)) is None


def test_order_most_missing_first_then_longest_lifetime() -> None:
    def plan(missing: tuple[int, ...], expires_at_s: float) -> BlockPlan:
        holders = tuple(p for p in range(12) if p not in missing)
        return BlockPlan("t", b"k" * 16, V1, "chat", 1.0, expires_at_s, 10, K, holders, missing, ())

    a, b, c = plan((11,), 9000.0), plan((10, 11), 2000.0), plan((11,), 3000.0)
    assert repair_order([a, b, c]) == [b, a, c]


@pytest.mark.parametrize(
    ("bytes_ahead", "rate", "skipped"),
    [(0, 1e6, False), (10_000_000, 1e6, True), (10_000_000, 0, False)],
)
def test_blocks_that_expire_before_their_rebuild_are_skipped(
    bytes_ahead: int, rate: float, skipped: bool
) -> None:
    plan = BlockPlan("t", b"k" * 16, V1, "chat", 1.0, NOW + 5.0, 1000, K, (), (11,), ())
    assert expires_before_rebuilt(plan, bytes_ahead, rate, NOW) is skipped
    forever = BlockPlan("t", b"k" * 16, V1, "pinned", 1.0, math.inf, 1000, K, (), (11,), ())
    assert not expires_before_rebuilt(forever, 10**12, 1.0, NOW)


def test_the_leader_is_the_first_member_that_is_up() -> None:
    group = ("a", "b", "c")
    assert group_leader(group, "a", lambda node: False)
    assert not group_leader(group, "b", lambda node: node == "a")
    assert group_leader(group, "b", lambda node: False), "b must take over while a is down"
    assert not group_leader(group, "z", lambda node: False)


def test_a_repair_write_is_fenced_by_a_later_delete(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store()
    key, shard = b"f" * 16, make_shard(b"deleted meanwhile")
    written_at_s = clock.now()
    clock.advance(1.0)
    store.delete("acme", [key])  # a client deletes while the repair rebuilds
    repair = PutOptions(written_at_s=[written_at_s], repair=True)
    result = store.put("acme", "chat", [(key, shard)], repair)
    assert (result.num_stored, result.num_fenced) == (0, 1), "repair brought a deleted block back"
    assert store.contains("acme", [key]) == [[]]
    clock.advance(1.0)
    rewritten = PutOptions(written_at_s=[clock.now()], repair=True)
    assert store.put("acme", "chat", [(key, shard)], rewritten).num_stored == 1, (
        "a version written after the delete must be repairable"
    )
    assert store.put("acme", "chat", [(b"g" * 16, shard)]).num_stored == 1


def test_a_purge_and_a_peers_tombstone_fence_repairs_too(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store()
    shard = make_shard(b"gone")
    written_at_s = clock.now()
    clock.advance(1.0)
    store.purge("acme")
    store.apply_tombstones([Tombstone(1, "globex", b"t" * 16, clock.now())])
    repair = PutOptions(written_at_s=[written_at_s], repair=True)
    assert store.put("acme", "chat", [(b"p" * 16, shard)], repair).num_fenced == 1
    assert store.put("globex", "chat", [(b"t" * 16, shard)], repair).num_fenced == 1
    assert store.put("globex", "chat", [(b"u" * 16, shard)], repair).num_stored == 1


def test_a_write_time_far_ahead_of_the_node_clock_is_refused(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store()
    shard = make_shard(b"from the future")
    ahead = PutOptions(written_at_s=[clock.now() + 3600.0])
    with pytest.raises(InvalidArgument, match="ahead of node"):
        store.put("acme", "chat", [(b"z" * 16, shard)], ahead)
    slightly = PutOptions(written_at_s=[clock.now() + 5.0])  # ordinary clock skew
    assert store.put("acme", "chat", [(b"z" * 16, shard)], slightly).num_stored == 1


def test_a_repaired_shard_keeps_the_block_expiry(make_store: MakeStore, clock: ManualClock) -> None:
    store = make_store()
    expires_at_s = clock.now() + 0.5 * DAY_S
    options = PutOptions(expires_at_s=expires_at_s, written_at_s=[clock.now() - 10])
    store.put("acme", "chat", [(b"r" * 16, make_shard(b"rebuilt"))], options)
    [entry], _ = store.list_group(0, b"", 10)
    assert entry.expires_at_s == expires_at_s, "a rebuilt shard got a fresh TTL"
    assert entry.created_s == clock.now() - 10
    clock.advance(0.6 * DAY_S)
    assert store.contains("acme", [b"r" * 16]) == [[]]


def test_newer_writes_retire_older_versions_and_older_ones_are_superseded(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store()
    key = b"v" * 16
    old, new = make_shard(b"old bytes"), make_shard(b"new bytes")
    now = clock.now()
    assert store.put("acme", "chat", [(key, new)], PutOptions(written_at_s=[now])).num_stored
    late_old = store.put("acme", "chat", [(key, old)], PutOptions(written_at_s=[now - 1]))
    assert (late_old.num_stored, late_old.num_superseded) == (0, 1), "an older write won"
    newest = make_shard(b"newest")
    store.put("acme", "chat", [(key, newest)], PutOptions(written_at_s=[now + 1]))
    assert [r.shards for r in store.get("acme", [key])] == [(newest,)]
    assert store.stats().retired_versions == 1 and store.stats().num_shards == 1


def test_a_version_written_again_is_as_new_as_its_last_write(
    make_store: MakeStore, clock: ManualClock
) -> None:
    """Writers A and B race on a key that already holds B's bytes (B wrote them first at t0).
    B writes them again at t2, A writes its own at t1 (t0 < t1 < t2). Whatever order a node
    sees the two new writes in, it must end with B's version, as every other node does."""
    store, now = make_store(), clock.now()
    a_bytes, b_bytes = make_shard(b"writer a"), make_shard(b"writer b")
    orders = {"b first": [(b_bytes, now + 2), (a_bytes, now + 1)], "a first": []}
    orders["a first"] = orders["b first"][::-1]
    for order, writes in orders.items():
        key = order.encode().ljust(16, b".")  # one key per order, as on two nodes
        store.put("acme", "chat", [(key, b_bytes)], PutOptions(written_at_s=[now]))
        for shard, written_at_s in writes:
            store.put("acme", "chat", [(key, shard)], PutOptions(written_at_s=[written_at_s]))
        assert [r.shards for r in store.get("acme", [key])] == [(b_bytes,)], (
            f"{order}: a re-put kept its first write time, so an older write won on this node "
            "and the block split between two versions across nodes"
        )


class _FakeStore:
    """What a pull touches before it reaches a peer (the peers here are all down)."""

    def counter(self, name: str) -> int:
        return 0


async def test_a_node_is_ready_for_repair_only_once_a_full_pull_reached_its_store(
    tmp_path: Path,
) -> None:
    config = local_config(tmp_path, 12)  # nothing listens on its ports: every peer is down
    current: list[_FakeStore | None] = [None]
    with ThreadPoolExecutor(1) as executor:
        sync = TombstoneSync(config, config.nodes[0], lambda: current[0], executor)
        try:
            await sync.pull_all()
            assert not sync.synced, "ready with no store open"
            current[0] = _FakeStore()
            assert not sync.synced, "ready before pulling the peers' logs"
            await sync.pull_all()
            assert sync.synced, "peers that are down must not hold readiness back"
            current[0] = _FakeStore()  # the index was rebuilt: its deletes and cursors are gone
            assert not sync.synced, "ready again before pulling into the rebuilt index"
        finally:
            await sync.close()
