"""``kvstore cluster reweight`` as an operator types it, each command a real process: on a
static cluster.toml (``--dry-run`` only; bad input changes nothing) and on a running 13-node
cluster with etcd membership, where the change is published, the keeper finishes the move and
every block still reads back."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster, local_config
from kvstore.config import save_cluster
from tests.deploy.etcd_marks import needs_etcd

REPO = Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20
SMALL = [f"n{i}=512MiB" for i in range(20, 24)]  # 4 of 24 nodes at half the 1 GiB limit


def _kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "kvstore.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def _static_map(root: Path, num_nodes: int) -> Path:
    root.mkdir()
    cluster_toml = root / "cluster.toml"
    save_cluster(local_config(root, num_nodes, max_bytes=1 << 30), cluster_toml)
    return cluster_toml


def test_dry_run_on_a_static_map_and_bad_input_changes_nothing(tmp_path: Path) -> None:
    cluster_toml = _static_map(tmp_path / "c", 24)
    before = cluster_toml.read_bytes()
    limits = ",".join(SMALL)
    done = _kvstore("cluster", "reweight", "--dir", str(tmp_path / "c"), "--max-bytes", limits,
                    "--dry-run", "--keys", "20000")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["fit"] == "budget" and report["epoch"] == [1, 2]
    # ratio: the budget fit spends 99% of the ideal, read within ~1% on 20,000 keys.
    assert report["ratio_to_ideal"] <= 1.01, f"moved more than the weights require: {report}"
    assert report["slots_moved"] == 20, "the 4 small nodes' 21.8 surplus slots, whole: 20"
    assert report["worst_share_over_weight"] < 1.06, "the residual was not corrected at all"
    small = [n for n in report["nodes"] if n["max_bytes"] == 512 * MiB]
    assert len(small) == 4 and all(0.9 < n["share_over_weight"] < 1.06 for n in small), small
    for bad, says in (
        (["--max-bytes", "n99=1GiB"], "no node n99"),
        (["--max-bytes", "n20=0"], "positive size"),
        ([], "same byte limit"),  # equal limits: nothing to move to
        (["--max-bytes", limits, "--fit", "nope"], "invalid choice"),
        (["--max-bytes", limits], "static map"),  # applying needs etcd's move machinery
    ):
        refused = _kvstore("cluster", "reweight", "--cluster", str(cluster_toml), *bad)
        assert refused.returncode != 0 and says in refused.stderr, (bad, refused.stderr)
        assert cluster_toml.read_bytes() == before, f"{bad} changed the map"


@pytest.mark.timeout(300)
@needs_etcd
def test_reweight_moves_a_live_map_and_loses_nothing(tmp_path: Path) -> None:
    """13 nodes, n12 at half the limit: the change hands n12's surplus slots over (6 of 156),
    no key changes group, repair fills the slots, the keeper finishes, every block reads."""
    root = tmp_path / "c"
    with LocalCluster.start(
        root, 13, fsync=False, etcd="local", max_bytes=64 * MiB, repair_bytes_per_s=256 * MiB
    ) as cluster:
        blocks = asyncio.run(_put_blocks(cluster.cluster_toml, 24))
        dry = _kvstore("cluster", "reweight", "--dir", str(root), "--max-bytes", "n12=32MiB",
                       "--dry-run", "--keys", "20000")  # fmt: skip
        assert dry.returncode == 0, dry.stderr
        report = json.loads(dry.stdout)
        assert report["slots_moved"] == 6 and report["keys_regrouped"] == 0, report
        applied = _kvstore("cluster", "reweight", "--dir", str(root), "--max-bytes", "n12=32MiB")
        assert applied.returncode == 0 and "6 of 156 group slots move" in applied.stdout, (
            applied.stderr
        )
        after = cluster.wait_for_map(lambda c: not c.moving_from, 120, "the reweight's move")
        assert after.node("n12").max_bytes == 32 * MiB and after.group_weights
        assert asyncio.run(_num_lost(cluster.cluster_toml, blocks, after.epoch)) == 0
        status = _status(root)
    shares = {n["id"]: n["placement_share"] / n["weight_share"] for n in status["nodes"]}
    assert 0.9 < shares["n12"] < 1.0, f"n12 holds {shares['n12']:.3f} of its weight's share"


def _status(root: Path) -> dict[str, Any]:
    done = _kvstore("cluster", "status", "--dir", str(root), "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


async def _put_blocks(cluster_toml: Path, num: int) -> dict[bytes, bytes]:
    rng = random.Random(38)
    keys = block_keys(list(range(num * 4)), 4, "reweight", "salt")
    blocks = {key: rng.randbytes(rng.randint(1 * KiB, 16 * KiB)) for key in keys}
    async with KVClient.connect(cluster_toml, "acme") as kv:
        for key, block in blocks.items():
            await kv.put(key, block)
    return blocks


async def _num_lost(cluster_toml: Path, blocks: dict[bytes, bytes], epoch: int) -> int:
    """Blocks that do not read back on map ``epoch`` (a wrong byte fails at once)."""
    async with KVClient.connect(cluster_toml, "acme") as kv:
        deadline_s = time.monotonic() + 30
        while kv.config.epoch < epoch:
            assert time.monotonic() < deadline_s, f"the client never reached epoch {epoch}"
            await asyncio.sleep(0.1)
        got = await kv.get_batch(list(blocks))
    assert all(g is None or g == blocks[k] for k, g in zip(blocks, got, strict=True)), "WRONG"
    return sum(g is None for g in got)
