"""Shared by the store tests: the start time, the traffic classes and the store factory type."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from kvstore.store.index_backends import LmdbBackend
from kvstore.store.shard_store import ShardStore
from tests.kvstore.node_harness import DAY_S
from ttl.policy import TrafficClasses

T0 = 1_000 * DAY_S
CLASSES = TrafficClasses({"chat": 7 * DAY_S, "agent": 3 * DAY_S, "pinned": float("inf")})

MakeStore = Callable[..., ShardStore]  # make_store(**node_or_ttl_fields) -> an open store

# The lmdb index's files count inside max_bytes. With this reserve its allocation stays fixed
# while a test adds fewer than a few hundred entries, so a test's byte arithmetic holds for both
# backends once that fixed allocation is added to the limit (see lmdb_index_bytes).
TEST_INDEX_RESERVE_BYTES = 256 << 10
# Readers racing writers keep lmdb from reusing pages (measured: 2.2 MB of pages for 100
# entries), so stress tests take a reserve the index does not outgrow.
STRESS_INDEX_RESERVE_BYTES = 16 << 20


def lmdb_index_bytes(path: Path, reserve_bytes: int = TEST_INDEX_RESERVE_BYTES) -> int:
    """Disk bytes a fresh lmdb index holds with this reserve (its files, allocated)."""
    backend = LmdbBackend(path, sync=False, reserve_bytes=reserve_bytes)
    try:
        return backend.allocated_bytes()
    finally:
        backend.close()


def damage_index_pages(data_dir: Path, needle: bytes) -> int:
    """Mark every lmdb page of ``data_dir``'s index holding ``needle`` as of no known type (what
    flipped bytes in a page header do); return how many pages. lmdb aborts a process whose
    cursor steps from one leaf onto such a page."""
    path = data_dir / "index" / "data.mdb"
    data = path.read_bytes()
    page_bytes = 4096
    pages, start = set(), 0
    while (found := data.find(needle, start)) >= 0:
        pages.add(found // page_bytes)
        start = found + 1
    fd = os.open(path, os.O_RDWR)
    try:
        for page in pages:
            os.pwrite(fd, b"\0\0", page * page_bytes + 10)  # the page header's flags
    finally:
        os.close(fd)
    return len(pages)
