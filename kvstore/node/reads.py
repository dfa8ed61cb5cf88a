"""The node's one read routine, whatever face a read came in by (gRPC, the local channel, UCX).

A read is: the caller's credential turned into the tenant it acts for (never the tenant the
request names: a request naming another tenant is PERMISSION_DENIED before the store is
touched), the keys counted, and the store's read, which decides from the index, before any byte
is read, whether the reply would pass ``max_batch_bytes`` (INVALID_ARGUMENT then: ask for fewer
keys per request; a key named twice in one request is read once). The faces differ only in
how a request arrives and how its answer leaves:

    gRPC        GetShards (protobuf replies, for tools and the repair service's single-shard
                reads) and ReadBatch (the batch answer, kvstore/wire/batch_answer.py, as a
                stream of chunks of at most 4 MiB): kvstore/node/servicer.py
    local       a Unix socket whose connection threads read straight into the client's own
                shared arena, no gRPC and no event loop on the path: kvstore/node/local_face.py
    UCX         one reply frame plus one message per payload that the client receives straight
                into its buffers (kvstore/wire/ucx_frames.py): kvstore/node/ucx_face.py

A batch read takes one index snapshot and one ``preadv`` per shard into a staging region of
the node's :class:`~kvstore.byte_arena.ByteArena` (or of the local client's arena).

One exception to "blocking work runs in the pool": a read of at most ``INLINE_GET_MAX_KEYS``
keys runs on the event loop. It is an lmdb read snapshot and a ``pread`` per shard (tens of
microseconds from the page cache), while the hop to the pool and back (a thread wake-up and the
loop's self-pipe) cost more CPU than the read itself and doubled a small get's latency. Larger
batches still go to the pool, so one request never holds the loop for long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvstore.auth import Authenticator, Principal, Role
from kvstore.byte_arena import ByteArena, Region
from kvstore.config import NodeConfig
from kvstore.node.metrics import NodeMetrics
from kvstore.node.store_holder import StoreHolder
from kvstore.store.shard_store import BatchRead, GetResult, Status
from kvstore.wire.landing import PoolLanding

# Reads of at most this many keys run on the event loop (see the module docstring): with
# 410 KiB shards that is under 2 MB of page-cache reads, a few hundred microseconds at most.
INLINE_GET_MAX_KEYS = 4

# What a read's caller proved: a gRPC call's principal (authenticated with the rest of the RPC,
# from its verified client certificate or bearer token), or the bearer token of a local or UCX
# read ("" for none).
Credential = Principal | str

T = TypeVar("T")


class NodeReads:
    """Reads of one node's store for its three faces (see the module docstring)."""

    def __init__(
        self,
        holder: StoreHolder,
        node: NodeConfig,
        metrics: NodeMetrics,
        auth: Authenticator,
        executor: ThreadPoolExecutor,
    ) -> None:
        self._holder = holder
        self._max_reply_bytes = node.max_batch_bytes
        self._metrics = metrics
        self._auth = auth
        self._executor = executor
        # Batch reads gather their payloads here (kvstore/byte_arena.py): twice the largest
        # answer, so two answers of that size can be in flight without a fallback buffer.
        self.staging = ByteArena(2 * node.max_batch_bytes)

    def tenant_of(self, credential: Credential, claimed: str) -> str:
        """The tenant a read acts for, derived from its credential.

        A gRPC principal may be a node's (a peer's repair service reads any tenant's shards,
        which it holds on its own disk anyway). A local or UCX read carries only a token (no
        TLS on those channels), checked on every request so a revoked token stops at once,
        and needs a tenant or service principal (or auth off).
        """
        if isinstance(credential, Principal):
            return credential.tenant_for_repair(claimed)
        return self._auth.authenticate(credential or None).tenant_for(claimed)

    def get(
        self, credential: Credential, claimed: str, keys: Sequence[bytes], version: bytes
    ) -> list[GetResult]:
        """One result per key (GetShards), the reply size checked before any byte is read."""
        tenant = self.tenant_of(credential, claimed)
        self._metrics.get_keys.inc(len(keys))
        results = self._holder.require().get(
            tenant, list(keys), version, max_reply_bytes=self._max_reply_bytes
        )
        if _for_a_client(credential):
            hits = [r for r in results if r.status is Status.HIT]
            num_bytes = sum(len(shard) for r in hits for shard in r.shards)
            self._metrics.observe_reads(tenant, len(keys), len(hits), num_bytes)
        return results

    def read_batch(
        self,
        credential: Credential,
        claimed: str,
        keys: list[bytes],
        version: bytes,
        take: Callable[[int], Region] | None = None,
        *,
        shared: bool = False,
        pool: PoolLanding | None = None,
    ) -> BatchRead:
        """A batch read, its payloads in a region from ``take`` (default: the node's staging;
        release the read once sent), the reply size checked before any byte is read.
        ``shared``: the region is a local client's memory; ``pool``: places in a local
        client's landing pool for data shards (kvstore/wire/landing.py)."""
        tenant = self.tenant_of(credential, claimed)
        self._metrics.get_keys.inc(len(keys))
        read = self._holder.require().read_batch(
            tenant,
            keys,
            version,
            take or self.staging.take,
            max_reply_bytes=self._max_reply_bytes,
            shared=shared,
            pool=pool,
        )
        if _for_a_client(credential):
            num_hits = sum(1 for e in read.entries if e.status == Status.HIT)
            self._metrics.observe_reads(tenant, len(keys), num_hits, read.payload_bytes)
        return read

    @staticmethod
    def runs_inline(num_keys: int) -> bool:
        """Whether a read of ``num_keys`` keys runs on the event loop (the module docstring)."""
        return num_keys <= INLINE_GET_MAX_KEYS

    async def run(self, num_keys: int, read: Callable[..., T], *args: object) -> T:
        """``read(*args)`` on the event loop for a few keys, else in the node's pool."""
        if self.runs_inline(num_keys):
            return read(*args)
        return await self.in_pool(read, *args)

    async def in_pool(self, read: Callable[..., T], *args: object) -> T:
        """``read(*args)`` in the node's pool, whatever its size."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, read, *args)


def _for_a_client(credential: Credential) -> bool:
    """Whether a read counts in the tenant's figures: a peer's repair read does not."""
    return not (isinstance(credential, Principal) and credential.role is Role.NODE)
