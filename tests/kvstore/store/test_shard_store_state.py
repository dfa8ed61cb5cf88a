"""A Hypothesis state machine: a real ShardStore (lmdb index, files on disk, a manual clock)
against a plain dict of what it must hold.

Rules add new keys, overwrite keys with new versions, delete, read, let time pass (the classes'
TTLs), fill a small byte limit (puts evict), restart the store and lose its index (rebuilt from
the segment records). After every step no key may answer other bytes than the model's.

Checked by breaking the store on purpose (each caught, then restored): a get served from a stale
cache, older versions kept and read, LRU eviction by expiry order, a rebuild preferring the
older version, and read hits that do not refresh the TTL.

What the model knows exactly, and what it only bounds:

* A key's bytes: always exactly (one version per key: a newer write retires the older).
* Expiry and the LRU order: exactly while the index lives (``Held.exact``). A rebuilt index
  lost the TTL refreshes (kvstore/store/index_rebuild.py): an entry expires between its record's
  expiry and its last refresh's, and its last access is unknown, until a read refreshes it.
* Eviction: which keys go is LRU (exact): every evicted key was accessed before every key that
  survived. How many go depends on dead bytes and compaction, so it is only bounded: what is
  left fits the limit.
* A rebuild may bring back an evicted or deleted key's record while its bytes are still on disk
  (documented in index_rebuild.py): the key answers bytes once written for it, never others.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.config import NodeConfig, TTLConfig
from kvstore.store.shard_store import ShardStore, Status
from tests.kvstore.node_harness import make_shard, version_of
from tests.kvstore.store_harness import T0, TEST_INDEX_RESERVE_BYTES, lmdb_index_bytes
from ttl.clock import ManualClock
from ttl.policy import TrafficClasses

TENANT = "acme"
CLASSES = TrafficClasses({"chat": 90.0, "agent": 40.0})
NUM_KEYS = 8
DATA_BYTES = 2400  # segment data the store may hold: a handful of shards, so puts evict
SEGMENT_MAX_BYTES = 1200  # several segments, so compaction and whole-file frees happen
# Reopening is the costly rule and Hypothesis draws it as often as any other: a few steps
# between reopens leave room for the sequences that need several (read, overwrite, read).
STEPS_BETWEEN_REOPENS = 4


def _key(key_id: int) -> bytes:
    return key_id.to_bytes(16, "big")


@dataclass(frozen=True)
class Held:
    """The version of a key the store holds, as far as the model knows it."""

    shard: bytes
    version: bytes
    traffic_class: str
    last_access_s: float
    expires_at_s: float  # exact when ``exact``, else the latest it can be
    record_expires_at_s: float  # the earliest it can expire (a rebuild's view of it)
    exact: bool = True  # False after a rebuild until a read refreshes it

    def must_live(self, now: float) -> bool:
        """The store must answer this version (nothing can have expired or lost it)."""
        return now < (self.expires_at_s if self.exact else self.record_expires_at_s)

    def may_live(self, now: float) -> bool:
        return now < self.expires_at_s


def _payload(serial: int, num_bytes: int) -> bytes:
    """Distinct bytes for every write (so every write is a new version)."""
    return (serial.to_bytes(4, "big") * (num_bytes // 4 + 1))[:num_bytes]


class ShardStoreMachine(RuleBasedStateMachine):
    """The store on a temporary directory against ``self.model`` (key id -> Held)."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="store-state-"))
        self.clock = ManualClock(T0)
        index_bytes = lmdb_index_bytes(self.root / "probe", TEST_INDEX_RESERVE_BYTES)
        self.node = NodeConfig(
            "n0",
            "127.0.0.1:1",
            0,
            "d0",
            str(self.root / "data"),
            fsync=False,
            max_bytes=DATA_BYTES + index_bytes,
            segment_max_bytes=SEGMENT_MAX_BYTES,
            index_reserve_bytes=TEST_INDEX_RESERVE_BYTES,
            scrub_bytes_per_s=0,
        )
        self.ttl = TTLConfig(classes=CLASSES, expiry_window_s=60.0)
        self.store = ShardStore(self.node, self.ttl, self.clock)
        self.model: dict[int, Held] = {}
        # Every version ever written, per key id: version -> (shard, traffic class).
        self.written: dict[int, dict[bytes, tuple[bytes, str]]] = {}
        self.serial = 0
        self.expected_hits = self.expected_misses = self.expected_evicted = 0
        self.steps_since_reopen = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- rules ------------------------------------------------------------------------------

    @precondition(lambda self: len(self.model) < NUM_KEYS)
    @rule(
        data=st.data(),
        traffic_class=st.sampled_from(CLASSES.names),
        payload_bytes=st.integers(64, 480),
    )
    def add_keys(self, data: st.DataObject, traffic_class: str, payload_bytes: int) -> None:
        """New keys in one request: all stored (evicting others when the limit is near).

        Named to sort first: here Hypothesis drew the first rule by name most often, and adding
        keys is the rule that fills the store."""
        free = [k for k in range(NUM_KEYS) if k not in self.model]
        key_ids = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=3, unique=True))
        self._put(key_ids, traffic_class, payload_bytes)

    @precondition(lambda self: self.model)
    @rule(
        data=st.data(),
        traffic_class=st.sampled_from(CLASSES.names),
        payload_bytes=st.integers(64, 480),
    )
    def overwrite(self, data: st.DataObject, traffic_class: str, payload_bytes: int) -> None:
        """New versions of held keys (perhaps in another class): they replace the old ones."""
        held = sorted(self.model)
        key_ids = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=2, unique=True))
        self._put(key_ids, traffic_class, payload_bytes)

    def _put(self, key_ids: list[int], traffic_class: str, payload_bytes: int) -> None:
        self._tick()
        now = self.clock.now()
        ttl_s = CLASSES.ttl_s(traffic_class)
        new = {}
        for key_id in key_ids:
            self.serial += 1
            payload = _payload(self.serial, payload_bytes)
            new[key_id] = Held(
                make_shard(payload),
                version_of(payload),
                traffic_class,
                now,
                now + ttl_s,
                now + ttl_s,
            )
        before = self._live_snapshot()
        retired_before = self.store.stats().retired_versions
        result = self.store.put(TENANT, traffic_class, [(_key(k), h.shard) for k, h in new.items()])
        assert result.num_stored == len(new), f"new versions were not stored: {result}"
        assert self.store.contains(TENANT, [_key(k) for k in new]) == [
            [h.version] for h in new.values()
        ], "a put's keys were lost right after it"
        overwritten = [h for k in new if (h := self.model.pop(k, None)) is not None]
        for key_id, held in new.items():
            self.model[key_id] = held
            self.written.setdefault(key_id, {})[held.version] = (held.shard, traffic_class)
        retired = self.store.stats().retired_versions - retired_before
        self._settle_evictions(before, set(new), overwritten, retired)

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        """Read up to three distinct keys, mostly held ones: exactly the model's bytes, or a
        miss the model allows."""
        self._tick()
        any_key = st.integers(0, NUM_KEYS - 1)
        held_key = st.sampled_from(sorted(self.model)) if self.model else any_key
        key_ids = data.draw(st.lists(held_key | any_key, min_size=1, max_size=3, unique=True))
        results = self.store.get(TENANT, [_key(k) for k in key_ids])
        now = self.clock.now()
        for key_id, result in zip(key_ids, results, strict=True):
            held = self.model.get(key_id)
            assert result.status != Status.CORRUPT, f"key {key_id}: a clean shard read corrupt"
            if result.status == Status.HIT:
                assert held is not None and held.may_live(now), (
                    f"key {key_id}: served bytes the model holds no live version of (deleted, "
                    "evicted or expired data came back)"
                )
                assert result.shards == (held.shard,), f"key {key_id}: wrong bytes served"
                ttl_s = CLASSES.ttl_s(held.traffic_class)
                self.model[key_id] = replace(
                    held, last_access_s=now, expires_at_s=now + ttl_s, exact=True
                )
                self.expected_hits += 1
            else:
                assert held is None or not held.must_live(now), f"key {key_id}: live key missed"
                self.model.pop(key_id, None)
                self.expected_misses += 1

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        """Delete a held key (mostly) or any key: every version goes."""
        held = sorted(self.model)
        key_id = data.draw(st.sampled_from(held) if held else st.integers(0, NUM_KEYS - 1))
        self._tick()
        held = self.model.pop(key_id, None)
        num_removed = self.store.delete(TENANT, [_key(key_id)])
        must = held is not None and held.must_live(self.clock.now())
        assert (num_removed == 1) if must else (num_removed in (0, 1)), (
            f"key {key_id}: delete removed {num_removed} versions (one version per key)"
        )

    @rule(seconds=st.integers(1, 30))
    def wait_and_expire(self, seconds: int) -> None:
        """Time passes (past some TTLs); reclaiming leaves exactly the live keys indexed."""
        self.clock.advance(seconds)
        self.store.expire()
        self._drop_missing(self._live_snapshot())
        stats = self.store.stats()
        # The model now holds exactly the keys the store answers (the invariant checks that).
        assert stats.num_shards == len(self.model), (
            "after expire() the index holds entries that are not live (or lost live ones)"
        )
        assert stats.shard_bytes == sum(len(h.shard) for h in self.model.values()), (
            "the per-class byte counts drifted from the entries"
        )

    @precondition(lambda self: self.steps_since_reopen >= STEPS_BETWEEN_REOPENS)
    @rule(lose_index=st.booleans())
    def restart(self, lose_index: bool) -> None:
        """Close and reopen on the same directory: nothing changes, counters included. With
        ``lose_index`` the index files are deleted in between: it is rebuilt from the segment
        records."""
        self._tick()
        self.store.close()
        if lose_index:
            shutil.rmtree(Path(self.node.data_dir) / "index")
        self.store = ShardStore(self.node, self.ttl, self.clock)
        self.steps_since_reopen = 0
        if lose_index:
            self._reanchor_after_rebuild()

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def holds_what_the_model_says(self) -> None:
        """Every key's live version (Contains, which refreshes nothing) is the model's."""
        now = self.clock.now()
        for key_id, versions in self._live_snapshot().items():
            held = self.model.get(key_id)
            if held is None:
                assert versions == [], f"key {key_id}: holds {versions}, the model none"
            elif held.must_live(now):
                assert versions == [held.version], f"key {key_id}: lost or wrong version"
            else:
                assert versions in ([], [held.version]), f"key {key_id}: wrong version"

    @invariant()
    def counts_agree(self) -> None:
        stats = self.store.stats()
        now = self.clock.now()
        assert stats.num_shards >= sum(h.must_live(now) for h in self.model.values())
        assert (stats.hits, stats.misses) == (self.expected_hits, self.expected_misses), (
            "hit or miss counts drifted from the reads made"
        )
        assert sum(c.evicted for c in stats.classes) == self.expected_evicted, (
            "the evicted count differs from the keys evicted"
        )
        assert stats.used_bytes <= stats.capacity_bytes, "the store is over its byte limit"

    # -- helpers ----------------------------------------------------------------------------

    def _tick(self) -> None:
        """One second per step: writes and reads of different steps never tie in time."""
        self.clock.advance(1.0)
        self.steps_since_reopen += 1

    def _live_snapshot(self) -> dict[int, list[bytes]]:
        key_ids = range(NUM_KEYS)
        versions = self.store.contains(TENANT, [_key(k) for k in key_ids])
        return dict(zip(key_ids, versions, strict=True))

    def _drop_missing(self, live: dict[int, list[bytes]]) -> list[int]:
        """Forget the keys the store no longer holds; return those that had to be held."""
        now = self.clock.now()
        must_missing = []
        for key_id in [k for k in self.model if not live[k]]:
            if self.model.pop(key_id).must_live(now):
                must_missing.append(key_id)
        return must_missing

    def _settle_evictions(
        self,
        before: dict[int, list[bytes]],
        put_ids: set[int],
        overwritten: list[Held],
        num_retired: int,
    ) -> None:
        """After a put: the keys it evicted were the least recently accessed, and counted."""
        now = self.clock.now()
        candidates = {k: h for k, h in self.model.items() if k not in put_ids and before[k]}
        maybe = sum(h.may_live(now) and not h.must_live(now) for h in candidates.values())
        evicted_ids = self._drop_missing(self._live_snapshot())
        evicted = sum(c.evicted for c in self.store.stats().classes) - self.expected_evicted
        # An overwritten version is evicted (counted) or retired by the commit, or expired.
        extra = evicted - len(evicted_ids)
        assert 0 <= extra <= maybe + sum(h.may_live(now) for h in overwritten), (
            f"{evicted} entries counted evicted, the model saw {len(evicted_ids)} go"
        )
        if not maybe and all(h.must_live(now) for h in overwritten):
            assert extra + num_retired == len(overwritten), (
                "an overwritten version was neither retired nor evicted"
            )
        self.expected_evicted += evicted
        self._check_lru(candidates, evicted_ids)

    def _check_lru(self, candidates: dict[int, Held], evicted_ids: list[int]) -> None:
        """LRU: every evicted key was accessed before every survivor. Keys read together tie
        in time; the index orders those by key bytes (kvstore/store/index_codec.py)."""
        exact = {k: h for k, h in candidates.items() if h.exact}
        gone = [_lru_order(k, exact[k]) for k in evicted_ids if k in exact]
        kept = [_lru_order(k, h) for k, h in exact.items() if k in self.model]
        if gone and kept:
            assert max(gone) < min(kept), (
                "eviction dropped a key accessed after one it kept: the LRU order is broken"
            )

    def _reanchor_after_rebuild(self) -> None:
        """A rebuilt index: held keys must be back (their bytes exactly, refreshes lost); a
        key the model dropped may come back only with bytes once written for it."""
        now = self.clock.now()
        stats = self.store.stats()
        self.expected_hits, self.expected_misses = stats.hits, stats.misses
        self.expected_evicted = sum(c.evicted for c in stats.classes)
        for key_id, versions in self._live_snapshot().items():
            held = self.model.pop(key_id, None)
            if held is not None and now < held.record_expires_at_s:
                assert versions == [held.version], f"key {key_id}: the rebuild lost it"
            if not versions:
                continue
            (version,) = versions
            assert version in self.written.get(key_id, {}), (
                f"key {key_id}: rebuilt with a version never written for it"
            )
            if held is not None and held.version == version:
                self.model[key_id] = replace(held, exact=False)
                continue
            # An older or evicted version came back: when it expires is unknown.
            shard, traffic_class = self.written[key_id][version]
            self.model[key_id] = Held(shard, version, traffic_class, 0.0, math.inf, now, False)


def _lru_order(key_id: int, held: Held) -> tuple[float, bytes]:
    return (held.last_access_s, _key(key_id))


ShardStoreMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, derandomize=True, database=None
)
test_shard_store_state = ShardStoreMachine.TestCase
