"""Capacity eviction in both configured orders, on a store with a manual clock.

Every record here is a 4,000-byte payload: 4,088 bytes with the shard and record headers. With
``max_bytes=100_000``, ``high_watermark=0.9`` and ``low_watermark=0.5`` the 23rd record passes
90 kB and eviction frees 11 records (down to 50 kB, with room for the new one). Each scenario
is built so that the two orders evict different sets.
"""

from __future__ import annotations

import pytest

from kvstore.store.shard_store import ShardStore, Status
from tests.kvstore.node_harness import DAY_S, make_shard
from tests.kvstore.store_harness import MakeStore
from ttl.clock import ManualClock

PRESSURE = {"max_bytes": 100_000, "high_watermark": 0.9, "low_watermark": 0.5}


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _shard(i: int) -> bytes:
    """A shard whose record takes about 4,088 bytes: 48-byte shard header, 3,972 payload
    bytes, and a record header of 60 bytes plus the class and tenant names."""
    return make_shard(bytes([i]) * 3_972)


def _put_one_per_second(
    store: ShardStore, clock: ManualClock, traffic_class: str, keys: range
) -> None:
    """One request per key, one second apart: distinct last-access times."""
    for i in keys:
        store.put("acme", traffic_class, [(_key(i), _shard(i))])
        clock.advance(1)


def _advance_to(clock: ManualClock, time_s: float) -> None:
    clock.advance(time_s - clock.now())


def _present(store: ShardStore, order: list[int]) -> list[bool]:
    return [len(v) == 1 for v in store.contains("acme", [_key(i) for i in order])]


def _num_evicted_prefix(present: list[bool]) -> int:
    """How many leading keys are gone; fails unless the gone ones are exactly a prefix."""
    num_evicted = present.index(True) if True in present else len(present)
    assert present == [False] * num_evicted + [True] * (len(present) - num_evicted), (
        f"evicted set is not a prefix of the expected eviction order: {present}"
    )
    return num_evicted


def test_lru_evicts_least_recently_accessed_first_whatever_the_class(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store(**PRESSURE)  # the default order
    assert store.ttl.eviction_order == "lru", "LRU must be the default eviction order"
    t0 = clock.now()
    _put_one_per_second(store, clock, "chat", range(10))  # chat 0-9 on day 0
    _advance_to(clock, t0 + DAY_S)
    _put_one_per_second(store, clock, "agent", range(10, 20))  # agent 10-19 on day 1
    _advance_to(clock, t0 + 1.5 * DAY_S)
    assert store.get("acme", [_key(0)])[0].status == Status.HIT  # chat 0: now the newest
    _advance_to(clock, t0 + 2 * DAY_S)
    _put_one_per_second(store, clock, "chat", range(20, 24))  # the 23rd record: eviction
    order = [*range(1, 10), *range(10, 20), 0, *range(20, 24)]
    num_evicted = _num_evicted_prefix(_present(store, order))
    assert num_evicted == 11, f"{num_evicted} evicted: need 11 to get under 50 kB with room"
    chat, agent = store.stats().classes[0], store.stats().classes[1]
    assert (chat.evicted, agent.evicted) == (9, 2), "day-0 chat blocks must go before agents"
    evicted_at = t0 + 2 * DAY_S + 2  # when record 22 passed the high watermark
    assert chat.youngest_evicted_age_s == evicted_at - (t0 + 9), (
        "youngest_evicted_age_s must be now - last access of the freshest evicted chat (9)"
    )
    assert agent.youngest_evicted_age_s == evicted_at - (t0 + DAY_S + 1), (
        "youngest_evicted_age_s must be now - last access of the freshest evicted agent (11)"
    )


def test_expiry_order_evicts_agent_before_chat_written_at_the_same_time(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store(eviction_order="expiry", **PRESSURE)
    t0 = clock.now()
    for i in range(10):  # chat i and agent 10+i in the same second
        store.put("acme", "chat", [(_key(i), _shard(i))])
        store.put("acme", "agent", [(_key(10 + i), _shard(10 + i))])
        clock.advance(1)
    _advance_to(clock, t0 + DAY_S)
    _put_one_per_second(store, clock, "chat", range(20, 24))
    order = [*range(10, 20), *range(10), *range(20, 24)]
    num_evicted = _num_evicted_prefix(_present(store, order))
    assert num_evicted == 11, f"{num_evicted} evicted: need 11 to get under 50 kB with room"
    chat, agent = store.stats().classes[0], store.stats().classes[1]
    assert (chat.evicted, agent.evicted) == (1, 10), "every agent block expires first"
    assert agent.youngest_evicted_age_s == DAY_S + 2 - 9, "age of agent 19 when evicted"


@pytest.mark.parametrize("eviction_order", ["lru", "expiry"])
def test_a_re_put_block_is_not_evicted_to_make_room_for_its_own_put(
    make_store: MakeStore, clock: ManualClock, eviction_order: str
) -> None:
    store = make_store(eviction_order=eviction_order, **PRESSURE)
    _put_one_per_second(store, clock, "agent", range(22))  # 22 records: just under 90 kB
    store.put("acme", "agent", [(_key(0), _shard(0)), (_key(22), _shard(22))])
    assert _present(store, [0])[0], (
        "block 0 was re-put by the request that triggered eviction, then evicted by it: "
        "the put reported it stored but the node lost it"
    )
    num_evicted = _num_evicted_prefix(_present(store, [*range(1, 22), 22]))
    assert num_evicted == 11, f"{num_evicted} evicted: the next oldest must go instead of 0"


@pytest.mark.parametrize("eviction_order", ["lru", "expiry"])
def test_infinite_ttl_blocks_are_never_evicted(
    make_store: MakeStore, clock: ManualClock, eviction_order: str
) -> None:
    store = make_store(eviction_order=eviction_order, **PRESSURE)
    _put_one_per_second(store, clock, "pinned", range(5))  # the least recently accessed
    _put_one_per_second(store, clock, "chat", range(10, 29))  # 24 records in all
    assert all(_present(store, list(range(5)))), "a block of an infinite-TTL class was evicted"
    num_evicted = _num_evicted_prefix(_present(store, list(range(10, 29))))
    assert num_evicted == 11, f"{num_evicted} evicted: expirable blocks must go instead"
