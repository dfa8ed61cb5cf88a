"""``kvstore bench storage``'s best-of-each rows: each side's best setting, both ratios, and
the targets held to the baseline of the same fsync state."""

from __future__ import annotations

import pytest

from bench.storage.report import Result, best_of_each

MiB = 1 << 20


def _result(system: str, op: str, mb_per_s: float, cpu: float, **fields: object) -> Result:
    values: dict = {
        "system": system,
        "op": op,
        "block_bytes": 4 * MiB,
        "concurrency": 8,
        "straggler_ms": 0.0,
        "mb_per_s": mb_per_s,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        "p999_ms": 3.0,
        "num_ops": 10,
        "seconds": 1.0,
        "total_cpu_s_per_gb": cpu,
        "transport": "grpc" if system.startswith("kvstore") else "",
        "fsync": "on" if system.startswith("kvstore") else "off",
    }
    values.update(fields)
    return Result(**values)


def test_each_side_picks_its_fastest_and_its_cheapest_setting() -> None:
    results = [
        _result("kvstore", "put", 300.0, 3.0, batch=1),
        _result("kvstore", "put", 500.0, 4.0, batch=8),  # fastest, not cheapest
        _result("kvstore/local", "put", 400.0, 2.0, transport="local"),  # cheapest
        _result("kvstore", "put", 900.0, 1.0, straggler_ms=50.0),  # a straggler run: ignored
        _result("kvstore/sealed", "put", 900.0, 1.0),  # a variant: ignored
        _result("redis", "put", 1000.0, 1.0),
        _result("redis/fsync", "put", 250.0, 2.0, fsync="always"),
        _result("redis/fsync", "put", 200.0, 1.0, fsync="always", batch=8),
    ]
    rows = {row["baseline"]: row for row in best_of_each(results)}
    assert set(rows) == {"redis", "redis/fsync"}, "PUTs compare once per baseline"
    durable = rows["redis/fsync"]
    assert durable["transport"] == "any", "PUTs take kvstore's best over every read transport"
    assert (durable["mb_per_s"], durable["baseline_mb_per_s"]) == (500.0, 250.0)
    assert durable["mb_ratio"] == pytest.approx(2.0)
    assert durable["cpu_ratio"] == pytest.approx(2.0), "cheapest of each: 2.0 vs 1.0 CPU-s/GB"
    assert (durable["mb_target"], durable["cpu_target"]) == (1.0, 3.0)
    assert rows["redis"]["mb_target"] is None, "a fsyncing kvstore is held to fsyncing Redis"


def test_gets_compare_per_read_transport_against_redis_without_persistence() -> None:
    results = [
        _result("kvstore", "get", 300.0, 2.0),
        _result("kvstore/local", "get", 900.0, 1.0, transport="local"),
        _result("kvstore", "get", 100.0, 9.0, repeat=1),  # the calm repeat: ignored
        _result("redis", "get", 600.0, 0.5),
    ]
    rows = {row["transport"]: row for row in best_of_each(results)}
    assert set(rows) == {"grpc", "local"}
    assert rows["local"]["mb_ratio"] == pytest.approx(1.5) and rows["local"]["mb_target"] == 1.5
    assert rows["grpc"]["mb_ratio"] == pytest.approx(0.5) and rows["grpc"]["mb_target"] == 1.0
    assert rows["grpc"]["cpu_ratio"] == pytest.approx(4.0) and rows["grpc"]["cpu_target"] == 2.0
