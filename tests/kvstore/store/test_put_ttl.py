"""A put's own TTL (``PutOptions.ttl_s``, PutShardsRequest.ttl_s) on the store, with a manual
clock: it replaces the class TTL when shorter, never beyond the class or the tenant's cap,
counts from the last access like every TTL, survives refreshes, restarts, repair writes and
a rebuilt index; and ``inspect`` shows what a node holds without touching it."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvstore.store.shard_store import PutOptions, Status
from tests.kvstore.node_harness import DAY_S, make_shard, version_of
from tests.kvstore.store_harness import T0 as START_S
from tests.kvstore.store_harness import MakeStore
from ttl.clock import ManualClock

HOUR_S = 3600.0
KEY, OTHER = b"k" * 16, b"o" * 16


def _expiry(store, key: bytes = KEY) -> float:
    ((entry, intact),) = store.inspect("acme", [key])[0]
    assert intact, "a fresh shard failed its checksum"
    return entry.expires_at_s


def test_own_ttl_is_kept_by_refreshes(make_store: MakeStore, clock: ManualClock) -> None:
    store = make_store()
    store.put("acme", "chat", [(KEY, make_shard(b"short"))], PutOptions(ttl_s=HOUR_S))
    store.put("acme", "chat", [(OTHER, make_shard(b"long"))])
    assert _expiry(store) == START_S + HOUR_S, "the put's TTL was not used"
    assert _expiry(store, OTHER) == START_S + 7 * DAY_S, "a plain put lost its class TTL"
    clock.advance(HOUR_S / 2)
    assert store.get("acme", [KEY])[0].status == Status.HIT
    store.flush()
    assert _expiry(store) == START_S + 1.5 * HOUR_S, "a read hit gave the block its class TTL"
    clock.advance(HOUR_S)
    assert store.get("acme", [KEY])[0].status == Status.MISS, "read past its own TTL"
    assert store.get("acme", [OTHER])[0].status == Status.HIT


def test_own_ttl_never_exceeds_class_or_cap(make_store: MakeStore) -> None:
    store = make_store()
    store.put("acme", "agent", [(KEY, make_shard(b"a"))], PutOptions(ttl_s=30 * DAY_S))
    assert _expiry(store) == START_S + 3 * DAY_S, "a put outlived its class TTL"
    store.set_retention_caps({"acme": {"chat": 2 * HOUR_S}})
    store.put("acme", "chat", [(OTHER, make_shard(b"c"))], PutOptions(ttl_s=DAY_S))
    assert _expiry(store, OTHER) == START_S + 2 * HOUR_S, "a put outlived its tenant's cap"


def test_own_ttl_survives_a_repair_and_a_lost_index(
    make_store: MakeStore, clock: ManualClock, tmp_path: Path
) -> None:
    store = make_store()
    store.put("acme", "chat", [(KEY, make_shard(b"x"))], PutOptions(ttl_s=HOUR_S))
    clock.advance(600.0)
    # A repair's write keeps the block's expiry and, as an index rebuild infers it from the
    # write time, the block's own TTL.
    store.put(
        "acme",
        "chat",
        [(OTHER, make_shard(b"y"))],
        PutOptions(written_at_s=[START_S], expires_at_s=START_S + HOUR_S, repair=True),
    )
    assert _expiry(store, OTHER) == START_S + HOUR_S
    clock.advance(600.0)
    store.get("acme", [KEY, OTHER])
    store.flush()
    assert _expiry(store) == clock.now() + HOUR_S
    assert _expiry(store, OTHER) == clock.now() + HOUR_S, "a repaired block took its class TTL"
    if not (tmp_path / "index").exists():
        return  # the memory variant keeps no index on disk to lose
    store.close()
    store.close = lambda: None  # closed here: the fixture's teardown must not close it again
    shutil.rmtree(tmp_path / "index")
    rebuilt = make_store()
    clock.advance(600.0)
    rebuilt.get("acme", [KEY])
    rebuilt.flush()
    assert _expiry(rebuilt) == clock.now() + HOUR_S, "a rebuilt index forgot the block's TTL"


def test_inspect_is_no_access(make_store: MakeStore, clock: ManualClock) -> None:
    store = make_store()
    store.put("acme", "chat", [(KEY, make_shard(b"v1"))])
    clock.advance(60.0)
    store.put("acme", "chat", [(KEY, make_shard(b"v2"))])
    before = store.stats()
    ((entry, intact),) = store.inspect("acme", [KEY])[0]
    assert intact and entry.version == version_of(b"v2"), "inspect shows the newest version"
    assert entry.created_s == START_S + 60.0 and entry.traffic_class == "chat"
    assert store.inspect("globex", [KEY]) == [[]], "inspect crossed tenants"
    assert store.inspect("acme", [OTHER]) == [[]]
    clock.advance(60.0)
    store.flush()
    after = store.stats()
    assert (after.hits, after.misses) == (before.hits, before.misses), "inspect counted reads"
    assert _expiry(store) == START_S + 60.0 + 7 * DAY_S, "inspect refreshed the TTL"
