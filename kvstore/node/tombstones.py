"""Peers' delete logs: how a node that was down or cut off during a delete learns of it.

Every node logs each delete and purge it serves (kvstore/store/deletion.py). A node pulls the logs
of the peers it shares a placement group with: at start-up and every
``tombstone_sync_interval_s`` (30 s), over the same TLS as every channel, with its own
credential (a node principal's token from ``peer_token_file``, or its certificate under
mutual TLS)::

    for each peer:  ListTombstones(after_seq = cursor[peer])  ->  records, last_seq
                    apply the records (delete versions created at or before each)
                    cursor[peer] = the last record's seq (persisted in the index counters)
                    a last_seq below the cursor: the peer's log restarted, pull from 0

Besides the interval, a peer whose Health (asked every few seconds by the repair service's
probe) shows a newer delete-log record than this node pulled is pulled at once, so a delete or
an eviction (kvstore/store/eviction.py) reaches the whole group within seconds.

Logs are kept ``tombstone_retention_s`` (8 days, beyond the longest TTL), so a node that was
away longer than that holds only shards that have expired by then anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvstore.auth import TokenFile
from kvstore.config import ClusterConfig, NodeConfig
from kvstore.node.store_holder import StoreHolder
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.store.index_codec import Tombstone
from kvstore.store.shard_store import ShardStore
from kvstore.tls import aio_channel, node_channel_credentials

log = logging.getLogger(__name__)

MAX_TOMBSTONES_PER_REPLY = 4096
PULL_TIMEOUT_S = 10.0
UNSYNCED_RETRY_S = 0.5  # how soon a store whose pull failed is pulled again


def group_peers(cluster: ClusterConfig, node_id: str) -> list[NodeConfig]:
    """The nodes that share a placement group with ``node_id`` (it excluded)."""
    peer_ids = {n for group in cluster.groups if node_id in group for n in group} - {node_id}
    return [n for n in cluster.nodes if n.id in peer_ids]


def cursor_name(peer_id: str) -> str:
    return f"peer/{peer_id}/tombstone_seq"


class TombstoneSync:
    """Pulls and applies the delete logs of one node's peers.

    ``store`` gives the node's current store (None while it is opened or its index rebuilt:
    nothing is pulled then). :attr:`synced` is true once a full pull (every peer answered or
    was found down) reached the current store: the node takes repair writes only then
    (kvstore/node/servicer.py), so a repair cannot bring back a block deleted while it was
    away, nor after its index was rebuilt (which loses the cursors: the next pull starts
    from 0).
    """

    def __init__(
        self,
        cluster: ClusterConfig,
        node: NodeConfig,
        store: Callable[[], ShardStore | None],
        executor: ThreadPoolExecutor,
    ) -> None:
        self._current_store = store
        self._synced_store: ShardStore | None = None
        self._executor = executor
        self._token = TokenFile(node.peer_token_file)
        self._node_id = node.id
        self._credentials = node_channel_credentials(cluster, node)
        self._peers: list[NodeConfig] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._addresses: dict[str, str] = {}
        self._retired: list[grpc.aio.Channel] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._prompt_pulls: dict[str, asyncio.Future[int]] = {}
        self.set_cluster(cluster)

    def set_cluster(self, cluster: ClusterConfig) -> None:
        """Pull from the group-mates of a newer map epoch too (etcd membership), those of the
        groups before a move in progress included; channels of peers kept or re-made."""
        moving = dataclasses.replace(cluster, groups=cluster.moving_from or cluster.groups)
        by_id = {
            p.id: p
            for p in [*group_peers(cluster, self._node_id), *group_peers(moving, self._node_id)]
        }
        self._peers = list(by_id.values())
        for peer in self._peers:
            if self._addresses.get(peer.id) != peer.address:
                if peer.id in self._channels:
                    self._retired.append(self._channels[peer.id])
                self._channels[peer.id] = aio_channel(
                    peer.address, self._credentials, node_id=peer.id
                )
                self._addresses[peer.id] = peer.address

    async def pull_all(self) -> int:
        """One pull from every peer; return the number of shards deleted here."""
        store = self._current_store()
        if store is None:
            return 0
        # All peers at once: a hung peer costs one PULL_TIMEOUT_S, not one per peer after it.
        pulled = await asyncio.gather(*(self._pull_quietly(p.id) for p in self._peers))
        self._synced_store = store
        return sum(pulled)

    async def _pull_quietly(self, peer_id: str) -> int:
        try:
            return await self.pull(peer_id)
        except grpc.aio.AioRpcError as exc:
            log.debug("delete log of %s not pulled: %s", peer_id, exc.code().name)
            return 0

    @property
    def has_store(self) -> bool:
        return self._current_store() is not None

    @property
    def synced(self) -> bool:
        """Whether the current store has had a full pull of the peers' logs."""
        store = self._current_store()
        return store is not None and store is self._synced_store

    def note_peer_seqs(self, peer_to_seq: Mapping[str, int]) -> None:
        """Peers' newest delete-log sequence numbers (their Health, seen by the repair probe):
        pull at once from each that logged more than this node has pulled, so a delete or an
        eviction reaches the group in seconds rather than at the next interval."""
        store = self._current_store()
        if store is None:
            return
        for peer_id, seq in peer_to_seq.items():
            behind = seq > int(store.counter(cursor_name(peer_id)) or 0)
            if behind and peer_id in self._channels and peer_id not in self._prompt_pulls:
                task = asyncio.ensure_future(self._pull_quietly(peer_id))
                self._prompt_pulls[peer_id] = task
                task.add_done_callback(lambda _, p=peer_id: self._prompt_pulls.pop(p, None))

    async def pull(self, peer_id: str) -> int:
        """Pull and apply one peer's log from this node's cursor (one pull per peer at once)."""
        async with self._locks.setdefault(peer_id, asyncio.Lock()):
            return await self._pull_locked(peer_id)

    async def _pull_locked(self, peer_id: str) -> int:
        loop = asyncio.get_running_loop()
        store = self._current_store()
        if store is None:
            return 0
        stub = ShardStoreStub(self._channels[peer_id])
        cursor = int(store.counter(cursor_name(peer_id)) or 0)
        num_deleted = 0
        while True:
            reply = await stub.ListTombstones(
                pb.ListTombstonesRequest(after_seq=cursor, limit=MAX_TOMBSTONES_PER_REPLY),
                timeout=PULL_TIMEOUT_S,
                metadata=self._token.metadata(),
            )
            if reply.last_seq < cursor:  # the peer's log restarted (its data_dir was replaced)
                cursor = 0
                continue
            records = [Tombstone(t.seq, t.tenant, t.key, t.at_s) for t in reply.tombstones]
            if records:
                erased = await loop.run_in_executor(self._executor, store.apply_tombstones, records)
                num_deleted += erased.num_shards
                cursor = records[-1].seq
                await loop.run_in_executor(
                    self._executor, store.set_counter, cursor_name(peer_id), cursor
                )
            if len(records) < MAX_TOMBSTONES_PER_REPLY:
                return num_deleted

    async def close(self) -> None:
        for task in list(self._prompt_pulls.values()):
            task.cancel()
        await asyncio.gather(*self._prompt_pulls.values(), return_exceptions=True)
        channels = [*self._channels.values(), *self._retired]
        await asyncio.gather(*(c.close() for c in channels))


async def sync_forever(sync: TombstoneSync, interval_s: float, holder: StoreHolder) -> None:
    """Pull the peers' delete logs now and every ``interval_s``, and as soon as ``holder``
    has a new store that has had no pull yet (an index just rebuilt: repair waits for it);
    close the channels at the end.

    Built by the caller first, so a missing or unsafe ``peer_token_file`` stops the node at
    start-up instead of silently disabling the sync.
    """
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                if num_deleted := await sync.pull_all():
                    log.info("applied peers' deletes: %d shards removed", num_deleted)
            except Exception:
                log.exception("pulling peers' delete logs failed; retrying later")
            next_s = loop.time() + interval_s
            while loop.time() < next_s:
                if sync.has_store and not sync.synced:  # a pull failed: retry soon
                    await asyncio.sleep(UNSYNCED_RETRY_S)
                    break
                generation = holder.generation
                with contextlib.suppress(TimeoutError):  # woken by a new store, or the interval
                    await asyncio.wait_for(holder.changed_since(generation), next_s - loop.time())
    finally:
        await sync.close()
