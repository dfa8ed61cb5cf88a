"""Fixtures of the node tests: real node processes, and stores on a manual clock.

Every node started is stopped at teardown and every store opened is closed, also on failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstore.config import NodeConfig, TTLConfig
from kvstore.store.index_backends import MemoryBackend
from kvstore.store.shard_store import ShardStore
from tests.kvstore.node_harness import NodeProcess
from tests.kvstore.store_harness import (
    CLASSES,
    T0,
    TEST_INDEX_RESERVE_BYTES,
    MakeStore,
    lmdb_index_bytes,
)
from ttl.clock import ManualClock


@pytest.fixture
def start_node() -> Iterator[Callable[..., NodeProcess]]:
    """``start_node(config_path, extra_args=(), node_id="n0")`` -> a ready node, stopped at
    teardown."""
    started: list[NodeProcess] = []

    def start(
        config_path: Path, extra_args: tuple[str, ...] = (), node_id: str = "n0"
    ) -> NodeProcess:
        node = NodeProcess(config_path, node_id, extra_args=extra_args)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.stop()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture(params=["lmdb", "memory"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock
) -> Iterator[MakeStore]:
    """``make_store(**fields)`` -> a store on ``tmp_path`` (closed at teardown); ``fields`` are
    NodeConfig or TTLConfig fields (e.g. ``max_bytes=...``, ``eviction_order="expiry"``).

    ``max_bytes`` is the limit for segment data: the lmdb variant adds its index's fixed
    allocation, so both backends evict at the same point."""
    stores: list[ShardStore] = []
    ttl_names = {f.name for f in dataclasses.fields(TTLConfig)}

    def make(**fields: object) -> ShardStore:
        node_fields = {k: v for k, v in fields.items() if k not in ttl_names}
        ttl_fields = {k: v for k, v in fields.items() if k in ttl_names}
        reserve_bytes = int(node_fields.setdefault("index_reserve_bytes", TEST_INDEX_RESERVE_BYTES))
        if node_fields.get("max_bytes") and request.param == "lmdb":
            probe = tmp_path / f"probe-{len(stores)}"
            node_fields["max_bytes"] = int(node_fields["max_bytes"]) + lmdb_index_bytes(
                probe, reserve_bytes
            )
        data_dir = str(node_fields.pop("data_dir", tmp_path))  # a second store: its own dir
        node = NodeConfig("n0", "127.0.0.1:1", 0, "d0", data_dir, fsync=False, **node_fields)
        ttl = TTLConfig(classes=CLASSES, expiry_window_s=3600.0, **ttl_fields)
        backend = MemoryBackend() if request.param == "memory" else None
        stores.append(ShardStore(node, ttl, clock, backend))
        return stores[-1]

    yield make
    for store in stores:
        store.close()
