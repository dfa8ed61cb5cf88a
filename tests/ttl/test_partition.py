"""Partitioned simulation (ttl.partition): exact against the whole trace and a direct
simulation of placement groups."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttl.errors import TraceFormatError
from ttl.generate import WorkloadParams, generate_trace
from ttl.partition import (
    InlineExecutor,
    partition_capacity,
    simulate_partitioned,
    split_trace,
    split_unit,
)
from ttl.policy import EvictionOrder, TrafficClasses
from ttl.simulator import ClassStats, SimConfig, sim_result, simulate
from ttl.traces import LoadOptions, Trace, load_trace, mix64, trace_units

from .sim_reference import reference_simulate

DAY = 86_400.0


def _by_mix(identities: np.ndarray, num_partitions: int) -> np.ndarray:
    """A placement stand-in for the pure tests (kvstore's hash has its own tests)."""
    return (mix64(identities, np.zeros_like(identities)) % np.uint64(num_partitions)).astype(
        np.int64
    )


def _write_mooncake(trace: Trace, path: Path) -> Path:
    """The trace as Mooncake JSONL whose raw ids are its dense ids (so they survive loading)."""
    with path.open("w") as f:
        for r in range(trace.num_requests):
            record = {
                "timestamp": float(trace.time_s[r]) * 1000.0,
                "input_length": int(trace.input_tokens[r]),
                "output_length": int(trace.output_tokens[r]),
                "class": trace.class_names[trace.class_ids[r]],
                "hash_ids": trace.blocks(r).tolist(),
            }
            f.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    params = WorkloadParams(
        days=2.0, chat_sessions_per_day=40, agent_sessions_per_day=5, agent_turns=4, seed=5
    )
    folder = tmp_path_factory.mktemp("partition")
    return _write_mooncake(generate_trace(params), folder / "w.jsonl")


def _stats(result) -> dict[str, dict]:
    return {name: asdict(stats) for name, stats in result.by_class.items()}


def _partitioned(path: Path, fmt: str, options: LoadOptions, configs, num_partitions: int,
                 unit_bytes: int = 20_000):  # fmt: skip
    units = trace_units(path, fmt, unit_bytes)
    split = split_trace(units, fmt, options, num_partitions, _by_mix, InlineExecutor())
    counts = simulate_partitioned(split, configs, InlineExecutor())
    return split, [sim_result(split.requests, c, n) for c, n in zip(configs, counts, strict=True)]


CONFIGS = [
    SimConfig(TrafficClasses({"chat": 7 * DAY, "agent": 3 * DAY})),
    SimConfig(TrafficClasses({"chat": DAY, "agent": 3600.0}), 300, EvictionOrder.LRU, 0.25),
    SimConfig(TrafficClasses({"chat": DAY, "agent": DAY}), 150, EvictionOrder.EXPIRY, 0.5),
]


def test_one_partition_agrees_exactly_with_the_whole_trace(workload: Path) -> None:
    options = LoadOptions(block_tokens=128)
    whole = load_trace(workload, "mooncake", options)
    split, results = _partitioned(workload, "mooncake", options, CONFIGS, 1)
    assert len(trace_units(workload, "mooncake", 20_000)) > 3, "the test must span units"
    assert (split.num_accesses, split.num_blocks) == (whole.num_accesses, whole.num_blocks)
    for config, got in zip(CONFIGS, results, strict=True):
        want = simulate(whole, config)
        assert _stats(got) == _stats(want), (
            "P=1 must equal the unpartitioned simulator exactly: unit split, sort or "
            "request bookkeeping differs"
        )
        assert (got.window_s, got.num_trace_blocks) == (want.window_s, want.num_trace_blocks)


@pytest.mark.parametrize("num_partitions", [2, 5])
def test_partitions_agree_with_a_direct_simulation_of_groups(
    workload: Path, num_partitions: int
) -> None:
    options = LoadOptions(block_tokens=128)
    whole = load_trace(workload, "mooncake", options)
    ids = np.arange(whole.num_blocks, dtype=np.uint64)  # raw ids are the dense ids here
    group = _by_mix(ids, num_partitions).tolist()
    configs = CONFIGS[1:]
    _, results = _partitioned(workload, "mooncake", options, configs, num_partitions)
    for config, got in zip(configs, results, strict=True):
        ttl = dict(config.classes.class_to_ttl_s)
        want = reference_simulate(
            whole, ttl, config.capacity_blocks, config.eviction, config.warmup_fraction,
            group_of=group.__getitem__, num_groups=num_partitions,
        )  # fmt: skip
        for name, expected in want.items():
            for key, value in expected.items():
                assert getattr(got.by_class[name], key) == pytest.approx(value), (
                    f"{name}.{key} with {num_partitions} partitions: the combined counts "
                    "differ from simulating the placement groups directly"
                )


def test_more_partitions_with_a_shared_capacity_differ_from_one_cache(workload: Path) -> None:
    # The cluster's answer is not one cache's: this guards the test above from passing by
    # ignoring the partitions.
    options = LoadOptions(block_tokens=128)
    (one,), (four,) = (
        _partitioned(workload, "mooncake", options, CONFIGS[1:2], p)[1] for p in (1, 4)
    )
    assert one.by_class["all"].evicted_blocks != four.by_class["all"].evicted_blocks


def test_chained_formats_partition_like_their_loader(tmp_path: Path) -> None:
    # Bailian ids name single blocks; the partitioned path chains them by hashing.
    requests = [[1, 2], [2], [1, 3], [1, 3, 2], [2, 1], [1, 2, 3]]
    path = tmp_path / "b.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": t, "input_length": 16 * len(ids), "hash_ids": ids,
                    "type": "text"}) + "\n" for t, ids in enumerate(requests)
    ))  # fmt: skip
    config = SimConfig(TrafficClasses({"chat": math.inf}), capacity_blocks=3)
    whole = load_trace(path, "bailian")
    for num_partitions in (1, 3):
        split, (got,) = _partitioned(path, "bailian", LoadOptions(), [config], num_partitions, 40)
        assert split.num_blocks == whole.num_blocks
        if num_partitions == 1:
            assert _stats(got) == _stats(simulate(whole, config))


