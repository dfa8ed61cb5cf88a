"""Background scrub: re-read every committed record at a bounded rate and verify it.

Bit rot in a shard nobody reads goes unnoticed until a read needs it, perhaps when other shards
of the block are gone too. The scrub finds it early, while the block can still be repaired from
the rest of its group.

A pass walks the index in segment order (``by_seg``: the records of one file together) and puts
each live record through the check a read does (:meth:`ShardReader.read_verified`: the record
header at that offset names this key and tenant, the shard checksum holds, the version matches
the index). A record that fails is reported exactly as a read reports it: counted once as a
corrupt shard and removed from the index by the next write or upkeep tick, so a repair can
store the shard again. A scrub is not an access: it refreshes no TTL and counts no hit or miss.
Expired entries are skipped (expiry deletes them), and so are records moved or deleted since
the index snapshot (a move re-reads and verifies what it copies).

Each pass starts by reading the whole index through (every lmdb page, in a child process,
since lmdb aborts a process whose cursor steps onto a damaged leaf; then every entry decoded),
before its own scan of ``by_seg`` steps from leaf to leaf. An index found damaged there or
while the scrub walks it raises IndexUnusable: the node stops serving, moves the index aside
and rebuilds it from the segment records (kvstore/node/store_holder.py), as for a lost index.
Damage that lands in a page mid-pass, where an in-process scan steps onto it before the next
pass starts, can still abort the node: its restart reads the index through the same way
(kvstore/store/recovery.py) and rebuilds it.

Pacing (real time): the node runs steps of a tenth of a second's budget at
``NodeConfig.scrub_bytes_per_s`` and sleeps what each step cost at that rate. A record costs its
bytes but at least ``MIN_RECORD_COST_BYTES``, so tiny records cannot turn the scrub into a
CPU-bound loop. A new pass starts no sooner than ``scrub_pass_interval_s`` after the previous
one started. The position is not kept across restarts: a restarted node starts a new pass.
"""

from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass, replace

from kvstore.config import NodeConfig
from kvstore.errors import IndexUnusable
from kvstore.store.index import Index
from kvstore.store.index_codec import Entry
from kvstore.store.read_state import ReadState
from kvstore.store.shard_reader import ShardReader
from kvstore.store.store_stats import ScrubProgress
from ttl.policy import is_expired

log = logging.getLogger(__name__)

MIN_RECORD_COST_BYTES = 64 << 10
# What reading an index whose lmdb pages were changed under it raises besides lmdb's own
# errors (which the backend reports as IndexUnusable): a secondary order naming an entry that
# is not there (an assertion in kvstore/store/index.py), or a value that does not decode.
_DAMAGED_INDEX = (AssertionError, struct.error, ValueError, UnicodeDecodeError, IndexError)
STEP_S = 0.1  # budget of one step, in seconds at the configured rate
_SCAN_BATCH = 256


@dataclass(frozen=True)
class ScrubStep:
    """What one step did: the budget it used, and whether it found the pass complete."""

    cost_bytes: int
    pass_done: bool


def record_cost_bytes(entry: Entry) -> int:
    """Budget one record takes from the scrub's rate."""
    return max(entry.record_bytes, MIN_RECORD_COST_BYTES)


def pause_s(step: ScrubStep, node: NodeConfig, pass_start_s: float, now_s: float) -> float:
    """Real seconds to wait after ``step``: its cost at the configured rate or, after a full
    pass, until ``scrub_pass_interval_s`` after that pass started."""
    if step.pass_done:
        return max(0.0, pass_start_s + node.scrub_pass_interval_s - now_s)
    return step.cost_bytes / node.scrub_bytes_per_s


class Scrubber:
    """The scrub's position and progress; steps run in a worker thread, one at a time."""

    def __init__(self, index: Index, reader: ShardReader, reads: ReadState) -> None:
        self._index = index
        self._reader = reader
        self._reads = reads
        self._lock = threading.Lock()  # one step at a time; close() waits for the one running
        self._cursor = b""  # by_seg position the next step starts at (b"": a pass starts)
        self._closed = False
        self.progress = ScrubProgress()

    def step(self, max_bytes: int, now: float, unix_now_s: float) -> ScrubStep:
        """Verify the next records of the pass, ``max_bytes`` of budget (at least one record).

        ``now`` is the store's clock (expiry); ``unix_now_s`` the real time a pass that ends
        here is recorded at (metrics are in real time).
        """
        with self._lock:
            if self._closed:
                return ScrubStep(0, pass_done=True)
            if not self._cursor:  # a pass starts by reading the whole index through
                self._index.verify()
            batch = self._next_batch(max_bytes)
            if not batch:
                self._end_pass(now, unix_now_s)
                return ScrubStep(0, pass_done=True)
            read_bytes = sum(self._verify(entry, now) for _, entry in batch)
            self._cursor = batch[-1][0] + b"\x00"
            self.progress = replace(
                self.progress, scrubbed_bytes=self.progress.scrubbed_bytes + read_bytes
            )
        return ScrubStep(sum(record_cost_bytes(e) for _, e in batch), pass_done=False)

    def close(self) -> None:
        """Wait for a running step; later steps do nothing (the index is about to close)."""
        with self._lock:
            self._closed = True

    def _next_batch(self, max_bytes: int) -> list[tuple[bytes, Entry]]:
        try:
            with self._index.read() as view:
                batch = view.by_segment(self._cursor, _SCAN_BATCH)
        except _DAMAGED_INDEX as exc:
            raise IndexUnusable(f"the scrub found the index damaged: {exc!r}") from exc
        cost_bytes = 0
        for num_taken, (_, entry) in enumerate(batch):
            cost_bytes += record_cost_bytes(entry)
            if cost_bytes > max_bytes and num_taken > 0:
                return batch[:num_taken]
        return batch

    def _verify(self, entry: Entry, now: float) -> int:
        """Record bytes read to check ``entry`` (0 if skipped); a failure is marked corrupt."""
        if is_expired(self._reads.with_refresh(entry).expires_at_s, now):
            return 0
        try:
            self._reader.read_verified(entry)
        except FileNotFoundError:  # moved or deleted since our snapshot
            return 0
        return entry.record_bytes

    def _end_pass(self, now: float, unix_now_s: float) -> None:
        self._cursor = b""
        self.progress = replace(
            self.progress,
            num_passes=self.progress.num_passes + 1,
            last_full_pass_s=now,
            last_full_pass_unix_s=unix_now_s,
        )
