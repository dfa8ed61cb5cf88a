"""The repair service: a task inside every node that rebuilds the shards its led groups miss.

Where it runs, and why there. Every node runs one, and each repairs only the placement groups
it *leads*: a group is led by its first member, by position, that answers Health
(:func:`kvstore.node.repair.group_leader`; on a 12-node local cluster node i leads group i). So
repair needs no extra process to deploy or keep alive, its work spreads over the nodes, and
when a leader is down the next member takes its groups over. Two nodes may both believe they
lead for a moment (a flapping Health); that costs duplicate work, never wrong data: rebuilt
shards are verified, and a put of a shard a node already holds is a no-op.

A pass over one led group::

    ListShards(group) on every member, page by page, merged by key (tenant hash, key)
        -> kvstore.node.repair.plan_block per key: target version, holders, missing, waiting
        -> the group's backlog replaced by what this listing found (repair_backlog.py)
    order: most missing first, then longest remaining lifetime (kvstore/node/repair.py)
    for each plan, at repair_bytes_per_s (a token bucket over bytes read + written):
        skip it if it expires before its rebuild would finish at that rate
        read the target version's shard from k holders (GetShards, version pinned)
        decode (every shard checksum and the block checksum verified), encode again
        PutShards(repair) the missing shard i to member i, with the version's write time
            and the block's expiry (no fresh TTL); a member that deleted the key at or after
            that write time refuses it (fenced: the repair rule, kvstore/store/deletion.py), and a
            member takes repair writes only once it has pulled its peers' delete logs
            (kvstore/node/tombstones.py), so a repair never brings back a deleted block

Repair re-creates versions, it never mints them: a node takes a repair write from a node
principal only for a version that at least k *other* members of the key's group hold at their
own positions, as it finds by listing them itself (:meth:`RepairService.confirm_repair`), and
with no later expiry than theirs. A leader's rebuild always meets that (its plan's target has k
holders); a shard that a node credential made up, or a key the tenant never wrote, does not,
and the write is refused (PERMISSION_DENIED). By induction every shard a repair stored is of a
version some tenant's client wrote: forging one needs k-1 honest members to hold it already.

When (kvstore/node/repair_backlog.py PassSchedule). Nothing runs until this node itself is
ready for repair (serving, and it pulled its peers' delete logs: Health ``repair_ready``); then
it lists every group it leads. After that a group is listed again every
``repair_scan_interval_s``, and ``SETTLE_S`` after a trigger: a member restarted, came back, went
down or became ready (Health every ``PROBE_S``, up to ``PROBE_IDLE_S`` while all is steady: an
idle node must cost nothing), or this node took the group's lead over.
Triggers during the settle join that pass, so a block whose two members return together is
decoded once. Shards go only to the member that should hold them; a member that is down waits
(its shards count in the backlog as waiting). Hints (QueueRepair: reads that decoded around a
gap, writes that landed fewer than k+m shards) are looked at between passes, one key at a time;
a hint of a group whose pass is due waits for that pass, and a hinted block that misses shards
on a member that is up while another member is still down waits one settle delay for it.

The listing is repair_listing.py, a block's rebuild (read, decode, encode, put, at the repair
rate) repair_rebuild.py; this module decides what runs when.

Figures (Stats ``repair``, Prometheus ``kvstore_repair_*``): the backlog as the latest looks
found it (shards missing and waiting, blocks at risk, the rebuild's cost and ETA, groups whose
pass is pending), rebuilt shards and bytes, bytes read, blocks skipped as expiring, blocks left
unrecoverable, fenced shards, hints waiting, passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from erasure.codec import make_codec
from erasure.shard import shard_version
from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import PermissionDenied
from kvstore.node.peers import Peers
from kvstore.node.repair import (
    BlockPlan,
    Unrecoverable,
    expires_before_rebuilt,
    group_leader,
    plan_block,
    repair_order,
)
from kvstore.node.repair_backlog import (
    Backlog,
    BlockId,
    Hole,
    PassSchedule,
    ProbePacer,
    RateMeter,
    changed_members,
    eta_s,
)
from kvstore.node.repair_listing import list_group, list_key, listed_entry
from kvstore.node.repair_rebuild import Rebuilder, Throttle
from kvstore.placement import Placement
from ttl.clock import Clock

log = logging.getLogger(__name__)

MAX_HINTS = 100_000  # beyond this the oldest hints go: the next pass finds those blocks anyway
HINT_RETRY_S = 5.0  # a hint whose owner is down is looked at again this often
RETRY_S = 5.0  # a pass that left shards missing on members that are up runs again after this
IDLE_S = 0.2  # the loop's shortest sleep between looks for due hints and passes
PROBE_S = 2.0  # how often the members of this node's groups are asked for Health, backing
PROBE_IDLE_S = 16.0  # off to this while every member is up and nothing changed (ProbePacer)
SETTLE_S = 3.0  # a triggered pass waits this long, so members returning together share it
PEER_TIMEOUT_S = 10.0
REBUILDS_IN_FLIGHT = 4


@dataclass(frozen=True)
class RepairStats:
    """What repair did since the node started, what it knows is missing (repair_backlog.py)."""

    backlog_shards: int = 0  # missing + waiting, in the led groups, as last looked at
    rebuilt_shards: int = 0
    rebuilt_bytes: int = 0
    read_bytes: int = 0
    skipped_expiring: int = 0
    unrecoverable: int = 0  # blocks of the led groups with fewer than k shards (last pass)
    fenced: int = 0
    queued_hints: int = 0
    passes: int = 0
    led_groups: tuple[int, ...] = ()
    waiting_shards: int = 0  # of the backlog: shards whose member is down or not ready
    at_risk_blocks: int = 0  # blocks with fewer than k+m shards
    backlog_bytes: int = 0  # what rebuilding the backlog moves (read + written)
    eta_s: float = 0.0  # backlog_bytes at the repair rate
    pending_groups: int = 0  # led groups whose pass is due (all, before this node is ready)
    ready: bool = False  # this node is ready for repair (it ran or is due to run its passes)


@dataclass
class _Hint:
    """A hinted block: group, when to look at it, when queued, whether it waited a settle."""

    group: int
    due_s: float
    queued_s: float
    settled: bool = False


class RepairService:
    """The repair loop of one node (see the module docstring). ``run()`` until cancelled.

    ``ready()`` says whether this node is ready for repair (serving, its peers' delete logs
    pulled): no pass or hint runs before, and becoming ready starts a pass of its groups.
    ``on_peer_logs`` gets the members' newest delete-log sequence numbers at every probe (the
    node pulls from those it is behind: kvstore/node/tombstones.py).
    """

    def __init__(
        self,
        cluster: ClusterConfig,
        node: NodeConfig,
        clock: Clock,
        ready: Callable[[], bool] = lambda: True,
        on_peer_logs: Callable[[dict[str, int]], None] = lambda peer_to_seq: None,
    ) -> None:
        self._cluster = cluster
        self._node = node
        self._clock = clock
        self._ready = ready
        self._on_peer_logs = on_peer_logs
        self._codec = make_codec(cluster.codec)
        self._peers = Peers(cluster, node, PEER_TIMEOUT_S)
        self._placement = Placement(cluster)
        self._throttle = Throttle(node.repair_bytes_per_s)
        self._rate = RateMeter()
        self._rebuilder = Rebuilder(self._codec, self._throttle, self._rate, self._count)
        self._hints: OrderedDict[BlockId, _Hint] = OrderedDict()
        # queue() runs in the node's request pool while the loop walks the hints: without
        # the lock a large QueueRepair broke the walk ("OrderedDict mutated during iteration").
        self._hints_lock = threading.Lock()
        self._incarnations: dict[str, int] = {}
        self._backlog = Backlog(self._codec.k)
        self._group_unrecoverable: dict[int, int] = {}
        self._schedule = PassSchedule(SETTLE_S, node.repair_scan_interval_s)
        self._was_ready = False
        self._probes = ProbePacer(PROBE_S, PROBE_IDLE_S)
        self._wake = asyncio.Event()
        self._closing: set[asyncio.Future[None]] = set()
        self.stats = RepairStats()

    def queue(self, hints: Iterable[tuple[str, bytes, int]]) -> int:
        """Queue (tenant, key, group) hints for inspection; return how many were new (none
        while repair is off: ``repair_bytes_per_s = 0``)."""
        if not self._node.repair_bytes_per_s:
            return 0
        num_new = 0
        now_s = time.monotonic()
        with self._hints_lock:
            for tenant, key, group in hints:
                if not 0 <= group < len(self._cluster.groups) or len(key) != 16:
                    continue
                num_new += (tenant, key) not in self._hints
                self._hints[(tenant, bytes(key))] = _Hint(group, now_s, now_s)
                while len(self._hints) > MAX_HINTS:
                    self._hints.popitem(last=False)
            self._set_stats(queued_hints=len(self._hints))
        self._wake.set()
        return num_new

    def set_cluster(self, cluster: ClusterConfig) -> None:
        """Follow a newer map epoch (etcd membership): new members, new peers, and a pass of
        every led group once the next probe saw them, since a changed group's new member
        needs its shards."""
        old_peers = self._peers
        self._cluster = cluster
        self._peers = Peers(cluster, self._node, PEER_TIMEOUT_S)
        self._placement = Placement(cluster)
        self._closing.add(asyncio.ensure_future(old_peers.close()))
        self._incarnations.clear()
        self._probes.reset()
        self._schedule.trigger(range(len(cluster.groups)), time.monotonic())
        self._wake.set()

    @property
    def epoch(self) -> int:
        return self._cluster.epoch

    async def repair_group(self, group: int) -> None:
        """One repair pass over ``group`` now, whoever leads it (a map change moving shards:
        kvstore/node/map_keeper.py). A second pass by its leader meanwhile only repeats work."""
        await self._repair_group(group)

    async def shards_needed(self, group: int, positions: Iterable[int]) -> int:
        """Shards the members at ``positions`` of ``group`` lack (missing or waiting), by a
        fresh listing of every member: 0 means each holds its shard of every readable block."""
        wanted = set(positions)
        members = self._cluster.groups[group]
        now_s = self._clock.now()
        num_needed = 0
        async for tenant, key, listed, up in list_group(self._peers, group, members):
            plan = plan_block(tenant, key, listed, up, self._codec.k, len(members), now_s)
            if isinstance(plan, BlockPlan):
                num_needed += len(wanted & {*plan.missing, *plan.waiting})
        return num_needed

    async def confirm_repair(
        self, tenant: str, shards: Sequence[tuple[bytes, bytes]], expires_at_s: float
    ) -> None:
        """PermissionDenied unless every (key, shard) of a node's repair write is of a version
        at least k other members of the key's group hold, expiring no earlier than
        ``expires_at_s`` (0: a fresh TTL, which a repair never asks for) (module doc)."""
        held = await asyncio.gather(
            *(self._held_until(tenant, key, shard_version(shard)) for key, shard in shards)
        )
        for (key, shard), until_s in zip(shards, held, strict=True):
            if until_s is None or not 0 < expires_at_s <= until_s:
                raise PermissionDenied(
                    f"repair write of tenant {tenant!r} key {bytes(key).hex()} version "
                    f"{shard_version(shard).hex()}: fewer than {self._codec.k} other members of "
                    "its group hold that version (or they expire it sooner); a repair only "
                    "re-creates versions the group holds"
                )

    async def _held_until(self, tenant: str, key: bytes, version: bytes) -> float | None:
        """The latest expiry of ``version`` among the other members of ``key``'s group that
        hold it at their position, if at least k do; else None."""
        group = self._placement.group_index(key)
        members = self._cluster.groups[group]
        others = [(p, m) for p, m in enumerate(members) if m != self._node.id]
        found = await list_key(self._peers, group, others, tenant, key)
        now_s = self._clock.now()
        expiries = [
            s.expires_at_s
            for position, shards in found.items()
            for s in shards
            if s.version == version and s.shard_index == position and s.expires_at_s > now_s
        ]
        return max(expiries) if len(expiries) >= self._codec.k else None

    async def run(self) -> None:
        """Probes, passes and hints, forever; errors are logged and retried, never fatal."""
        if not self._node.repair_bytes_per_s:
            return
        try:
            while True:
                try:
                    await self._step()
                except Exception:
                    log.exception("repair step failed; retrying")
                    await asyncio.sleep(HINT_RETRY_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._sleep_s(time.monotonic()))
                self._wake.clear()
        finally:
            await self._peers.close()

    def _sleep_s(self, now_s: float) -> float:
        """Until the next probe or pass (hints, map changes wake it); IDLE_S while hints wait."""
        if self._hints or not self._was_ready:  # a racing queue() also sets _wake
            return IDLE_S
        return max(IDLE_S, min(self._probes.next_s, self._schedule.next_due_s()) - now_s)

    async def _step(self) -> None:
        ready = self._ready()
        if time.monotonic() >= self._probes.next_s or (ready and not self._was_ready):
            self._probes.probed(await self._probe(), time.monotonic())
        if ready and not self._was_ready:
            log.info("node %s is ready for repair: listing its groups", self._node.id)
            self._schedule.start(self.stats.led_groups, time.monotonic())
        self._was_ready = ready
        if ready:
            led = self.stats.led_groups
            for group in self._schedule.take_due(led, time.monotonic()):
                await self._pass(group)
            await self._inspect_hints()
        self._publish()

    async def _pass(self, group: int) -> None:
        """One listing pass over a led group; listed again ``RETRY_S`` later when it failed
        or left shards missing on members that are up (a put refused, a survivor unreadable)."""
        try:
            unlisted = await self._repair_group(group)
        except Exception:
            log.exception("repair pass over group %d failed; retrying", group)
            self._schedule.retry(group, time.monotonic() + RETRY_S)
            return
        self._set_stats(passes=self.stats.passes + 1)
        # A member the probe finds up that did not list (busy: it shed the call) is no down
        # member whose return will trigger a pass: look again soon.
        busy = [m for m in unlisted if self._incarnations.get(m)]
        if self._backlog.missing_in(group) or busy:
            self._schedule.retry(group, time.monotonic() + RETRY_S)

    async def _probe(self) -> bool:
        """Ask the members of this node's groups for Health: which groups it leads now, which
        members changed since the last probe (restarted, back, down, ready: their shared led
        groups get a pass, as do groups just taken over); True if all were up, none changed."""
        mine = [g for g, members in enumerate(self._cluster.groups) if self._node.id in members]
        others = sorted({m for g in mine for m in self._cluster.groups[g]} - {self._node.id})
        replies = await asyncio.gather(*(self._peers.health(m) for m in others))
        up, seen = {}, {}
        for member, reply in zip(others, replies, strict=True):
            # Up for repair: serving, and it has pulled its peers' delete logs.
            up[member] = reply is not None and reply.serving and reply.repair_ready
            seen[member] = reply.incarnation if up[member] else 0  # 0: down, or not ready
        self._on_peer_logs(
            {m: r.last_tombstone_seq for m, r in zip(others, replies, strict=True) if r}
        )
        changed = changed_members(self._incarnations, seen)
        self._incarnations = seen
        was_led = set(self.stats.led_groups)
        led = [g for g in mine if group_leader(self._cluster.groups[g], self._node.id, up.get)]
        self._set_stats(led_groups=tuple(led))
        self._backlog.keep_groups(led)
        if not self._was_ready:
            return False  # the first pass (when this node is ready) lists every led group anyway
        shared = [g for g in led if changed & set(self._cluster.groups[g])]
        taken_over = [g for g in led if g not in was_led]
        if changed:
            log.info("repair: members %s changed; listing groups %s", sorted(changed), shared)
        self._schedule.trigger([*shared, *taken_over], time.monotonic())
        return not changed and not taken_over and all(up.values())

    async def _repair_group(self, group: int) -> set[str]:
        """List ``group``, record what it lacks as its backlog, rebuild in repair order;
        return the members that did not list."""
        members = self._cluster.groups[group]
        started_s = time.monotonic()
        now_s = self._clock.now()
        plans: list[BlockPlan] = []
        num_unrecoverable = 0
        listed_by: list[int] = list(range(len(members)))
        async for tenant, key, listed, up in list_group(self._peers, group, members):
            listed_by = up
            plan = plan_block(tenant, key, listed, up, self._codec.k, len(members), now_s)
            if isinstance(plan, Unrecoverable):
                num_unrecoverable += 1
            elif plan is not None:
                plans.append(plan)
        self._group_unrecoverable[group] = num_unrecoverable
        self._backlog.replace_group(group, {(p.tenant, p.key): _hole(p) for p in plans})
        self._forget_hints_seen(group, started_s)
        self._publish()
        listed_s = time.monotonic()
        rebuilt_before = self.stats.rebuilt_shards
        await self._rebuild_all(group, repair_order(plans))
        log.info(
            "repair of group %d: listed in %.1f s, %d blocks short, %d shards rebuilt in %.1f s, "
            "%d left missing",
            group,
            listed_s - started_s,
            len(plans),
            self.stats.rebuilt_shards - rebuilt_before,
            time.monotonic() - listed_s,
            self._backlog.missing_in(group),
        )
        return {m for p, m in enumerate(members) if p not in listed_by}

    def _forget_hints_seen(self, group: int, listed_s: float) -> None:
        """Hints of ``group`` queued before its listing began: the listing saw their blocks."""
        with self._hints_lock:
            seen = [b for b, h in self._hints.items() if h.group == group and h.queued_s < listed_s]
            for block in seen:
                del self._hints[block]

    async def _rebuild_all(self, group: int, plans: list[BlockPlan]) -> None:
        """Rebuild ``plans`` in order, ``REBUILDS_IN_FLIGHT`` at a time (a block's reads and
        puts are round trips: several in flight keep the throttle, not latency, the limit)."""
        slots = asyncio.Semaphore(REBUILDS_IN_FLIGHT)
        bytes_ahead = 0
        rebuilds: list[asyncio.Future[None]] = []
        try:
            for plan in plans:
                now_s = self._clock.now()
                # The rate is in real seconds, expiry on the cluster's (possibly scaled) clock.
                bytes_per_clock_s = self._throttle.bytes_per_s / self._cluster.ttl.time_scale
                if plan.missing and expires_before_rebuilt(
                    plan, bytes_ahead, bytes_per_clock_s, now_s
                ):
                    self._set_stats(skipped_expiring=self.stats.skipped_expiring + 1)
                    self._backlog.set_block(group, (plan.tenant, plan.key), None)
                    continue
                if plan.missing:
                    bytes_ahead += plan.cost_bytes
                    await slots.acquire()
                    rebuilds.append(asyncio.ensure_future(self._rebuild_one(group, plan, slots)))
            await asyncio.gather(*rebuilds)
        except BaseException:
            for rebuild in rebuilds:
                rebuild.cancel()
            await asyncio.gather(*rebuilds, return_exceptions=True)
            raise

    async def _rebuild_one(self, group: int, plan: BlockPlan, slots: asyncio.Semaphore) -> None:
        try:
            members = self._cluster.groups[group]
            answered = await self._rebuilder.rebuild(self._peers, members, plan)
            self._backlog.set_block(group, (plan.tenant, plan.key), _hole(plan, answered))
            self._publish()
        finally:
            slots.release()

    async def _inspect_hints(self) -> None:
        """Look at each hinted block now due whose group has no pass due: rebuild what it
        misses (after one settle delay when a member is down, which may be back by then), or
        wait for its owner; its backlog entry is what this look found."""
        now_s = time.monotonic()
        for (tenant, key), hint in self._due_hints(now_s):
            plan = await self._inspect(tenant, key, hint.group)
            if plan is not None and plan.missing and plan.waiting and not hint.settled:
                hint.due_s, hint.settled = now_s + SETTLE_S, True
                continue
            answered = (
                await self._rebuilder.rebuild(self._peers, self._cluster.groups[hint.group], plan)
                if plan and plan.missing
                else 0
            )
            hole = None if plan is None else _hole(plan, answered)
            self._backlog.set_block(hint.group, (tenant, key), hole)
            with self._hints_lock:
                if plan is not None and plan.waiting:
                    hint.due_s = now_s + HINT_RETRY_S
                else:
                    self._hints.pop((tenant, key), None)
        with self._hints_lock:
            self._set_stats(queued_hints=len(self._hints))

    def _due_hints(self, now_s: float) -> list[tuple[BlockId, _Hint]]:
        """The hinted blocks due at ``now_s`` (monotonic) whose group has no pass due."""
        with self._hints_lock:
            return [
                (block, hint)
                for block, hint in self._hints.items()
                if hint.due_s <= now_s and not self._schedule.is_due(hint.group)
            ]

    async def _inspect(self, tenant: str, key: bytes, group: int) -> BlockPlan | None:
        members = self._cluster.groups[group]
        found = await list_key(self._peers, group, list(enumerate(members)), tenant, key)
        entries = [listed_entry(p, s) for p, shards in found.items() for s in shards]
        up = list(found)
        plan = plan_block(tenant, key, entries, up, self._codec.k, len(members), self._clock.now())
        return plan if isinstance(plan, BlockPlan) else None

    def _publish(self) -> None:
        """The backlog figures into :attr:`stats` (read by Stats and the metrics)."""
        led = self.stats.led_groups
        figures = self._backlog.figures()
        self._set_stats(
            backlog_shards=figures.shards,
            waiting_shards=figures.waiting,
            at_risk_blocks=figures.blocks,
            backlog_bytes=figures.cost_bytes,
            eta_s=eta_s(figures.cost_bytes, self._throttle.bytes_per_s, self._rate.bytes_per_s),
            unrecoverable=sum(n for g, n in self._group_unrecoverable.items() if g in led),
            pending_groups=self._schedule.pending(led),
            ready=self._was_ready,
        )

    def _count(self, **deltas: int) -> None:
        """Add ``deltas`` to counters of :attr:`stats` (the rebuilder's bytes and shards)."""
        self._set_stats(**{name: getattr(self.stats, name) + n for name, n in deltas.items()})

    def _set_stats(self, **changes: object) -> None:
        self.stats = replace(self.stats, **changes)  # type: ignore[arg-type]

    async def close(self) -> None:
        await self._peers.close()
        await asyncio.gather(*self._closing, return_exceptions=True)


def _hole(plan: BlockPlan, num_rebuilt: int = 0) -> Hole:
    """What ``plan``'s block lacks once ``num_rebuilt`` of its missing shards were stored."""
    missing = max(0, len(plan.missing) - num_rebuilt)
    return Hole(missing, len(plan.waiting), plan.shard_bytes)
