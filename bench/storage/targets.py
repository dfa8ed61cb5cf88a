"""The systems ``kvstore bench storage`` measures: the target protocol, and kvstore through
one client (plain, sealed, or a secured second cluster)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from bench.common import bench_node_overrides
from client import KVClient
from client.buffer_pool import BufferSlot
from client.keyring import new_master_key
from client.landing_pool import LandingPool
from deploy.local_cluster import LocalCluster
from deploy.local_secrets import local_client_cert
from kvstore.config import EncryptionConfig, load_cluster
from kvstore.errors import InvalidArgument

SEALED_TENANT = "bench-sealed"
POOL_SUFFIX = "+pool"  # a transport read into a landing pool's slots (kvstore_target)


class BaselineError(Exception):
    """A baseline's request failed (it counts as failed, as kvstore's errors do)."""


class Target(Protocol):
    """One system under test: put and get batches (one key: single-key calls), clean up."""

    name: str
    fsync: str  # Result.fsync
    ops: tuple[str, ...]  # the operations it is measured on

    async def put(self, keys: list[bytes], blocks: list[bytes]) -> None: ...

    async def get_into(self, keys: list[bytes], outs: list[memoryview]) -> bool: ...

    def buffers(self, count: int, block_bytes: int) -> list[memoryview]:
        """``count`` buffers of ``block_bytes`` that GETs land in (the same ones every round)."""
        ...

    def server_pids(self) -> list[int]: ...

    def transport_counts(self, op: str) -> dict[str, int]:
        """Requests so far per transport that carried ``op`` (monotonic counts)."""
        ...

    async def close(self) -> None: ...


class KVStoreTarget:
    """kvstore through one client; the first transport benched is "kvstore", others
    "kvstore/<transport>" (the ratios compare "kvstore")."""

    def __init__(
        self,
        client: KVClient,
        transport: str,
        name: str = "kvstore",
        cluster: LocalCluster | None = None,
        fsync: str = "",
        pool: LandingPool | None = None,
    ) -> None:
        self.client = client
        self.transport = transport
        self.name = name
        self.cluster = cluster
        self.fsync = fsync
        self.ops = ("put", "get")
        self.pool = pool  # GETs land in its slots (the nodes write them in place), or None
        self._slots: list[BufferSlot] = []

    async def put(self, keys: list[bytes], blocks: list[bytes]) -> None:
        if len(keys) == 1:
            await self.client.put(keys[0], blocks[0], traffic_class="chat")
        else:
            await self.client.put_batch(keys, blocks, traffic_class="chat")

    async def get_into(self, keys: list[bytes], outs: list[memoryview]) -> bool:
        if len(keys) == 1:
            return await self.client.get_into(keys[0], outs[0])
        return all(await self.client.get_batch_into(keys, outs))

    def buffers(self, count: int, block_bytes: int) -> list[memoryview]:
        """Caller memory (bytearrays), or slots of the landing pool: reused across settings."""
        if self.pool is None:
            return [memoryview(bytearray(block_bytes)) for _ in range(count)]
        while len(self._slots) < count:
            slot = self.pool.try_acquire()
            if slot is None:
                raise InvalidArgument(f"the landing pool has no room for {count} buffers")
            self._slots.append(slot)
        return [slot.view[:block_bytes] for slot in self._slots[:count]]

    def server_pids(self) -> list[int]:
        if self.cluster is None:
            return []
        return [proc.pid for proc in self.cluster.procs.values()]

    def transport_counts(self, op: str) -> dict[str, int]:
        """PUTs: PutShards requests; GETs: replies over the local channel or UCX, and the
        requests that fell back from them to gRPC (a gRPC client: all its node requests;
        requests cancelled unanswered, hedges, count for no transport on local and UCX)."""
        client = self.client
        if op == "put":
            return {"grpc": client.write_counters.num_put_requests}
        counts = {"grpc": 0}
        replies = client.replies_by_transport()
        for name, path in (("local", client.local), ("stream", client.stream), ("ucx", client.ucx)):
            if path is not None:
                counts[name] = replies[name]
                counts["grpc"] += path.counters.num_fallbacks
        if len(counts) == 1:
            counts["grpc"] = client.read_counters.num_node_requests
        return counts

    async def close(self) -> None:
        await self.client.close()
        for slot in self._slots:
            slot.release()
        if self.pool is not None:
            self.pool.close()


async def kvstore_target(
    cluster_toml: Path,
    transport: str,
    position: int,
    cluster: LocalCluster | None,
    fsync: str,
    pool_shape: tuple[int, int] = (0, 0),
) -> KVStoreTarget:
    """A client forced onto ``transport`` (Unavailable if UCX cannot work here). A transport
    ending in ``+pool`` (``local+pool``) reads into slots of a landing pool of ``pool_shape``
    (block bytes, slots): the nodes on this host write the shards in place, as for an engine."""
    read_transport = transport.removesuffix(POOL_SUFFIX)
    pool = LandingPool(*pool_shape) if read_transport != transport else None
    client = await KVClient.connect(
        cluster_toml, tenant="bench", transport=read_transport, landing_pool=pool
    )
    name = "kvstore" if position == 0 else f"kvstore/{transport}"
    return KVStoreTarget(client, transport, name, cluster, fsync, pool)


def nodes_fsync(cluster_toml: Path) -> str:
    """Whether the cluster's nodes fsync: "on", "off" or "mixed" (from its cluster.toml)."""
    states = {node.fsync for node in load_cluster(cluster_toml).nodes}
    return "mixed" if len(states) > 1 else ("on" if states.pop() else "off")


async def sealed_target(
    cluster_toml: Path, keys_dir: Path, cluster: LocalCluster | None
) -> KVStoreTarget:
    """A client of a tenant whose blocks are sealed, keys under ``keys_dir``."""
    config = await asyncio.to_thread(load_cluster, cluster_toml)
    master = new_master_key(keys_dir / "master.key")
    encryption = EncryptionConfig((SEALED_TENANT,), str(keys_dir / "keyring.json"), str(master))
    client = await KVClient.connect(replace(config, encryption=encryption), tenant=SEALED_TENANT)
    return KVStoreTarget(client, "grpc", "kvstore/sealed", cluster)


async def secure_target(stack: contextlib.ExitStack, args: argparse.Namespace) -> KVStoreTarget:
    """A tenant's client of a second local cluster with tokens and mutual TLS (stopped by
    ``stack``), its nodes set up as the plain cluster's."""
    if args.cluster is not None:
        raise InvalidArgument(
            "--secure starts a secured cluster of its own beside the local one; drop --cluster "
            "(to bench a secured cluster of yours, point --cluster at it and set KVSTORE_TOKEN "
            "and KVSTORE_TLS_CERT/KVSTORE_TLS_KEY)"
        )
    root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-bench-tls-")))
    overrides = bench_node_overrides(args)
    cluster = stack.enter_context(
        LocalCluster.start(
            root, num_nodes=args.nodes, backend=args.backend, auth=True, mtls=True, **overrides
        )
    )
    token = cluster.add_tenant("bench")
    cert, key = local_client_cert(root, cluster.config)
    client = await KVClient.connect(
        cluster.cluster_toml, tenant="bench", token=token, tls_cert_file=cert, tls_key_file=key
    )
    await client.wait_until_accepted()
    return KVStoreTarget(client, "grpc", "kvstore/secure", cluster)


def ucx_note(target: KVStoreTarget) -> str:
    ucx = target.client.ucx
    return f"{target.name} ({target.transport}) UCX counters: {ucx.counters if ucx else None}"
