"""The batch read: one request per node per batch, the first k valid shards of one version per
block, every checksum verified.

::

    keys -> their groups (placement) -> per group: plan_read (ask 11 nodes, 1 in reserve)
         -> per node: ONE request for every key it is asked for (client/landing.Wanted)
    answers arrive node by node, each landed by its transport (local, UCX or gRPC): data shards at
    their place in the caller's blocks, the rest apart (client/landing.py); local nodes put
    them there themselves when the blocks lie in a landing pool (client/landing_pool.py)
         -> ``on_landed``: which data shards of which blocks are in place (engines start
            copying those bytes to the GPU)
         -> every HIT shard's header checked, tallied per key by version
         -> a key is decided when one version has k shards, or when the requests still
            pending for it cannot give k: then its group's reserve nodes are asked, once;
            keys still undecided hedge_delay_s after the start ask their reserves too
    every key decided -> cancel the requests still out (their transports stop writing first)
         -> decode each complete key into its buffer (data shards already there: no copy),
            the block checksum verified: ONE pass over every byte. Only when it fails are the
            shards' own checksums checked, to find the bad one: it is dropped and counted,
            and the block decoded again from the others (parity) or reported a miss
         -> per hit, in the background (client/follow_ups.py): touch the block's shard on
            the group's nodes not heard from (so no shard of a read block expires early),
            and hint repair if a node answered without the version's shard

Never wrong bytes: a block is returned only once its checksum (its version, which the writer
computed) matches; shard checksums are a node's own claim and only point at the bad shard.

A slow or dead node never holds the batch: each key needs any k of the 11 asked, so the
batch ends when the other ten have answered, and the slow node's request is cancelled. Two
hung nodes among the 11 cost the hedge delay: then the 12th is asked. The
client's Python work per batch is per node: a request, an answer, its table decoded and
tallied with numpy (client/shard_table.py); it never creates a future, a message or an object
per shard in a healthy read, and hashes nothing but the blocks.

This is the module's one dense hot path. The block checks and decoding are
client/batch_decode.py (where they run, and why a tainted landing pool slot is a miss).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from client.batch_decode import BlockChecks
from client.integrity import XXH3_CHECK, BlockCheck
from client.landing import NodeAnswer, Wanted
from client.landing_pool import LandingPool
from client.node_conn import NodeConn, NodeReader, consume_result
from client.read_plan import healthy_plan, plan_read
from client.read_timeline import CLIENT, ReadTimeline
from client.shard_table import ShardTable, headers_fit
from client.shard_tally import can_complete
from erasure.codec import Codec
from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied
from kvstore.wire import batch_answer

log = logging.getLogger(__name__)

# Keys of one request to one node (more: several requests; the node's max_batch_bytes splits
# first). 256: a fetch of a 16k prompt in one land_batch is one request per node. The tally
# costs per answer, not per shard (client/shard_table.py), so fewer, larger answers are
# cheaper: 256 blocks of random:1b in chunks of 256 moved 3.51 GB/s on 2 cores against 2.95
# for 64-key requests and the per-shard tally (docs/runs/swapin-2core/stop52/README.md).
MAX_KEYS_PER_REQUEST = 256
DATA_GRACE = 0.5  # of a batch's time, waited for data shards once every key has k shards


@dataclass
class ReadCounters:
    """What reads did, for tests and benchmarks (monotonic counts)."""

    num_reads: int = 0  # keys read (a batch of n keys counts n)
    num_hits: int = 0
    num_misses: int = 0
    num_batches: int = 0  # get/get_into/get_batch/get_batch_into calls
    num_node_requests: int = 0  # requests sent to nodes (one per node per batch, usually)
    num_corrupt_shards: int = 0  # shards skipped: bad checksum/header, or CORRUPT from a node
    num_hedged: int = 0  # batches that finished without waiting for every asked node
    num_reserve_asks: int = 0  # requests to nodes beyond the first fan-out
    num_decode_failures: int = 0  # versions whose k shards did not rebuild a valid block
    num_timeouts: int = 0  # keys still undecided at the deadline (not counted as misses)
    num_rechecks: int = 0  # blocks whose checksum failed, then their shards were checked
    num_tainted: int = 0  # blocks dropped: their pool slot may still be written late


OnLanded = Callable[[list[tuple[int, int]]], None]


@dataclass
class ReadTimes:
    """Where batch reads spent their time (seconds, summed over batches): waiting for node
    answers (and tallying them, on the event loop), stopping the requests still out (revoking
    their permits), and decoding, which is the block checksum pass (on the decode pool)."""

    gather_s: float = 0.0
    stop_s: float = 0.0
    decode_s: float = 0.0


class FollowUpSink(Protocol):
    """Where a read's follow-ups go (client/follow_ups.py FollowUps)."""

    def touch(self, node_ids: Sequence[str], key: bytes, version: bytes) -> None: ...

    def hint_repair(self, group: int, key: bytes) -> None: ...


