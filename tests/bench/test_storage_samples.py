"""``kvstore bench storage``'s records from measured samples: CPU per GB where bytes moved, and
None with the reason (never a quotient by a near-zero) where none did."""

from __future__ import annotations

import json
from dataclasses import asdict

from rich.console import Console

from bench.storage.report import Result, best_of_each, results_table
from bench.storage.workload import _Samples

MiB = 1 << 20
SETTING = (4 * MiB, 8, 2)  # block bytes, concurrency, batch


def _samples(num_calls: int, num_false: int) -> _Samples:
    samples = _Samples(client_cpu_s=0.5, server_cpu_s=1.5)
    samples.add([0.01] * num_calls, num_false, elapsed_s=1.0)
    return samples


def _record(samples: _Samples, system: str = "kvstore") -> Result:
    return samples.result(system, "get", SETTING, 0.0, 0, "grpc")


def test_cpu_per_gb_divides_by_the_bytes_moved() -> None:
    record = _record(_samples(num_calls=10, num_false=5))  # 5 calls x 2 keys x 4 MiB moved
    gb = 5 * 2 * 4 * MiB / 1e9
    assert record.client_cpu_s_per_gb == round(0.5 / gb, 3)
    assert record.total_cpu_s_per_gb == round(2.0 / gb, 3)
    assert record.cpu_s_per_gb_none == "", "a record with figures names no reason"


def test_a_record_with_no_bytes_moved_has_no_cpu_per_gb_and_says_why() -> None:
    record = _record(_samples(num_calls=7, num_false=7))  # every call failed
    cpu = (record.client_cpu_s_per_gb, record.server_cpu_s_per_gb, record.total_cpu_s_per_gb)
    assert cpu == (None, None, None), f"CPU per GB of zero bytes must be None, got {cpu}"
    assert "no bytes moved" in record.cpu_s_per_gb_none and "7 of 7" in record.cpu_s_per_gb_none
    fields = json.loads(json.dumps(asdict(record)))
    assert fields["total_cpu_s_per_gb"] is None, "the JSON must say null, not a huge number"
    console = Console(width=400, record=True)
    console.print(results_table([record]))
    assert "-" in console.export_text(), "the table shows no figure for the record"


def test_a_record_with_no_bytes_is_left_out_of_the_best_rows() -> None:
    failed = _record(_samples(num_calls=3, num_false=3))
    ours = _record(_samples(num_calls=10, num_false=0))
    redis = _record(_samples(num_calls=10, num_false=0), system="redis")
    rows = best_of_each([failed, ours, _with(redis, transport="", fsync="off")])
    assert len(rows) == 1 and rows[0]["total_cpu_s_per_gb"] == ours.total_cpu_s_per_gb


def _with(record: Result, **fields: object) -> Result:
    return Result(**{**asdict(record), **fields})
