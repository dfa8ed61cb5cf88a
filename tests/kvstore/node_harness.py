"""Helpers for node tests: valid shards, a one-node cluster.toml, and a real node process."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from deploy.local_nodes import free_ports
from erasure.shard import ShardHeader, block_checksum, pack_header
from kvstore.config import (
    ClientConfig,
    ClusterConfig,
    CodecConfig,
    NodeConfig,
    TLSConfig,
    TTLConfig,
    save_cluster,
)
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.wire import batch_answer
from ttl.policy import TrafficClasses

REPO_ROOT = Path(__file__).resolve().parents[2]
DAY_S = 86_400.0


def free_port() -> int:
    (port,) = free_ports(1)
    return port


def make_shard(payload: bytes, index: int = 0) -> bytes:
    """A valid shard (header + payload) of a one-shard block whose bytes are ``payload``."""
    header = ShardHeader("zfec", 1, 0, index, len(payload), block_checksum(payload), len(payload))
    return pack_header(header, payload) + payload


def version_of(payload: bytes) -> bytes:
    return block_checksum(payload)


def write_config(
    directory: Path,
    *,
    classes: Mapping[str, float] | None = None,
    time_scale: float = 1.0,
    expiry_window_s: float = 3600.0,
    eviction_order: str = TTLConfig.eviction_order,
    refresh_granularity_s: float = TTLConfig.refresh_granularity_s,
    data_dir: Path | None = None,
    tls: TLSConfig | None = None,
    **node_fields: Any,
) -> Path:
    """A cluster.toml of one node ``n0`` (k=1, m=0) with free ports; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    node = NodeConfig(
        id="n0",
        address=f"127.0.0.1:{free_port()}",
        metrics_port=node_fields.pop("metrics_port", 0),
        failure_domain="d0",
        data_dir=str(data_dir or directory / "n0"),
        **node_fields,
    )
    ttl = TTLConfig(
        classes=TrafficClasses(dict(classes or {"chat": 7 * DAY_S, "agent": 3 * DAY_S})),
        time_scale=time_scale,
        origin_unix_s=time.time(),
        expiry_window_s=expiry_window_s,
        eviction_order=eviction_order,
        refresh_granularity_s=refresh_granularity_s,
    )
    cluster = ClusterConfig(
        epoch=1,
        nodes=(node,),
        groups=(("n0",),),
        codec=CodecConfig(k=1, m=0, backend="zfec"),
        client=ClientConfig(read_fanout=1, write_quorum=1),
        ttl=ttl,
        tls=tls or TLSConfig(),
    )
    path = directory / "cluster.toml"
    save_cluster(cluster, path)
    return path


class NodeProcess:
    """``python -m kvstore.cli node`` as a child process; ready once it prints its line."""

    def __init__(self, config_path: Path, node_id: str = "n0", extra_args: Sequence[str] = ()):
        self.config_path = config_path
        self.node_id = node_id
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = config_path.parent / f"{node_id}.stderr.log"

    def start(self, timeout_s: float = 300.0) -> NodeProcess:
        """Start the node and wait (up to ``timeout_s``: a bound for a loaded machine, not a
        speed) until it prints that it serves."""
        cmd = [sys.executable, "-m", "kvstore.cli", "node", "--config", str(self.config_path)]
        cmd += ["--id", self.node_id, "--log-level", "INFO", *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=0.1):
                    line = self.proc.stdout.readline().decode()
                    if "serving on" in line:
                        return
                if self.proc.poll() is not None:
                    break
        self.stop()
        raise RuntimeError(f"node did not become ready; its log:\n{self.log_path.read_text()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(Exception):
            self.proc.stdout.close()  # type: ignore[union-attr]
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, no clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class NodeClient:
    """A thin async wrapper over one node's stub, for one tenant."""

    address: str
    tenant: str = "acme"
    token: str = ""

    async def __aenter__(self) -> NodeClient:
        limit = 128 << 20
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ]
        self.channel = grpc.aio.insecure_channel(self.address, options=options)
        self.stub = pb_grpc.ShardStoreStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()

    def _metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    async def put(self, items: Iterable[tuple[bytes, bytes]], traffic_class: str = "chat") -> int:
        request = pb.PutShardsRequest(
            tenant=self.tenant,
            traffic_class=traffic_class,
            shards=[pb.ShardPut(key=k, shard=s) for k, s in items],
        )
        reply = await self.stub.PutShards(request, metadata=self._metadata(), timeout=30)
        return reply.num_stored

    async def get(self, keys: Sequence[bytes], version: bytes = b"") -> list[pb.ShardResult]:
        request = pb.GetShardsRequest(tenant=self.tenant, keys=keys, version=version)
        reply = await self.stub.GetShards(request, metadata=self._metadata(), timeout=30)
        return list(reply.results)

    async def read_batch(
        self, keys: Sequence[bytes], version: bytes = b""
    ) -> list[tuple[int, int, bytes]]:
        """ReadBatch, decoded: (key index, status, whole shard or b"") per table entry."""
        request = pb.GetShardsRequest(tenant=self.tenant, keys=keys, version=version)
        call = self.stub.ReadBatch(request, metadata=self._metadata(), timeout=30)
        data = b"".join([chunk.data async for chunk in call])
        size = batch_answer.table_bytes(data)
        entries, _ = batch_answer.decode_table(data[:size], len(keys))
        rows, position = [], size
        for row, entry in enumerate(entries):
            end = position + int(entry["payload_bytes"])
            header = entries.tobytes()[row * 64 + 16 : (row + 1) * 64]
            shard = header + data[position:end] if entry["status"] == batch_answer.HIT else b""
            rows.append((int(entry["key_index"]), int(entry["status"]), shard))
            position = end
        return rows

    async def contains(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        request = pb.ContainsRequest(tenant=self.tenant, keys=keys)
        reply = await self.stub.Contains(request, metadata=self._metadata(), timeout=30)
        return [list(r.versions) for r in reply.results]

    async def delete(self, keys: Sequence[bytes]) -> int:
        request = pb.DeleteRequest(tenant=self.tenant, keys=keys)
        reply = await self.stub.Delete(request, metadata=self._metadata(), timeout=30)
        return reply.num_deleted

    async def stats(self) -> pb.StatsReply:
        return await self.stub.Stats(pb.StatsRequest(), metadata=self._metadata(), timeout=30)

    async def now_s(self) -> float:
        reply = await self.stub.Health(pb.HealthRequest(), metadata=self._metadata(), timeout=30)
        return reply.now_s


def class_stats(stats: pb.StatsReply, traffic_class: str) -> pb.ClassStats:
    for cls in stats.classes:
        if cls.traffic_class == traffic_class:
            return cls
    raise AssertionError(f"no stats for class {traffic_class!r}: {stats}")