@dataclass
class _Request:
    """One request to one node: which batch keys, and which shard of each it holds."""

    node: int  # index into BatchRead.conns
    keys: list[bytes]
    wanted: Wanted
    sent_ns: int = 0  # when it was sent (CLOCK_MONOTONIC), for the read timeline

    @functools.cached_property
    def positions(self) -> np.ndarray:
        """``wanted.positions`` as an array: request key i -> batch position."""
        return np.asarray(self.wanted.positions, np.int64)


class BatchRead:
    """One batch read over a cluster's groups (see module doc). Use once: ``await run()``."""

    def __init__(
        self,
        codec: Codec,
        conns: Sequence[NodeConn],
        readers: Sequence[NodeReader],
        group_members: Sequence[Sequence[int]],
        fanout: int,
        max_batch_bytes: int,
        counters: ReadCounters,
        hedge_delay_s: float = 0.0,
        follow_ups: FollowUpSink | None = None,
        *,
        decode_pool: Executor | None = None,
        landing_pool: LandingPool | None = None,
        times: ReadTimes | None = None,
        block_check: BlockCheck = XXH3_CHECK,
        timeline: ReadTimeline | None = None,
    ) -> None:
        self.codec = codec
        self.conns = conns  # every node of the cluster; health lives here
        self.readers = readers  # the read transport of each node (same order as conns)
        self.group_members = group_members  # per group: node indexes by shard position
        self.fanout = fanout
        self.max_batch_bytes = max_batch_bytes
        self.counters = counters
        self.hedge_delay_s = hedge_delay_s  # 0 = ask reserves only for hopeless keys
        self.follow_ups = follow_ups
        self.decode_pool = decode_pool  # decodes (a block checksum pass each) run here
        self.timed_out: list[bool] = []  # after run(): keys the deadline left undecided
        self.landing_pool = landing_pool  # where local nodes may write blocks themselves
        self.times = times if times is not None else ReadTimes()
        # How each block is checked against its version: xxh3-128, or a tenant's keyed
        # digest under end-to-end integrity (client/integrity.py). The one pass over it.
        self.block_check = block_check
        self.timeline = timeline  # where the stages' spans go (client/read_timeline.py)
        # After run(): positions whose bytes decoding wrote after on_landed announced them.
        self.rewritten: set[int] = set()
        # After run(): positions that missed because shards of theirs failed their block
        # check after the nodes' own checks (client/block_reads.py reads them once more).
        self.corrupt_misses: set[int] = set()

    async def run(
        self,
        keys: Sequence[bytes],
        groups: Sequence[int],
        outs: Sequence[memoryview | None],
        timeout_s: float,
        on_landed: OnLanded | None = None,
    ) -> list[bytes | memoryview | None]:
        """Each key's block (written into its ``outs`` entry when one is given), or None.

        ``on_landed(pairs)``, on the event loop, once per node answer: the (batch position,
        data shard index) of each shard that landed at its place in ``outs`` (its bytes
        ``[i*P, (i+1)*P)`` of the block, not verified yet: the block is, before it is
        returned, and any range written again by decoding is in :attr:`rewritten`).
        """
        deadline_s = asyncio.get_running_loop().time() + timeout_s
        self.counters.num_batches += 1
        self.counters.num_reads += len(keys)
        state = _State(self, keys, groups, outs, deadline_s, on_landed)
        clock = asyncio.get_running_loop().time
        started_s = clock()
        try:
            async with asyncio.timeout(timeout_s):
                await state.gather()
        except TimeoutError:
            log.debug("batch read: deadline passed with %d keys undecided", state.num_undecided)
            state.deadline_passed = True
        finally:
            gathered_s, gathered_ns = clock(), time.monotonic_ns()
            await state.stop()
            await state.settle_checks()
        stopped_s, stopped_ns = clock(), time.monotonic_ns()
        self.timed_out = state.timed_out()
        try:
            blocks = await state.decode(self.decode_pool)
        finally:
            state.release()
        times = self.times
        times.gather_s += gathered_s - started_s
        times.stop_s += stopped_s - gathered_s
        times.decode_s += clock() - stopped_s
        if self.timeline is not None:
            self.timeline.add(CLIENT, "stop", gathered_ns, stopped_ns)
            self.timeline.add(CLIENT, "decode", stopped_ns)
        if self.follow_ups is not None:
            state.follow_up(blocks, self.follow_ups)
        self.rewritten = state.rewritten
        self.corrupt_misses = state.corrupt_misses
        return blocks


