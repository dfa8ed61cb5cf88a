"""Eviction runs from the high watermark to the low one and no further (issue 38).

A node filled past its high watermark must land within a few blocks of its low watermark, on
every filesystem a node runs on: the watermarks apply to the disk space segment data holds
(live records, plus dead ones only where holes cannot be punched), so the rounding of
allocated pages differs per filesystem but never makes eviction run on. Before, punched dead
records stayed counted, and a node with one segment evicted down to under half its limit.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.config import NodeConfig, TTLConfig
from kvstore.store.shard_store import ShardStore
from tests.kvstore.disk_harness import mounted_tmpfs
from tests.kvstore.node_harness import make_shard
from tests.kvstore.store_harness import CLASSES
from ttl.clock import ManualClock

MiB = 1 << 20
SHARD_PAYLOAD_BYTES = 100_000  # a 1 MB block's shard: records of about 100 kB
FILESYSTEMS = ("tmp_path", "tmpfs", "overlay", "xfs")


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False)


@contextlib.contextmanager
def _filesystem(kind: str, base: Path) -> Iterator[Path]:
    """A directory on a filesystem of ``kind``; skips (saying why) where it cannot be made."""
    if kind == "tmp_path":
        yield base
        return
    if kind == "tmpfs":
        with mounted_tmpfs(base / "fs", 64 * MiB) as fs:
            yield fs
        return
    target = base / "fs"
    target.mkdir()
    if kind == "overlay":
        for name in ("lower", "upper", "work"):
            (base / name).mkdir()
        options = f"lowerdir={base / 'lower'},upperdir={base / 'upper'},workdir={base / 'work'}"
        result = _run("mount", "-t", "overlay", "overlay", "-o", options, str(target))
    else:
        if shutil.which("mkfs.xfs") is None:
            pytest.skip("mkfs.xfs is not installed (xfsprogs)")
        image = base / "xfs.img"
        with open(image, "wb") as f:
            f.truncate(320 * MiB)  # xfs's smallest filesystem is 300 MB
        made = _run("mkfs.xfs", "-q", str(image))
        result = made if made.returncode else _run("mount", "-o", "loop", str(image), str(target))
    if result.returncode != 0:
        pytest.skip(f"cannot mount {kind} for the test (needs root): {result.stderr.strip()}")
    try:
        yield target
    finally:
        _run("umount", "-l", str(target))


def _store(data_dir: Path, clock: ManualClock, **fields: object) -> ShardStore:
    node = NodeConfig("n0", "127.0.0.1:1", 0, "d0", str(data_dir), fsync=False, **fields)
    return ShardStore(node, TTLConfig(classes=CLASSES), clock)


def _fill(store: ShardStore, clock: ManualClock, num_puts: int) -> list[tuple[int, int]]:
    """One shard per put, a second apart; (held bytes, capacity) after each put."""
    after = []
    for i in range(num_puts):
        shard = make_shard(os.urandom(SHARD_PAYLOAD_BYTES))
        store.put("acme", "chat", [(i.to_bytes(16, "big"), shard)])
        clock.advance(1.0)
        after.append((store.held_bytes(), store.capacity_bytes()))
    return after


def _check_evictions(after: list[tuple[int, int]], low: float, high: float) -> int:
    """Every drop of held bytes lands within 5% of the low watermark and at most one record
    under it; returns how many evictions there were."""
    record_bytes = SHARD_PAYLOAD_BYTES + 1024
    num_evictions = 0
    for (before, _), (held, capacity) in itertools.pairwise(after):
        assert held <= high * capacity + record_bytes, (
            f"{held} bytes held of {capacity}: past the high watermark, eviction did not run"
        )
        if held >= before:
            continue
        num_evictions += 1
        target = low * capacity
        assert held >= target - record_bytes, (
            f"evicted down to {held} bytes, {target - held:.0f} under the low watermark "
            f"{target:.0f}: eviction ran past it (dead or in-flight bytes counted twice?)"
        )
        assert abs(held - target) <= 0.05 * target, (
            f"evicted to {held} bytes, not within 5% of the low watermark {target:.0f}"
        )
    return num_evictions


@pytest.mark.parametrize("kind", FILESYSTEMS)
def test_eviction_stops_at_the_low_watermark(kind: str, tmp_path: Path, clock: ManualClock) -> None:
    with _filesystem(kind, tmp_path) as fs:
        store = _store(fs / "n0", clock, max_bytes=12 * MiB, index_reserve_bytes=256 << 10)
        try:
            after = _fill(store, clock, 300)  # 30 MB through a 12 MB limit
        finally:
            store.close()
    assert _check_evictions(after, 0.85, 0.95) >= 3, "the fill never passed the high watermark"


def test_a_disk_derived_limit_evicts_to_its_low_watermark(
    tmp_path: Path, clock: ManualClock
) -> None:
    """The issue's node: a 48 MB tmpfs with a 16 MB file beside the data, no max_bytes. It
    evicted from 20.4 MB down to 14.1 MB, far under its low watermark of 27.1 MB."""
    with mounted_tmpfs(tmp_path / "fs", 48 * MiB) as fs:
        (fs / "filler").write_bytes(bytes(16 * MiB))
        store = _store(fs / "n0", clock)
        try:
            after = _fill(store, clock, 500)
        finally:
            store.close()
    assert _check_evictions(after, 0.85, 0.95) >= 3, "the fill never passed the high watermark"
