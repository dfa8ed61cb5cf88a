"""``kvstore bench index``: lmdb bytes per shard entry in a node's own index.

::

    kvstore bench index [--entries 200000] [--tenant acme] [--json PATH]

Puts ``--entries`` shard entries with random keys (the order puts arrive in) through
``kvstore.store.index.IndexWriter`` into a fresh ``LmdbBackend``, in transactions of 1,000 as the
node's group commit does, and divides by the entries both the pages the B-trees use and the
file's size (which also holds the pages lmdb's copy-on-write keeps free for reuse). Each entry
has a chat-class TTL, so it carries all five keys (entries, expiry, access, by-segment,
by-group). The
file figure is ``ttl.plan.DEFAULT_INDEX_BYTES_PER_SHARD``, the index line of ``kvstore plan``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import lmdb

from kvstore.store.index import Index
from kvstore.store.index_backends import LmdbBackend
from kvstore.store.index_codec import DBS, Entry

_PER_TXN = 1000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--entries", type=int, default=200_000, help="shard entries to put (default 200000)"
    )
    parser.add_argument("--tenant", default="acme", help="tenant name stored in each entry")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")


def run(args: argparse.Namespace) -> int:
    result = measure_index_bytes(args.entries, args.tenant)
    print(
        f"{result['entries']:,} shard entries: {result['tree_bytes_per_entry']:.0f} bytes each "
        f"in B-tree pages, {result['file_bytes_per_entry']:.0f} bytes each of the lmdb file"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def measure_index_bytes(num_entries: int, tenant: str) -> dict[str, float]:
    """Bytes of lmdb pages per entry after ``num_entries`` random-key puts."""
    if num_entries < 1:
        raise ValueError(f"--entries must be >= 1, got {num_entries}")
    with tempfile.TemporaryDirectory(prefix="kvstore-index-bench-") as folder:
        backend = LmdbBackend(Path(folder), sync=False)
        index = Index(backend)
        with index.write() as writer:
            writer.add_segment(segment_id=1, window_id=0)
        for start in range(0, num_entries, _PER_TXN):
            with index.write() as writer:
                for i in range(start, min(start + _PER_TXN, num_entries)):
                    writer.put_entry(_entry(tenant, i))
        index.close()
        with lmdb.open(folder, readonly=True, lock=False, max_dbs=len(DBS)) as env:
            page_bytes = env.stat()["psize"]
            file_bytes = (env.info()["last_pgno"] + 1) * page_bytes
            dbs = [env.open_db(name.encode(), create=False) for name in DBS]
            with env.begin() as txn:
                tree_pages = sum(_pages(txn.stat(db)) for db in dbs)
    tree_bytes = tree_pages * page_bytes
    return {
        "entries": num_entries,
        "tree_bytes": tree_bytes,
        "file_bytes": file_bytes,
        "tree_bytes_per_entry": tree_bytes / num_entries,
        "file_bytes_per_entry": file_bytes / num_entries,
    }


def _pages(stat: dict[str, int]) -> int:
    return stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]


def _entry(tenant: str, i: int) -> Entry:
    key, version = os.urandom(16), os.urandom(16)
    return Entry(tenant, key, version, "chat", 1, i * 4096, 4000, i, 0.0, float(i), i + 604800.0)