class _State(BlockChecks):
    """The progress of one batch read: requests out, shards tallied per key."""

    def __init__(
        self,
        read: BatchRead,
        keys: Sequence[bytes],
        groups: Sequence[int],
        outs: Sequence[memoryview | None],
        deadline_s: float,
        on_landed: OnLanded | None = None,
    ) -> None:
        self.read = read
        self.keys, self.groups, self.outs = keys, groups, outs
        self.deadline_s = deadline_s  # on the event loop's clock
        self.on_landed = on_landed
        # Positions whose block bytes decoding wrote after shards landed there (a recovered
        # data shard, or one copied into place): engines copy those blocks again.
        self.rewritten: set[int] = set()
        self.corrupt_misses: set[int] = set()
        # Blocks verified while the read goes on (whole in their buffers as soon as their
        # data nodes answered): the futures of their block checks, and the verdicts.
        self._checks: list[asyncio.Future[None]] = []
        self.verified: dict[int, bool] = {}
        pool = read.landing_pool
        # Where each buffer lies in the landing pool, found once for all of its requests.
        self.pool_offsets: list[int | None] | None = (
            None if pool is None else [None if out is None else pool.locate(out) for out in outs]
        )
        k = read.codec.k
        self.table = ShardTable(read.codec, len(keys))
        self.complete: list[bytes | None] = [None] * len(keys)  # the version that reached k
        self.decided = [False] * len(keys)
        self.num_in_place = np.zeros(len(keys), np.int64)
        self.num_undecided = len(keys)
        self.pending = [0] * len(keys)  # requests out that cover each key
        self.tasks: dict[asyncio.Task[NodeAnswer], _Request] = {}
        self.answers: list[NodeAnswer] = []
        self.asked_nodes: set[int] = set()
        self.reserve: dict[int, tuple[int, ...]] = {}  # group -> shard positions in reserve
        self.reserve_asked = [False] * len(keys)
        # Shard indexes whose node answered for each key: with a HIT, or without one.
        self.heard_hit: list[set[int]] = [set() for _ in keys]
        self.heard_miss: list[set[int]] = [set() for _ in keys]
        self.k = k
        self.deadline_passed = False
        codec = read.codec  # each key's payload bytes per node, for sizing requests
        self.payload_estimates = [
            codec.payload_bytes(len(out) if out is not None else codec.max_block_bytes)
            for out in outs
        ]
        self._plan()

    def _plan(self) -> None:
        """Per group a read plan; per node one request (or a few, for very large batches).
        Node health is read once per batch, and a group whose members are all healthy takes
        the one plan such groups share: most batches plan O(nodes), not O(groups x n)."""
        group_to_positions: dict[int, list[int]] = {}
        for position, group in enumerate(self.groups):
            group_to_positions.setdefault(group, []).append(position)
        conns = self.read.conns
        now_s = time.monotonic()
        suspect = [conn.health.is_suspect(now_s) for conn in conns]
        late = [conn.health.late_score for conn in conns]
        slow = [conn.health.is_slow for conn in conns]
        unusual = {n for n in range(len(conns)) if suspect[n] or slow[n]}
        node_to_items: dict[int, list[tuple[int, int]]] = {}
        for group, positions in group_to_positions.items():
            members = self.read.group_members[group]
            if unusual and not unusual.isdisjoint(members):
                plan = plan_read(
                    self.k,
                    self.read.fanout,
                    [suspect[n] for n in members],
                    [late[n] for n in members],
                    [slow[n] and conns[n].health.take_probe() for n in members],
                )
            else:
                plan = healthy_plan(self.k, self.read.fanout, len(members))
            self.reserve[group] = plan.reserve
            for shard_index in plan.ask:
                items = node_to_items.setdefault(members[shard_index], [])
                items += ((p, shard_index) for p in positions)
        for node, items in node_to_items.items():
            self._ask(node, items)

    def _ask(self, node: int, items: list[tuple[int, int]]) -> None:
        """Send ``node`` requests for ``items`` ((batch position, shard index) pairs)."""
        self.asked_nodes.add(node)
        per_key_bytes = [self.payload_estimates[p] for p, _ in items]
        start = 0
        while start < len(items):
            end, num_bytes = start, 0
            while end < len(items) and end - start < MAX_KEYS_PER_REQUEST:
                if end > start and num_bytes + per_key_bytes[end] > self.read.max_batch_bytes:
                    break
                num_bytes += per_key_bytes[end]
                end += 1
            chunk = items[start:end]
            start = end
            positions = [p for p, _ in chunk]
            offsets = self.pool_offsets
            wanted = Wanted(
                positions,
                [s for _, s in chunk],
                None if offsets is None else [offsets[p] for p in positions],
                num_bytes,
            )
            request = _Request(node, [self.keys[p] for p in positions], wanted, time.monotonic_ns())
            for position in positions:
                self.pending[position] += 1
            reader = self.read.readers[node]
            timeout_s = self.deadline_s - asyncio.get_running_loop().time()
            task = asyncio.ensure_future(
                reader.read_batch(request.keys, request.wanted, self.outs, timeout_s)
            )
            self.tasks[task] = request
            self.read.counters.num_node_requests += 1

    async def gather(self) -> None:
        """Absorb answers until every key is decided or every request finished; then give
        requests that still owe data shards a short grace (see :meth:`_wait_for_data`)."""
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        hedge_at_s = started_s + self.read.hedge_delay_s if self.read.hedge_delay_s else None
        while self.tasks and self.num_undecided:
            timeout_s = None if hedge_at_s is None else max(0.0, hedge_at_s - loop.time())
            waited_ns = time.monotonic_ns()
            done, _ = await asyncio.wait(
                self.tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if self.read.timeline is not None:
                self.read.timeline.add(CLIENT, "wait", waited_ns)
            for task in done:
                self._absorb(task, self.tasks.pop(task))
            hedged = hedge_at_s is not None and loop.time() >= hedge_at_s
            if hedged:
                hedge_at_s = None  # once: nodes that have not answered in time are skipped
            self._ask_reserves(every_undecided=hedged)
        await self._wait_for_data(loop.time() - started_s)

    async def _wait_for_data(self, elapsed_s: float) -> None:
        """Wait up to DATA_GRACE of the batch's time for requests owing data shards.

        A batch ends when every key has k shards, and the last node to answer is usually a
        data node of most keys: those keys would then be rebuilt from parity, a matrix decode
        that costs more CPU than the whole transfer (erasure/codec.py). A healthy node answers
        within a fraction of the batch's time; a known-slow node is not asked at all
        (client/read_plan.py), and one that turns slow costs the batch DATA_GRACE at most.
        Why half the batch's time, not a tenth: where the nodes share few cores, the last
        data node is usually one waiting for a core: on the 2-core machine (load 15-22) a
        tenth let 7-15% of the swap-in bench's blocks be rebuilt from parity in each of
        three runs, half none in two of three, and a rebuild costs the client about what
        the block's landing and check cost.
        """
        owing = [
            task
            for task, request in self.tasks.items()
            if any(
                index < self.k and self.complete[position] is not None
                for position, index in zip(
                    request.wanted.positions, request.wanted.shard_indexes, strict=True
                )
            )
        ]
        if not owing:
            return
        done, _ = await asyncio.wait(owing, timeout=max(elapsed_s * DATA_GRACE, 0.0005))
        for task in done:
            self._absorb(task, self.tasks.pop(task))

    def _absorb(self, task: asyncio.Task[NodeAnswer], request: _Request) -> None:
        try:
            answer = task.result()
        except (PermissionDenied, InvalidArgument):
            raise
        except KVStoreError as exc:
            log.debug(
                "batch read from node %s failed: %s", self.read.conns[request.node].node_id, exc
            )
            answer = None
        if answer is not None:
            tallied_ns = time.monotonic_ns()
            self.answers.append(answer)
            self._note_heard(answer, request)
            self._tally(answer, request)
            if self.read.timeline is not None:
                self._add_spans(self.read.timeline, answer, request, tallied_ns)
        for position in request.wanted.positions:
            self.pending[position] -= 1
            self._decide_if_hopeless(position)

    def _add_spans(
        self, timeline: ReadTimeline, answer: NodeAnswer, request: _Request, tallied_ns: int
    ) -> None:
        """One node answer's spans: its request, the node's read and the landing (where
        the transport timed them), and its tally on the event loop."""
        lane = f"node {self.read.conns[request.node].node_id}"
        timeline.add(lane, "request", request.sent_ns, tallied_ns)
        if answer.node_read_ns is not None:
            timeline.add(lane, "queue", request.sent_ns, answer.node_read_ns[0])
            timeline.add(lane, "read", *answer.node_read_ns)
        if answer.landed_ns is not None:
            timeline.add(lane, "land", *answer.landed_ns)
        timeline.add(CLIENT, "tally", tallied_ns)

    def _note_heard(self, answer: NodeAnswer, request: _Request) -> None:
        """Which shard indexes answered each key, with a HIT or without (for follow-ups)."""
        wanted = request.wanted
        entries = answer.entries
        rows = zip(entries["key_index"].tolist(), entries["status"].tolist(), strict=True)
        for key_index, status in rows:
            heard = self.heard_hit if status == batch_answer.HIT else self.heard_miss
            heard[wanted.positions[key_index]].add(wanted.shard_indexes[key_index])

    def _tally(self, answer: NodeAnswer, request: _Request) -> None:
        """Count every HIT shard of one node's answer by version, in numpy per answer
        (client/shard_table.py): its header checked, its checksum left to the block's."""
        entries = answer.entries
        statuses = entries["status"]
        self.read.counters.num_corrupt_shards += int((statuses == batch_answer.CORRUPT).sum())
        is_hit = statuses == batch_answer.HIT
        if not is_hit.any():
            return
        hits = entries[is_hit]
        positions = request.positions[hits["key_index"]]
        valid = headers_fit(self.read.codec, hits)
        in_place = np.asarray(answer.in_place, bool)
        reached = self.table.add(hits, positions, valid, in_place, answer.payloads.__getitem__)
        landing = valid & in_place & (hits["shard_index"] < self.k)
        self.num_in_place += np.bincount(positions[landing], minlength=len(self.num_in_place))
        landed_positions = positions[landing].tolist()
        if self.on_landed is not None and landed_positions:
            indexes = hits["shard_index"][landing].tolist()
            self.on_landed(list(zip(landed_positions, indexes, strict=True)))
        completed: list[int] = []
        for position, version in reached:
            if not self.decided[position]:
                self.complete[position] = version
                self._decide(position)
                completed.append(position)
        # Check blocks as soon as they are whole: those just completed, and those completed
        # earlier (by a parity shard) whose last data shard came now.
        fresh = set(completed)
        completed += (
            p
            for p in landed_positions
            if p not in fresh and p not in self.verified and self.complete[p] is not None
        )
        if completed:
            self._check_whole(list(dict.fromkeys(completed)))

    def _hopeless(self, position: int) -> bool:
        """The requests still out for this key cannot give it k shards of one version."""
        if self.decided[position]:
            return False
        best = self.table.best_count(position)
        return not can_complete(best, self.pending[position], self.k)

    def _reserve_helps(self, position: int) -> bool:
        """Whether asking the key's reserve nodes could still give it k shards: not when
        they were asked, or are too few (a key absent everywhere is a miss after 3 MISS
        answers of 11, one round trip, not two)."""
        reserve = self.reserve[self.groups[position]]
        return (
            not self.reserve_asked[position]
            and bool(reserve)
            and can_complete(
                self.table.best_count(position), self.pending[position] + len(reserve), self.k
            )
        )

    def _decide_if_hopeless(self, position: int) -> None:
        if self._hopeless(position) and not self._reserve_helps(position):
            self._decide(position)

    def _decide(self, position: int) -> None:
        self.decided[position] = True
        self.num_undecided -= 1

    def _ask_reserves(self, *, every_undecided: bool = False) -> None:
        """Ask the reserve nodes for the keys that can no longer complete otherwise, or for
        every undecided key at the hedge (once per key)."""
        group_to_positions: dict[int, list[int]] = {}
        for position in range(len(self.keys)):
            hopeless = self._hopeless(position)
            # A key no node has a shard of yet waits for its other answers before its
            # reserves are asked: MISS from everyone is a key the store lacks (a prefix
            # past what is cached), decided by its answers alone (_reserve_helps).
            unheard = not self.table.best_count(position) and self.pending[position]
            wanted = (hopeless and not unheard and self._reserve_helps(position)) or (
                every_undecided and not hopeless and not self.decided[position]
            )
            if wanted and not self.reserve_asked[position]:
                self.reserve_asked[position] = True
                group_to_positions.setdefault(self.groups[position], []).append(position)
        for group, positions in group_to_positions.items():
            members = self.read.group_members[group]
            self.read.counters.num_reserve_asks += len(self.reserve[group])
            for shard_index in self.reserve[group]:
                self._ask(members[shard_index], [(p, shard_index) for p in positions])
            for position in positions:
                self._decide_if_hopeless(position)

    async def stop(self) -> None:
        """Cancel the requests still out and wait until none can write into a buffer."""
        outstanding = set(self.tasks)
        if outstanding:
            self.read.counters.num_hedged += 1
        late_nodes = {self.tasks[t].node for t in outstanding}
        for node in self.asked_nodes:
            self.read.conns[node].health.record_lateness(node in late_nodes)
        for task in outstanding:
            task.cancel()
        finished = await asyncio.gather(*outstanding, return_exceptions=True)
        for result in finished:
            if isinstance(result, NodeAnswer):  # it finished as we stopped: nobody uses it
                result.release()
        for task in outstanding:
            consume_result(task)
        self.tasks.clear()

    def timed_out(self) -> list[bool]:
        """Per key: the deadline passed before it was decided (a timeout, not a miss)."""
        return [self.deadline_passed and not d for d in self.decided]

    def follow_up(self, blocks: list[bytes | memoryview | None], sink: FollowUpSink) -> None:
        """Per hit: touch the version's shard on the group's nodes not heard from for the key
        (reserves not asked, requests cancelled or failed; the nodes that served it refreshed
        it already), and hint repair when a node answered without the version's shard (a
        miss, a corrupt shard, an older version) so the group's leader rebuilds it."""
        for position, block in enumerate(blocks):
            version = self.complete[position]
            if block is None or version is None:
                continue
            group = self.groups[position]
            members = self.read.group_members[group]
            key = self.keys[position]
            heard = self.heard_hit[position] | self.heard_miss[position]
            unheard = [
                self.read.conns[node].node_id
                for index, node in enumerate(members)
                if index not in heard and not self.read.conns[node].is_suspect()
            ]
            if unheard:
                sink.touch(unheard, key, version)
            other_versions = self.table.other_indexes(position, version)
            if self.heard_miss[position] or other_versions - self.table.indexes(position, version):
                sink.hint_repair(group, key)

    def release(self) -> None:
        """Free the scratch of every answer (after decoding: parity shards live there)."""
        for answer in self.answers:
            answer.release()