def test_session_ids_are_local_to_their_file(tmp_path: Path) -> None:
    folder = tmp_path / "sessions"
    folder.mkdir()
    for name in ("a", "b", "c"):
        doc = {
            "block_size": 4,
            "requests": [
                {"t": 0, "in": 8, "hash_ids": [0, 1]},
                {"t": 5, "in": 12, "hash_ids": [0, 1, 2]},
            ],
        }
        (folder / f"{name}.json").write_text(json.dumps(doc))  # fmt: skip
    config = SimConfig(TrafficClasses({"chat": math.inf}))
    whole = load_trace(folder, "sessions")
    split, (got,) = _partitioned(folder, "sessions", LoadOptions(), [config], 1, 1)
    assert split.num_blocks == whole.num_blocks == 9, "the same ids in two files differ"
    assert _stats(got) == _stats(simulate(whole, config))


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(0, 40), num_partitions=st.integers(1, 7))
def test_capacity_shares_add_up(capacity: int, num_partitions: int) -> None:
    shares = [partition_capacity(capacity, num_partitions, p) for p in range(num_partitions)]
    assert sum(shares) == capacity and max(shares) - min(shares) <= 1
    assert partition_capacity(None, num_partitions, 0) is None


def test_class_stats_fields_are_all_compared() -> None:
    assert {f.name for f in fields(ClassStats)} >= {"peak_hit_blocks_per_s", "written_blocks"}


def test_a_bad_line_in_a_later_unit_is_named_by_its_line_in_the_file(
    workload: Path, tmp_path: Path
) -> None:
    lines = workload.read_bytes().splitlines(keepends=True)
    bad_line = len(lines) - 3  # 1-based: in the last units
    lines[bad_line - 1] = b'{"timestamp": "soon", "input_length": 1, "hash_ids": [1]}\n'
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"".join(lines))
    units = trace_units(path, "mooncake", 20_000)
    assert len(units) > 3 and units[-1].start > 0, "the bad line must sit in a later unit"
    with pytest.raises(TraceFormatError, match=rf"bad\.jsonl:{bad_line}: "):
        split_unit(units[-1], "mooncake", LoadOptions(block_tokens=128), 2, _by_mix)
