"""Encryption at rest on a real 12-node cluster: nodes hold only ciphertext, a forged or
swapped block reads as a miss, and a purge shreds the tenant's key."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client import KVClient
from deploy.local_cluster import LocalCluster
from kvstore.config import EncryptionConfig, IntegrityConfig, load_cluster, save_cluster
from tests.client.secure_cluster import add_tenants, random_block
from tests.kvstore.node_harness import REPO_ROOT

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
BLOCK_BYTES = 300_000
WINDOW_BYTES = 32
PAGE_BYTES = 4096


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("encryption")
    with LocalCluster.start(root, 12, fsync=False, auth=True, encrypt=["acme"]) as c:
        yield c


@pytest.fixture(scope="module")
def tokens(cluster: LocalCluster) -> dict[str, str]:
    return add_tenants(cluster, ["acme", "globex"])


def _block(seed: int) -> bytes:
    return random_block(seed, BLOCK_BYTES)


def _disk_bytes(cluster: LocalCluster) -> bytes:
    """Every file of every node's data directory, concatenated, less its all-zero 4 KiB pages
    (lmdb's map is mostly empty: scanning it hundreds of times is what made this test slow)."""
    pages = []
    for node in cluster.config.nodes:
        for path in Path(node.data_dir).rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                data += bytes(-len(data) % PAGE_BYTES)
                pages.append(np.frombuffer(data, np.uint8).reshape(-1, PAGE_BYTES))
    every = np.concatenate(pages)
    return every[every.any(axis=1)].tobytes()


def _windows(block: bytes, step: int = 997) -> list[bytes]:
    return [block[i : i + WINDOW_BYTES] for i in range(0, len(block) - WINDOW_BYTES, step)]


def _plain_config(cluster: LocalCluster) -> Path:
    """The same cluster.toml without [encryption] or [integrity] keys: a client that sees the
    sealed bytes, as a malicious node would (sealed blocks carry plain xxh3 versions)."""
    config = dataclasses.replace(
        load_cluster(cluster.cluster_toml),
        encryption=EncryptionConfig(),
        integrity=IntegrityConfig(),
    )
    path = cluster.root / "plain.toml"
    save_cluster(config, path)
    return path


async def test_nodes_hold_ciphertext_only(cluster: LocalCluster, tokens) -> None:
    secret, public = _block(1), _block(2)
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", token=tokens["acme"]) as kv:
        await kv.put(b"k" * 16, secret)
        out = bytearray(len(secret))
        assert await kv.get_into(b"k" * 16, out) and bytes(out) == secret
        assert await kv.get(b"k" * 16) == secret
    async with KVClient.connect(
        cluster.cluster_toml, tenant="globex", token=tokens["globex"]
    ) as kv:
        await kv.put(b"k" * 16, public)  # globex is not encrypted: the scan must find it
        await kv.close()
    disk = _disk_bytes(cluster)
    found_public = sum(w in disk for w in _windows(public))
    found_secret = sum(w in disk for w in _windows(secret))
    assert found_public > 0.8 * len(_windows(public)), "the scan cannot find plaintext at all"
    assert found_secret == 0, f"{found_secret} plaintext windows of an encrypted block on disk"


async def test_forged_or_swapped_blocks_read_as_misses(cluster: LocalCluster, tokens) -> None:
    first, second = _block(3), _block(4)
    toml = cluster.cluster_toml
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"]) as kv:
        await kv.put(b"1" * 16, first)
        await kv.put(b"2" * 16, second)
    # A node-side attacker: takes key 2's sealed block and stores it under key 1, and forges
    # a block under key 3; erasure coding and checksums are all valid.
    async with KVClient.connect(_plain_config(cluster), tenant="acme", token=tokens["acme"]) as raw:
        sealed_second = await raw.get(b"2" * 16)
        assert sealed_second is not None and second[:64] not in sealed_second
        await raw.delete([b"1" * 16])
        await raw.put(b"1" * 16, sealed_second)
        await raw.put(b"3" * 16, b"KVS1" + bytes(100))
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"]) as kv:
        assert await kv.get(b"1" * 16) is None, "a swapped block opened: wrong bytes served"
        assert await kv.get(b"3" * 16) is None, "a forged block opened"
        assert await kv.get(b"2" * 16) == second
        assert kv.sealer is not None and kv.sealer.num_open_failures == 2


async def test_purge_shreds_the_key(cluster: LocalCluster, tokens) -> None:
    block = _block(5)
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", token=tokens["acme"]) as kv:
        await kv.put(b"s" * 16, block)
    async with KVClient.connect(_plain_config(cluster), tenant="acme", token=tokens["acme"]) as raw:
        surviving_copy = await raw.get(b"s" * 16)  # say, a disk that was never wiped
    command = [sys.executable, "-m", "kvstore.cli", "purge", "--tenant", "acme"]
    command += ["--dir", str(cluster.root), "--json"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["data_key_destroyed"] is True, done.stderr
    async with KVClient.connect(_plain_config(cluster), tenant="acme", token=tokens["acme"]) as raw:
        assert await raw.get(b"s" * 16) is None, "purge left the block"
        await raw.put(b"s" * 16, surviving_copy)
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", token=tokens["acme"]) as kv:
        assert await kv.get(b"s" * 16) is None, "a copy sealed before the purge still opens"
