"""Pure read/write logic: version grouping, presence tally, read plans, node health."""

from __future__ import annotations

import random

import xxhash

from client.node_health import PROBE_EVERY, SUSPECT_MAX_S, NodeHealth
from client.read_plan import healthy_plan, plan_read
from client.shard_tally import PresenceTally, ShardCollector
from erasure.codec import make_codec
from erasure.config import CodecConfig
from erasure.shard import HEADER_BYTES, ShardHeader, pack_header

CODEC = make_codec(CodecConfig(k=10, m=2, backend="isal"))


def _shard(version_seed: int, index: int, payload_bytes: int = 64, **overrides: object) -> bytes:
    """A well-formed shard of a made-up block version (the payload is not a real encoding)."""
    version = xxhash.xxh3_128_digest(version_seed.to_bytes(8, "little"))
    payload = random.Random(version_seed * 100 + index).randbytes(payload_bytes)
    fields = dict(backend="isal", k=10, m=2, index=index, block_len=640)
    fields.update(overrides)
    header = ShardHeader(block_checksum=version, payload_len=len(payload), **fields)  # type: ignore[arg-type]
    return pack_header(header, payload) + payload


def test_collector_completes_one_version_and_never_mixes() -> None:
    collector = ShardCollector(CODEC)
    for i in range(9):
        assert collector.add(_shard(1, i)) is None
        assert collector.add(_shard(2, i + 3)) is None
    assert collector.add(_shard(1, 5)) is None, "a duplicate index must not count twice"
    version = collector.add(_shard(1, 11))
    assert version is not None, "version 1 has 10 distinct shards"
    shards = collector.shards(version)
    assert [s[8] for s in shards] == [*range(9), 11], "shards must come sorted by index"
    assert all(s == _shard(1, s[8]) for s in shards), "a shard of another version slipped in"


def test_collector_skips_and_counts_corrupt_and_foreign_shards() -> None:
    collector = ShardCollector(CODEC)
    flipped = bytearray(_shard(1, 0))
    flipped[HEADER_BYTES + 3] ^= 0xFF
    assert collector.add(bytes(flipped)) is None
    assert collector.add(b"garbage") is None
    assert collector.add(_shard(1, 1, backend="zfec")) is None
    assert collector.add(_shard(1, 2, block_len=999)) is None, "payload length must fit block"
    assert collector.num_corrupt == 4
    assert collector.best_count == 0


def test_dropped_version_is_ignored_afterwards() -> None:
    collector = ShardCollector(CODEC)
    collector.add(_shard(1, 0))
    collector.drop(xxhash.xxh3_128_digest((1).to_bytes(8, "little")))
    assert collector.add(_shard(1, 1)) is None and collector.best_count == 0


def test_presence_tally_decides_early() -> None:
    v1, v2 = b"a" * 16, b"b" * 16
    tally = PresenceTally([12, 12, 12], k=10)
    for _ in range(10):
        tally.add_reply(0, [v1])
    assert tally.readable[0] is True, "10 nodes hold v1: readable"
    for _ in range(3):
        tally.add_no_reply(1)
    assert tally.readable[1] is False, "3 of 12 nodes cannot answer: k=10 is out of reach"
    for _ in range(6):
        tally.add_reply(2, [v1])
        tally.add_reply(2, [v2])
    assert tally.readable[2] is False, "6+6 shards of two versions must not count as 12"
    assert tally.all_decided


def test_read_plan_prefers_data_shards_and_skips_bad_nodes() -> None:
    healthy, on_time = [False] * 12, [0.0] * 12
    plan = plan_read(10, 11, healthy, on_time, healthy)
    assert plan.ask == tuple(range(11)) and plan.reserve == (11,), "all data shards + 1 parity"
    assert healthy_plan(10, 11, 12) == plan, "a healthy group's shared plan differs"
    suspect = [i in (2, 5) for i in range(12)]
    plan = plan_read(10, 11, suspect, on_time, healthy)
    assert plan.ask == (0, 1, 3, 4, 6, 7, 8, 9, 10, 11, 2), "healthy first, then one suspect"
    assert plan.reserve == (5,)
    late = [0.9 if i == 4 else 0.1 for i in range(12)]
    plan = plan_read(10, 11, healthy, late, healthy)
    assert 4 not in plan.ask and plan.reserve == (4,), "a slow node goes to the reserve"
    plan = plan_read(10, 11, healthy, late, [i == 4 for i in range(12)])
    assert 4 in plan.ask and len(plan.ask) == 12, "a probe is an extra, not a replacement"
    two_slow = [{0: 1.0, 7: 0.7}.get(i, 0.0) for i in range(12)]
    plan = plan_read(10, 11, healthy, two_slow, healthy)
    assert plan.reserve == (0,), "of two slow nodes the read must skip the slower one"


def test_node_health_backoff_and_slowness() -> None:
    health = NodeHealth()
    health.record_failure(now_s=100.0)
    assert health.is_suspect(101.0) and not health.is_suspect(102.5)
    health.record_failure(now_s=101.0)
    assert not health.is_suspect(102.5), "a failure while suspect (same outage) lengthened it"
    for _ in range(10):  # each a failed probe, once the window passed
        health.record_failure(now_s=health.suspect_until_s)
    assert health.suspect_window_s == SUSPECT_MAX_S
    health.record_success()
    assert not health.is_suspect(100.0)
    for _ in range(5):
        health.record_lateness(True)
    assert health.is_slow
    probes = [health.take_probe() for _ in range(2 * PROBE_EVERY)]
    assert sum(probes) == 2
    for _ in range(10):
        health.record_lateness(False)
    assert not health.is_slow


def test_typical_lateness_does_not_look_slow() -> None:
    rng = random.Random(0)
    health = NodeHealth()
    flagged = 0
    for _ in range(10_000):
        health.record_lateness(rng.random() < 1 / 11)
        flagged += health.is_slow
    assert flagged < 50, "a node late 1 read in 11 (the normal 11th) must not be flagged slow"
