"""``kvstore sim --partitions``: the store's placement splits the blocks; Ray runs the tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from kvstore.cli.commands import main
from kvstore.cli.sim_partitions import identity_keys, placement_partitions, weighted_placement
from kvstore.placement import group_of_key, groups_of_keys
from ttl import simloop
from ttl.generate import WorkloadParams, write_workload
from ttl.partition import StorePlacement, split_unit
from ttl.traces import LoadOptions, trace_units

REPO_ROOT = Path(__file__).resolve().parents[3]

GRID = ["--block-tokens", "128", "--ttl", "chat=1d,7d", "--ttl", "agent=3d",
        "--capacity", "20%,inf", "--warmup", "0.2", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("partitions") / "w.jsonl"
    params = WorkloadParams(
        days=2.0, chat_sessions_per_day=50, agent_sessions_per_day=5, agent_turns=4, seed=11
    )
    write_workload(params, path)
    return path


def _results(path: Path) -> list[dict]:
    return json.loads(path.read_text())["results"]


def _sim(trace: Path, out: Path, *extra: str) -> list[dict]:
    assert main(["sim", "--trace", str(trace), *GRID, "--json", str(out), *extra]) == 0
    return _results(out)


def test_one_partition_gives_the_unpartitioned_json(trace_path: Path, tmp_path: Path) -> None:
    whole = _sim(trace_path, tmp_path / "whole.json")
    one = _sim(trace_path, tmp_path / "one.json", "--partitions", "1", "--ray", "none",
               "--unit-bytes", "64KiB")  # fmt: skip
    assert one == whole, "P=1 must be the unpartitioned simulation, record for record"


def test_every_step_reports_progress(trace_path: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_PROGRESS_INTERVAL_S", "0")  # a line at every report
    out = tmp_path / "p.json"
    assert main(["sim", "--trace", str(trace_path), "--block-tokens", "128", "--partitions",
                 "2", "--ray", "none", "--unit-bytes", "64KiB",
                 "--json", str(out)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    steps = ("splitting the trace (units)", "counting blocks (partitions)", "simulating partitions")
    for step in steps:  # 64 KiB units: several, so blocks are counted across them
        assert f"[kvstore] {step}: done" in err, f"step {step!r} reported no progress"
    assert main(["sim", "--trace", str(trace_path), "--block-tokens", "128",
                 "--json", str(out)]) == 0  # fmt: skip
    assert "[kvstore] loading the trace (bytes): done" in capsys.readouterr().err


def test_partitions_on_local_ray_match_the_same_partitions_in_process(
    trace_path: Path, tmp_path: Path
) -> None:
    """The Ray driver runs in a child process: after ``ray.shutdown`` it leaves threads and
    shared-memory mappings in the process that ran it, and twice in fresh-clone runs the xdist
    worker that had run this test died with SIGSEGV in its next lmdb call, in libc's
    robust-mutex list (lmdb's lock file mutexes are robust)."""
    inline = _sim(trace_path, tmp_path / "inline.json", "--partitions", "3", "--ray", "none")
    argv = ["sim", "--trace", str(trace_path), *GRID, "--json", str(tmp_path / "ray.json"),
            "--partitions", "3", "--ray", "local", "--workers", "2",
            "--unit-bytes", "256KiB"]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", *argv], env=env, check=False,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    on_ray = _results(tmp_path / "ray.json")
    assert on_ray == inline, "Ray tasks must compute exactly what the in-process run does"
    summary = json.loads((tmp_path / "ray.json").read_text())["trace"]
    assert summary["partitions"] == 3 and summary["block_accesses"] > 0


def test_placement_of_identities_is_the_store_hash() -> None:
    identities = np.arange(1000, dtype=np.uint64) * np.uint64(7919)
    keys = identity_keys(identities)
    assert len({bytes(k) for k in keys.view(np.uint8).reshape(-1, 16)}) == 1000
    assert placement_partitions(identities, 12).tolist() == groups_of_keys(keys, 12).tolist()
    if simloop.NATIVE:  # the C copy of the hash agrees bit for bit at every group count
        many = identity_keys(np.arange(20_000, dtype=np.uint64))
        for num_groups in (1, 2, 3, 16, 129):
            assert np.array_equal(
                simloop.rendezvous_groups(many, num_groups), groups_of_keys(many, num_groups)
            ), f"ttl/simloop.c's rendezvous differs from kvstore.placement at {num_groups} groups"
    shares = np.bincount(placement_partitions(np.arange(60_000, dtype=np.uint64), 4))
    assert shares.min() > 0.9 * 15_000, f"placement must spread blocks evenly: {shares}"


def test_partitioned_bad_input_is_a_clear_error(trace_path: Path, capsys) -> None:
    assert main(["sim", "--trace", str(trace_path), "--partitions", "-1"]) == 2
    assert "--partitions must be >= 0" in capsys.readouterr().err
    assert main(["sim", "--trace", str(trace_path / "nope"), "--partitions", "2",
                 "--ray", "none"]) == 2  # fmt: skip
    assert "no trace at" in capsys.readouterr().err


def _random_weights(rng: np.random.Generator, num_groups: int) -> tuple[int, ...]:
    """Integer group weights as kvstore.placement_weights makes them (up to 2**20), spread
    from near-equal to 1000x apart."""
    spread = rng.choice([1.001, 2.0, 1000.0])
    return tuple(int(w) for w in rng.integers(2**20 // spread, 2**20, num_groups) + 1)


@pytest.mark.skipif(not simloop.NATIVE, reason="ttl/_simloop.so is not built")
def test_the_compiled_weighted_rendezvous_is_the_python_placement_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    for _ in range(12):
        num_groups = int(rng.integers(1, 40))
        weights = _random_weights(rng, num_groups)
        keys = rng.integers(0, 2**64, (400, 2), dtype=np.uint64)
        want = [group_of_key(key.tobytes(), num_groups, weights) for key in keys]
        got = simloop.rendezvous_groups(keys, num_groups, weights).tolist()
        assert got == want, f"C and Python weighted rendezvous disagree ({num_groups} groups)"
        assert groups_of_keys(keys, num_groups, weights).tolist() == want


def _bailian(mooncake: Path, path: Path) -> Path:
    """The Mooncake file's records as Bailian ones (per-block ids: the split chains them)."""
    with mooncake.open() as src, path.open("w") as out:
        for line in src:
            record = json.loads(line)
            record["timestamp"] /= 1000.0
            record["type"] = record.pop("class", "text")
            out.write(json.dumps(record) + "\n")
    return path


def _plain(placement: StorePlacement):
    """The same placement, not marked: the split calls it (the numpy path)."""
    return lambda identities, num_partitions: placement(identities, num_partitions)


@pytest.mark.skipif(not simloop.NATIVE, reason="ttl/_simloop.so is not built")
@pytest.mark.parametrize("fmt", ["mooncake", "bailian"])
@pytest.mark.parametrize("num_partitions", [1, 3, 7])
def test_the_compiled_split_equals_the_numpy_split(
    trace_path: Path, tmp_path: Path, fmt: str, num_partitions: int
) -> None:
    """One C pass (identities, distinct blocks, the store's placement, the counting sort)
    gives the pieces the numpy steps give, equal and weighted groups alike."""
    path = trace_path if fmt == "mooncake" else _bailian(trace_path, tmp_path / "b.jsonl")
    options = LoadOptions(block_tokens=128)
    weights = _random_weights(np.random.default_rng(num_partitions), num_partitions)
    for placement in (placement_partitions, weighted_placement(weights)):
        for unit in trace_units(path, fmt, 100_000):
            compiled = split_unit(unit, fmt, options, num_partitions, placement)
            plain = split_unit(unit, fmt, options, num_partitions, _plain(placement))
            assert compiled[0].num_distinct == plain[0].num_distinct
            for got, want in zip(compiled[1:], plain[1:], strict=True):
                for field in fields(got):
                    np.testing.assert_array_equal(
                        getattr(got, field.name), getattr(want, field.name),
                        err_msg=f"{field.name}: the C split differs from the numpy steps",
                    )  # fmt: skip
