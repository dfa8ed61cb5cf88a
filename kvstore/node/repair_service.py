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

Shards go only to the member that should hold them; a member that is down waits (its shards
count in the backlog) and gets them when it is back: a member that is up for repair again
(Health ``repair_ready``) after it was down or not ready, or under a new incarnation (a
restart, a disk replaced), starts a pass at once, and otherwise a pass runs every
``repair_scan_interval_s``. Hints (QueueRepair: reads that decoded around a gap, writes that
landed fewer than k+m shards) are inspected before the next page, one key at a time.

Figures (Stats ``repair``, Prometheus ``kvstore_repair_*``): backlog shards (missing and
waiting in the led groups, as far as the passes have seen), rebuilt shards and bytes, bytes
read, blocks skipped as expiring, unrecoverable blocks, fenced shards, hints waiting, passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field, replace

from erasure.codec import make_codec
from erasure.shard import shard_version
from kvstore.config import ClusterConfig, NodeConfig
from kvstore.errors import CodecError, KVStoreError, PermissionDenied
from kvstore.node.peers import Peers
from kvstore.node.repair import (
    BlockPlan,
    Listed,
    Unrecoverable,
    expires_before_rebuilt,
    group_leader,
    plan_block,
    repair_order,
)
from kvstore.placement import Placement
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.index_codec import tenant_hash
from ttl.clock import Clock

log = logging.getLogger(__name__)

LIST_PAGE = 512
MAX_HINTS = 100_000  # beyond this the oldest hints go: the next pass finds those blocks anyway
HINT_RETRY_S = 5.0  # a hint whose owner is down is looked at again this often
IDLE_S = 0.2  # how often the loop looks for due hints
PROBE_S = 5.0  # how often the members of this node's groups are asked for Health
PEER_TIMEOUT_S = 10.0
_U32_BYTES = 4


@dataclass(frozen=True)
class RepairStats:
    """What the repair service did since the node started (see the module docstring)."""

    backlog_shards: int = 0
    rebuilt_shards: int = 0
    rebuilt_bytes: int = 0
    read_bytes: int = 0
    skipped_expiring: int = 0
    unrecoverable: int = 0
    fenced: int = 0
    queued_hints: int = 0
    passes: int = 0
    led_groups: tuple[int, ...] = ()


class Throttle:
    """A token bucket in bytes: :meth:`spend` waits until the rate allows ``num_bytes`` more."""

    def __init__(self, bytes_per_s: float, burst_s: float = 0.5) -> None:
        self.bytes_per_s = bytes_per_s
        self._burst_bytes = bytes_per_s * burst_s
        self._tokens = self._burst_bytes
        self._last_s = time.monotonic()

    async def spend(self, num_bytes: int) -> None:
        now_s = time.monotonic()
        self._tokens = min(
            self._burst_bytes, self._tokens + (now_s - self._last_s) * self.bytes_per_s
        )
        self._last_s = now_s
        self._tokens -= num_bytes
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.bytes_per_s)


@dataclass
class _GroupListing:
    """One member's paged listing of a group, consumed in key order."""

    node_id: str
    position: int
    after: bytes = b""
    buffer: list[pb.ListedShard] = field(default_factory=list)
    done: bool = False


class RepairService:
    """The repair loop of one node (see the module docstring). ``run()`` until cancelled."""

    def __init__(self, cluster: ClusterConfig, node: NodeConfig, clock: Clock) -> None:
        self._cluster = cluster
        self._node = node
        self._clock = clock
        self._codec = make_codec(cluster.codec)
        self._peers = Peers(cluster, node, PEER_TIMEOUT_S)
        self._placement = Placement(cluster)
        self._throttle = Throttle(node.repair_bytes_per_s)
        self._hints: OrderedDict[tuple[str, bytes], tuple[int, float]] = OrderedDict()
        # queue() runs in the node's request pool while the loop walks the hints: without
        # the lock a large QueueRepair broke the walk ("OrderedDict mutated during iteration").
        self._hints_lock = threading.Lock()
        self._incarnations: dict[str, int] = {}
        self._group_backlog: dict[int, int] = {}
        self._next_pass_s = 0.0
        self._next_probe_s = 0.0
        self._wake = asyncio.Event()
        self._closing: set[asyncio.Future[None]] = set()
        self.stats = RepairStats()

    def queue(self, hints: Iterable[tuple[str, bytes, int]]) -> int:
        """Queue (tenant, key, group) hints for inspection; return how many were new (none
        while repair is off: ``repair_bytes_per_s = 0``)."""
        if not self._node.repair_bytes_per_s:
            return 0
        num_new = 0
        with self._hints_lock:
            for tenant, key, group in hints:
                if not 0 <= group < len(self._cluster.groups) or len(key) != 16:
                    continue
                num_new += (tenant, key) not in self._hints
                self._hints[(tenant, bytes(key))] = (group, 0.0)
                while len(self._hints) > MAX_HINTS:
                    self._hints.popitem(last=False)
            self._set_stats(queued_hints=len(self._hints))
        self._wake.set()
        return num_new

    def set_cluster(self, cluster: ClusterConfig) -> None:
        """Follow a newer map epoch (etcd membership): new members, new peers, and a pass at
        once, since a changed group's new member needs its shards."""
        old_peers = self._peers
        self._cluster = cluster
        self._peers = Peers(cluster, self._node, PEER_TIMEOUT_S)
        self._placement = Placement(cluster)
        self._closing.add(asyncio.ensure_future(old_peers.close()))
        self._next_pass_s = self._next_probe_s = 0.0
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
        async for tenant, key, listed, up in self._list_group(group):
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
        start_after = group.to_bytes(_U32_BYTES, "big") + tenant_hash(tenant) + key
        others = [(p, m) for p, m in enumerate(members) if m != self._node.id]
        replies = await asyncio.gather(
            *(self._peers.list_shards(m, group, start_after, 8) for _, m in others),
            return_exceptions=True,
        )
        now_s = self._clock.now()
        expiries = [
            s.expires_at_s
            for (position, _), reply in zip(others, replies, strict=True)
            if not isinstance(reply, BaseException)
            for s in reply.shards
            if (s.tenant, s.key, s.version) == (tenant, key, version)
            and s.shard_index == position
            and s.expires_at_s > now_s
        ]
        return max(expiries) if len(expiries) >= self._codec.k else None

    async def run(self) -> None:
        """Passes and hints, forever; errors are logged and retried, never fatal."""
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
                    await asyncio.wait_for(self._wake.wait(), IDLE_S)
                self._wake.clear()
        finally:
            await self._peers.close()

    async def _step(self) -> None:
        await self._inspect_hints()
        restarted = False
        if time.monotonic() >= self._next_probe_s:
            self._next_probe_s = time.monotonic() + PROBE_S
            restarted = await self._probe()
        if restarted or time.monotonic() >= self._next_pass_s:
            self._next_pass_s = time.monotonic() + self._node.repair_scan_interval_s
            await self.repair_pass()

    async def repair_pass(self) -> None:
        """One pass over every group this node leads (as the latest probe found)."""
        led = self.stats.led_groups
        for group in list(self._group_backlog):
            if group not in led:
                del self._group_backlog[group]
        for group in led:
            await self._repair_group(group)
        self._set_stats(passes=self.stats.passes + 1, backlog_shards=self._backlog())

    async def _probe(self) -> bool:
        """Ask the members of this node's groups for Health: which groups it leads now, and
        whether a member restarted since the last probe (a disk replaced, a node back from an
        outage), which starts a pass at once."""
        mine = [g for g, members in enumerate(self._cluster.groups) if self._node.id in members]
        others = sorted({m for g in mine for m in self._cluster.groups[g]} - {self._node.id})
        replies = await asyncio.gather(*(self._peers.health(m) for m in others))
        up, restarted = {}, False
        for member, reply in zip(others, replies, strict=True):
            # Up for repair: serving, and it has pulled its peers' delete logs.
            up[member] = reply is not None and reply.serving and reply.repair_ready
            seen = reply.incarnation if up[member] else 0  # 0: down, or not ready yet
            previous = self._incarnations.get(member)
            self._incarnations[member] = seen
            restarted |= bool(seen) and previous is not None and previous != seen
        led = [g for g in mine if group_leader(self._cluster.groups[g], self._node.id, up.get)]
        self._set_stats(led_groups=tuple(led))
        return restarted

    async def _repair_group(self, group: int) -> None:
        members = self._cluster.groups[group]
        now_s = self._clock.now()
        plans: list[BlockPlan] = []
        num_unrecoverable = 0
        async for tenant, key, listed, up in self._list_group(group):
            plan = plan_block(tenant, key, listed, up, self._codec.k, len(members), now_s)
            if isinstance(plan, Unrecoverable):
                num_unrecoverable += 1
            elif plan is not None:
                plans.append(plan)
        self._set_stats(unrecoverable=self.stats.unrecoverable + num_unrecoverable)
        await self._rebuild_all(group, repair_order(plans))

    async def _rebuild_all(self, group: int, plans: list[BlockPlan]) -> None:
        self._group_backlog[group] = sum(len(p.missing) + len(p.waiting) for p in plans)
        self._set_stats(backlog_shards=self._backlog())
        bytes_ahead = 0
        for plan in plans:
            now_s = self._clock.now()
            # The rate is in real seconds, expiry on the cluster's (possibly scaled) clock.
            bytes_per_clock_s = self._throttle.bytes_per_s / self._cluster.ttl.time_scale
            if plan.missing and expires_before_rebuilt(plan, bytes_ahead, bytes_per_clock_s, now_s):
                self._set_stats(skipped_expiring=self.stats.skipped_expiring + 1)
                self._group_backlog[group] -= len(plan.missing) + len(plan.waiting)
                continue
            if plan.missing:
                bytes_ahead += plan.cost_bytes
                self._group_backlog[group] -= await self._rebuild(group, plan)
            self._set_stats(backlog_shards=self._backlog())

    async def _rebuild(self, group: int, plan: BlockPlan) -> int:
        """Rebuild ``plan``'s missing shards and store each on its member; return how many
        members answered (stored it, held it already, hold a newer version, or fenced it)."""
        members = self._cluster.groups[group]
        block = await self._read_block(members, plan)
        if block is None:
            return 0
        shards = self._codec.encode(block)
        request = pb.PutShardsRequest(
            tenant=plan.tenant,
            traffic_class=plan.traffic_class,
            expires_at_s=plan.expires_at_s,
            repair=True,
        )
        num_answered = 0
        for position in plan.missing:
            await self._throttle.spend(len(shards[position]))
            try:
                reply = await self._put(
                    members[position], request, plan.key, shards[position], plan.written_at_s
                )
            except KVStoreError as exc:
                log.info("repair of %s on %s failed: %s", plan.key.hex(), members[position], exc)
                continue
            num_answered += 1
            self._set_stats(
                rebuilt_shards=self.stats.rebuilt_shards + reply.num_stored,
                rebuilt_bytes=self.stats.rebuilt_bytes + reply.num_stored * len(shards[position]),
                fenced=self.stats.fenced + reply.num_fenced,
            )
        return num_answered

    async def _put(
        self,
        node_id: str,
        template: pb.PutShardsRequest,
        key: bytes,
        shard: bytes,
        written_at_s: float,
    ) -> pb.PutShardsReply:
        request = pb.PutShardsRequest()
        request.CopyFrom(template)
        return await self._peers.put_shards(node_id, request, [(key, shard, written_at_s)])

    async def _read_block(self, members: tuple[str, ...], plan: BlockPlan) -> bytes | None:
        """The block, from k verified shards of the plan's version (None if they are gone).

        Asks k holders at once, and more holders only for those that fail.
        """
        shards: dict[int, bytes] = {}
        candidates = list(plan.holders)
        while len(shards) < plan.k and candidates:
            wave = candidates[: plan.k - len(shards)]
            candidates = candidates[len(wave) :]
            got = await asyncio.gather(
                *(self._survivor(members[p], p, plan) for p in wave), return_exceptions=True
            )
            shards.update({p: g for p, g in zip(wave, got, strict=True) if isinstance(g, bytes)})
        if len(shards) < plan.k:
            return None
        try:
            # digest=None: a keyed version (client/integrity.py) is the tenant's to check; the
            # shard checksums verified in _survivor guard what is rebuilt here.
            survivors = [shards[p] for p in sorted(shards)]
            return bytes(self._codec.decode(survivors, verified=True, digest=None))
        except CodecError as exc:
            log.warning("repair of %s: survivors do not decode: %s", plan.key.hex(), exc)
            return None

    async def _survivor(self, node_id: str, position: int, plan: BlockPlan) -> bytes | None:
        """The plan's version's shard from one holder, verified, or None."""
        try:
            shard = await self._peers.get_shard(node_id, plan.tenant, plan.key, plan.version)
        except KVStoreError:
            return None
        await self._throttle.spend(len(shard))
        self._set_stats(read_bytes=self.stats.read_bytes + len(shard))
        try:
            header = self._codec.verify(shard)
        except CodecError:
            return None
        if header.block_checksum != plan.version or header.index != position:
            return None
        return shard

    async def _list_group(
        self, group: int
    ) -> AsyncIterator[tuple[str, bytes, list[Listed], list[int]]]:
        """(tenant, key, every member's entries of it, positions up) for each key of a group,
        in key order, merging the members' paged listings."""
        members = self._cluster.groups[group]
        listings = [_GroupListing(node_id, p) for p, node_id in enumerate(members)]
        up = list(range(len(members)))
        while True:
            for listing in listings:
                needs_page = not listing.done and len(listing.buffer) < LIST_PAGE // 2
                if needs_page and not await self._fetch_page(group, listing):
                    up = [p for p in up if p != listing.position]
            pending = [listing for listing in listings if not listing.done and listing.buffer]
            bound = min((_sort_key(listing.buffer[-1]) for listing in pending), default=None)
            by_key: dict[tuple[bytes, bytes, str], list[Listed]] = {}
            for listing in listings:
                keep = []
                for shard in listing.buffer:
                    sort_key = _sort_key(shard)
                    if bound is not None and sort_key >= bound:
                        keep.append(shard)
                        continue
                    by_key.setdefault(sort_key, []).append(_listed(listing.position, shard))
                listing.buffer = keep
            for (_, key, tenant), listed in sorted(by_key.items()):
                yield tenant, key, listed, up
            if all(listing.done and not listing.buffer for listing in listings):
                return

    async def _fetch_page(self, group: int, listing: _GroupListing) -> bool:
        """Append the member's next page; False (and done) if the member does not answer."""
        try:
            reply = await self._peers.list_shards(listing.node_id, group, listing.after, LIST_PAGE)
        except KVStoreError as exc:
            log.info("repair: %s did not list group %d: %s", listing.node_id, group, exc)
            listing.done = True
            return False
        listing.buffer.extend(reply.shards)
        listing.after = reply.next_after
        listing.done = not reply.next_after
        return True

    async def _inspect_hints(self) -> None:
        """Look at each hinted key now due: rebuild what it misses, or wait for its owner."""
        now_s = time.monotonic()
        for (tenant, key), group in self._due_hints(now_s):
            plan = await self._inspect(tenant, key, group)
            if plan is not None and plan.missing:
                await self._rebuild(group, plan)
            with self._hints_lock:
                if plan is not None and plan.waiting:
                    self._hints[(tenant, key)] = (group, now_s + HINT_RETRY_S)
                else:
                    self._hints.pop((tenant, key), None)
        with self._hints_lock:
            self._set_stats(queued_hints=len(self._hints))

    def _due_hints(self, now_s: float) -> list[tuple[tuple[str, bytes], int]]:
        """((tenant, key), group) of the hints due at ``now_s`` (monotonic)."""
        with self._hints_lock:
            return [(tk, g) for tk, (g, at_s) in self._hints.items() if at_s <= now_s]

    async def _inspect(self, tenant: str, key: bytes, group: int) -> BlockPlan | None:
        members = self._cluster.groups[group]
        start_after = group.to_bytes(_U32_BYTES, "big") + tenant_hash(tenant) + key
        replies = await asyncio.gather(
            *(self._peers.list_shards(m, group, start_after, 8) for m in members),
            return_exceptions=True,
        )
        listed, up = [], []
        for position, reply in enumerate(replies):
            if isinstance(reply, BaseException):
                continue
            up.append(position)
            listed += [
                _listed(position, s) for s in reply.shards if s.key == key and s.tenant == tenant
            ]
        plan = plan_block(tenant, key, listed, up, self._codec.k, len(members), self._clock.now())
        return plan if isinstance(plan, BlockPlan) else None

    def _backlog(self) -> int:
        return max(0, sum(self._group_backlog.values()))

    def _set_stats(self, **changes: object) -> None:
        self.stats = replace(self.stats, **changes)  # type: ignore[arg-type]

    async def close(self) -> None:
        await self._peers.close()
        await asyncio.gather(*self._closing, return_exceptions=True)


def _sort_key(shard: pb.ListedShard) -> tuple[bytes, bytes, str]:
    """A listed entry's place in a group's key order (tenant hash, key: the nodes' order)."""
    return (tenant_hash(shard.tenant), shard.key, shard.tenant)


def _listed(position: int, shard: pb.ListedShard) -> Listed:
    return Listed(
        position=position,
        version=shard.version,
        shard_index=shard.shard_index,
        written_at_s=shard.written_at_s,
        expires_at_s=shard.expires_at_s,
        traffic_class=shard.traffic_class,
        shard_bytes=shard.shard_bytes,
    )
