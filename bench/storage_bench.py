"""``kvstore bench storage``: cluster PUT/GET throughput and latency, with a straggler, vs Redis.

::

    kvstore bench storage [--cluster DIR/cluster.toml] --json PATH
        [--block-sizes 256KiB,1MiB,4MiB] [--concurrency 1,8,32] [--batch 1,8] [--seconds S]
        [--straggler-ms 50] [--baseline redis] [--no-fsync] [--transport grpc,ucx,local]
        [--encryption] [--secure] [--puts-only] [--idle-seconds 60]

One client process runs N (``--concurrency``) asyncio tasks per setting, each issuing one call
after another for ``--seconds``; ``--batch B`` makes each call carry B keys (``put_batch`` /
``get_batch_into``; B = 1 is the single-key ``put`` / ``get_into``; Redis gets MSET / MGET), so
N x B blocks are in flight. Systems run interleaved in ``--rounds`` (A B, B A, ...). Order:
PUTs (fresh keys) for every setting; then per GET setting: GETs of random written keys, the
same GETs on kvstore with one node restarted with ``--inject-delay-ms``, and again after
restarting it without the delay (the straggler runs only when the bench started the cluster
itself, and not with ``--straggler-ms 0``; ``--puts-only`` stops after the PUTs). Each
measurement starts with an unmeasured warm-up (a quarter of its first round), so the client has
learned which node is slow, as it would have in steady state. GETs land in preallocated
buffers, B per task (the swap-in path). MB/s counts 10**6 bytes of block data per second. Every
record gives the CPU seconds per GB of the client process, of the servers (the nodes together,
or redis-server) and of both (``total_cpu_s_per_gb``), which hold up where other work shares
the cores, and its ``fsync`` state (kvstore's nodes "on"/"off", Redis "off"/"always");
``settings.servers_idle_cpu_cores`` is what the nodes burn with no requests (part of every
record's server CPU: ``server_idle_cpu_s_per_gb`` is that part at the record's MB/s), and
``idle_nodes`` what they burn together over ``--idle-seconds`` (default 60) after the
workload, with the data held. Every record also says which transport carried it
(``transport_used``: for GETs the read transports that answered, most used first, so a
fallback shows) and its CPU per GB by side (``cpu_s_per_gb_by_side``). The
client process tunes glibc's malloc for multi-megabyte buffers first (``--malloc tuned``, see
erasure/allocator.py). With ``--baseline redis`` the same workload runs through redis-py
asyncio against a ``redis-server`` this bench starts with persistence off ("redis"), and, when
kvstore's nodes fsync, PUTs also against a second one with ``appendfsync always``
("redis/fsync"); the JSON records redis-py's reply parser (``settings.redis_parser``: hiredis
when it is installed). The report's ``best`` rows (and the "best of each" table) set each
side's best setting against the other's: per op, block size and kvstore read transport (PUTs:
over all of them), the MB/s ratio of the fastest settings and the CPU-per-GB ratio of the
cheapest, with the targets of issue 29 where the pair has one (PUTs against the Redis of the
same fsync state). With ``--encryption`` a second kvstore client whose tenant's blocks are
sealed (AES-256-GCM, client/sealer.py) runs the same workload interleaved with the plain one
(``kvstore/sealed``; ratio "sealed/plain MB/s"), and the report's ``seal_cost`` gives the
CPU-seconds per GB of sealing and opening alone, on one core. With ``--secure`` the bench also
starts a second local cluster with tokens and mutual TLS on every channel (``cluster up --auth
--mtls``) and runs the same workload on it, interleaved with the plain cluster
(``kvstore/secure``; ratio "secure/plain MB/s"): what authentication and TLS cost the data
plane.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash
from rich.table import Table

from bench.common import (
    NO_REDIS,
    bench_cluster,
    bench_node_overrides,
    percentile_ms,
    process_cpu_s,
    redis_binary,
    redis_server,
    run_load,
    transport_list,
)
from client import KVClient
from client.keyring import Keyring, MasterKeyFile, new_master_key
from client.sealer import BlockSealer
from deploy.local_cluster import LocalCluster
from deploy.local_secrets import local_client_cert
from erasure.allocator import tune_glibc_malloc
from kvstore.cli.args import list_arg, size_arg
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.tables import make_console, print_fitted
from kvstore.config import EncryptionConfig, load_cluster
from kvstore.errors import InvalidArgument, KVStoreError
from ttl.units import size_label

log = logging.getLogger(__name__)

STRAGGLER_NODE = "n00"
SEALED_TENANT = "bench-sealed"


@dataclass
class Result:
    system: str
    op: str
    block_bytes: int
    concurrency: int
    straggler_ms: float
    mb_per_s: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    num_ops: int
    seconds: float
    num_failed: int = 0  # GETs that missed, PUTs that raised (e.g. QuorumError)
    repeat: int = 0  # 1: the calm GETs measured again after the straggler phase
    load_avg_1m: float = 0.0  # the machine's 1-minute load average after the setting
    transport: str = ""  # kvstore's read transport ("grpc", "ucx" or "local"); "" for redis
    batch: int = 1  # keys per call (1: single-key calls)
    client_cpu_s_per_gb: float = 0.0  # the client process's CPU seconds per GB moved
    server_cpu_s_per_gb: float = 0.0  # the nodes' (or redis-server's) CPU seconds per GB
    total_cpu_s_per_gb: float = 0.0  # client + servers: what a GB costs the machine
    # The part of server_cpu_s_per_gb the nodes burn anyway, idle (settings'
    # servers_idle_cpu_cores at this record's MB/s): large where throughput is low.
    server_idle_cpu_s_per_gb: float = 0.0
    fsync: str = ""  # kvstore's nodes: "on" / "off"; redis: "off" or "always" (appendfsync)
    # What carried the setting's bytes: for kvstore GETs the read transports that answered its
    # node requests, most used first ("ucx", or "ucx+grpc" when some fell back); kvstore PUTs
    # "grpc" (PutShards); redis "resp/tcp".
    transport_used: str = ""
    # CPU seconds per GB by side: {"client": ..., "nodes": ...} (kvstore) or
    # {"client": ..., "redis-server": ...}; the same figures as client_/server_cpu_s_per_gb.
    cpu_s_per_gb_by_side: dict[str, float] = field(default_factory=dict)


@dataclass
class Workload:
    block_sizes: list[int]
    concurrencies: list[int]
    seconds: float
    straggler_ms: float
    rounds: int = 2
    batches: list[int] = field(default_factory=lambda: [1])
    rng: random.Random = field(default_factory=lambda: random.Random(0))


Setting = tuple[int, int, int]  # block bytes, concurrency, batch


class BaselineError(Exception):
    """A baseline's request failed (it counts as failed, as kvstore's errors do)."""


class Target(Protocol):
    """One system under test: put and get batches (one key: single-key calls), clean up."""

    name: str
    fsync: str  # Result.fsync
    ops: tuple[str, ...]  # the operations it is measured on

    async def put(self, keys: list[bytes], blocks: list[bytes]) -> None: ...

    async def get_into(self, keys: list[bytes], outs: list[bytearray]) -> bool: ...

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
    ) -> None:
        self.client = client
        self.transport = transport
        self.name = name
        self.cluster = cluster
        self.fsync = fsync
        self.ops = ("put", "get")

    async def put(self, keys: list[bytes], blocks: list[bytes]) -> None:
        if len(keys) == 1:
            await self.client.put(keys[0], blocks[0], traffic_class="chat")
        else:
            await self.client.put_batch(keys, blocks, traffic_class="chat")

    async def get_into(self, keys: list[bytes], outs: list[bytearray]) -> bool:
        if len(keys) == 1:
            return await self.client.get_into(keys[0], outs[0])
        return all(await self.client.get_batch_into(keys, outs))

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
        for name, path in (("local", client.local), ("ucx", client.ucx)):
            if path is not None:
                replies = getattr(path.counters, f"num_{name}_replies")
                counts[name] = replies
                counts["grpc"] += path.counters.num_fallbacks
        if len(counts) == 1:
            counts["grpc"] = client.read_counters.num_node_requests
        return counts

    async def close(self) -> None:
        await self.client.close()


class RedisTarget:
    """redis-py asyncio against a redis-server: "redis" (persistence off), or "redis/fsync"
    (``appendfsync always``, measured on PUTs only: reads do not touch the file)."""

    def __init__(self, port: int, pid: int, *, appendfsync_always: bool = False) -> None:
        import redis.asyncio

        self.redis = redis.asyncio.Redis(host="127.0.0.1", port=port, max_connections=256)
        self._pid = pid
        self.name = "redis/fsync" if appendfsync_always else "redis"
        self.fsync = "always" if appendfsync_always else "off"
        self.ops = ("put",) if appendfsync_always else ("put", "get")
        self._num_calls = 0

    async def put(self, keys: list[bytes], blocks: list[bytes]) -> None:
        """SET or MSET; a Redis error (a timeout on a loaded machine) is a failed PUT, as
        kvstore's errors are."""
        from redis.exceptions import RedisError

        self._num_calls += 1
        try:
            if len(keys) == 1:
                await self.redis.set(keys[0], blocks[0])
            else:
                await self.redis.mset(dict(zip(keys, blocks, strict=True)))
        except RedisError as exc:
            raise BaselineError(f"{self.name}: {exc}") from exc

    async def get_into(self, keys: list[bytes], outs: list[bytearray]) -> bool:
        """GET or MGET: True if every key was found; a Redis error counts as a failed GET."""
        from redis.exceptions import RedisError

        self._num_calls += 1
        try:
            if len(keys) == 1:
                return await self.redis.get(keys[0]) is not None
            return all(value is not None for value in await self.redis.mget(keys))
        except RedisError as exc:
            log.warning("%s get failed: %s", self.name, exc)
            return False

    def server_pids(self) -> list[int]:
        return [self._pid]

    def transport_counts(self, op: str) -> dict[str, int]:
        return {"resp/tcp": self._num_calls}

    async def close(self) -> None:
        await self.redis.aclose()  # the server, this run's own, is stopped with its data


class SystemUnderTest:
    """A target with the keys written to it so far, per block size."""

    def __init__(self, target: Target, rng: random.Random) -> None:
        self.target = target
        self.rng = rng
        self.size_to_keys: dict[int, list[bytes]] = {}
        self._key_numbers = itertools.count()

    def request(self, op: str, setting: Setting) -> Callable[[int], Awaitable[bool]]:
        """What one task sends: a PUT of ``batch`` fresh keys, or a GET of ``batch`` random
        written keys; True if every key was stored or landed."""
        block_bytes, concurrency, batch = setting
        keys = self.size_to_keys.setdefault(block_bytes, [])
        if op == "put":
            blocks = [np.random.default_rng(block_bytes + i).bytes(block_bytes) for i in range(4)]

            async def put(index: int) -> bool:
                numbers = [next(self._key_numbers) for _ in range(batch)]
                fresh = [
                    xxhash.xxh3_128_digest(f"{self.target.name}/{block_bytes}/{n}".encode())
                    for n in numbers
                ]
                try:
                    await self.target.put(fresh, [blocks[n % len(blocks)] for n in numbers])
                except (KVStoreError, BaselineError) as exc:
                    log.warning("%s put failed: %s", self.target.name, exc)
                    return False
                keys.extend(fresh)
                return True

            return put
        buffers = [[bytearray(block_bytes) for _ in range(batch)] for _ in range(concurrency)]

        async def get(index: int) -> bool:
            wanted = [self.rng.choice(keys) for _ in range(batch)]
            return await self.target.get_into(wanted, buffers[index])

        return get


class Bench:
    """Measures settings; systems of one setting run in interleaved rounds (A B, B A, ...)."""

    def __init__(self, workload: Workload, progress: ProgressReporter) -> None:
        self.workload = workload
        self.progress = progress
        self.results: list[Result] = []

    def settings(self) -> list[Setting]:
        """(block_bytes, concurrency, batch) in the order they run."""
        workload = self.workload
        return [
            (b, c, n)
            for b in workload.block_sizes
            for n in workload.batches
            for c in workload.concurrencies
        ]

    async def measure(
        self,
        op: str,
        setting: Setting,
        systems: list[SystemUnderTest],
        straggler_ms: float = 0.0,
        repeat: int = 0,
    ) -> None:
        """One setting of ``op`` on ``systems``, with progress."""
        block_bytes, concurrency, batch = setting
        label = f"{op} {size_label(block_bytes)} x{concurrency} batch {batch}"
        if straggler_ms:
            label += f" (+{straggler_ms:g} ms straggler)"
        self.progress.update(description=label)
        await self._measure(op, setting, systems, straggler_ms, repeat)
        self.progress.advance()

    async def _measure(
        self,
        op: str,
        setting: Setting,
        systems: list[SystemUnderTest],
        straggler_ms: float,
        repeat: int,
    ) -> None:
        systems = [s for s in systems if op in s.target.ops]
        rounds = self.workload.rounds
        round_s = self.workload.seconds / rounds
        name_to_samples = {s.target.name: _Samples() for s in systems}
        for round_index in range(rounds):
            for system in systems if round_index % 2 == 0 else systems[::-1]:
                request = system.request(op, setting)
                if round_index == 0:
                    await run_load(request, setting[1], round_s / 4)  # warm-up
                pids = system.target.server_pids()
                counts_before = system.target.transport_counts(op)
                cpu_before = time.process_time(), sum(process_cpu_s(p) for p in pids)
                latencies_s, num_false, elapsed_s = await run_load(request, setting[1], round_s)
                samples = name_to_samples[system.target.name]
                samples.add(latencies_s, num_false, elapsed_s)
                samples.client_cpu_s += time.process_time() - cpu_before[0]
                samples.server_cpu_s += sum(process_cpu_s(p) for p in pids) - cpu_before[1]
                samples.count_transports(counts_before, system.target.transport_counts(op))
        for system in systems:
            name = system.target.name
            transport = getattr(system.target, "transport", "")
            result = name_to_samples[name].result(
                name, op, setting, straggler_ms, repeat, transport
            )
            server_side = "nodes" if isinstance(system.target, KVStoreTarget) else "redis-server"
            by_side = {
                "client": result.client_cpu_s_per_gb,
                server_side: result.server_cpu_s_per_gb,
            }
            self.results.append(
                replace(result, fsync=system.target.fsync, cpu_s_per_gb_by_side=by_side)
            )


@dataclass
class _Samples:
    """What the rounds of one system in one setting measured."""

    latencies_s: list[float] = field(default_factory=list)
    num_false: int = 0
    elapsed_s: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    transport_to_count: dict[str, int] = field(default_factory=dict)

    def add(self, latencies_s: list[float], num_false: int, elapsed_s: float) -> None:
        self.latencies_s += latencies_s
        self.num_false += num_false
        self.elapsed_s += elapsed_s

    def count_transports(self, before: dict[str, int], after: dict[str, int]) -> None:
        for transport, count in after.items():
            grown = count - before.get(transport, 0)
            self.transport_to_count[transport] = self.transport_to_count.get(transport, 0) + grown

    def transport_used(self) -> str:
        """The transports that carried requests, most used first ("ucx+grpc")."""
        used = sorted((n, t) for t, n in self.transport_to_count.items() if n > 0)
        return "+".join(t for _, t in reversed(used))

    def result(
        self, name: str, op: str, setting: Setting, straggler_ms: float, repeat: int, transport: str
    ) -> Result:
        block_bytes, concurrency, batch = setting
        moved_bytes = (len(self.latencies_s) - self.num_false) * batch * block_bytes
        gb = max(moved_bytes / 1e9, 1e-12)
        return Result(
            system=name,
            op=op,
            block_bytes=block_bytes,
            concurrency=concurrency,
            straggler_ms=straggler_ms,
            mb_per_s=moved_bytes / self.elapsed_s / 1e6 if self.elapsed_s else 0.0,
            p50_ms=percentile_ms(self.latencies_s, 50),
            p99_ms=percentile_ms(self.latencies_s, 99),
            p999_ms=percentile_ms(self.latencies_s, 99.9),
            num_ops=len(self.latencies_s),
            seconds=self.elapsed_s,
            num_failed=self.num_false,
            repeat=repeat,
            load_avg_1m=os.getloadavg()[0],
            transport=transport,
            batch=batch,
            client_cpu_s_per_gb=round(self.client_cpu_s / gb, 3),
            server_cpu_s_per_gb=round(self.server_cpu_s / gb, 3),
            total_cpu_s_per_gb=round((self.client_cpu_s + self.server_cpu_s) / gb, 3),
            transport_used=self.transport_used(),
        )


def results_table(results: list[Result]) -> Table:
    table = Table(title="storage benchmark")
    columns = ("system", "op", "fsync", "block", "conc", "batch", "straggler", "MB/s", "p50 ms")
    columns += ("p99 ms", "p999 ms", "ops", "failed", "client s/GB", "server s/GB", "idle s/GB")
    columns += ("total s/GB",)
    for column in (*columns, "load"):
        table.add_column(column, justify="left" if column in ("system", "op") else "right")
    for r in results:
        table.add_row(
            r.system,
            r.op,
            r.fsync,
            size_label(r.block_bytes),
            str(r.concurrency),
            str(r.batch),
            f"{r.straggler_ms:g} ms" if r.straggler_ms else ("- (again)" if r.repeat else "-"),
            f"{r.mb_per_s:,.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.p999_ms:.2f}",
            str(r.num_ops),
            str(r.num_failed),
            f"{r.client_cpu_s_per_gb:.2f}",
            f"{r.server_cpu_s_per_gb:.2f}",
            f"{r.server_idle_cpu_s_per_gb:.2f}",
            f"{r.total_cpu_s_per_gb:.2f}",
            f"{r.load_avg_1m:.1f}",
        )
    return table


def ratios(results: list[Result]) -> list[dict[str, Any]]:
    """kvstore/redis (and kvstore/redis/fsync) MB/s per setting and kvstore transport;
    straggler p99 / calm p99 per GET setting (the first transport's).

    The calm p99 is the mean of the calm runs before and after the straggler phase, so a
    drift in machine load between phases does not pass for a straggler effect.
    """
    setting_to_calm: dict[tuple, list[Result]] = {}
    for r in results:
        if not r.straggler_ms:
            key = (r.system, r.op, r.block_bytes, r.concurrency, r.batch)
            setting_to_calm.setdefault(key, []).append(r)
    rows = []
    for ours in results:
        if not ours.system.startswith("kvstore") or ours.repeat:
            continue
        setting = (ours.op, ours.block_bytes, ours.concurrency, ours.batch)
        if ours.straggler_ms:
            calm = setting_to_calm.get((ours.system, *setting), [])
            calm_p99_ms = sum(c.p99_ms for c in calm) / len(calm) if calm else 0.0
            if calm_p99_ms:
                rows.append(_ratio_row("straggler/calm p99", ours, ours.p99_ms / calm_p99_ms))
            continue
        for baseline in ("redis", "redis/fsync"):
            runs = setting_to_calm.get((baseline, *setting))
            if runs and runs[0].mb_per_s:
                ratio = ours.mb_per_s / runs[0].mb_per_s
                rows.append(_ratio_row(f"{ours.system}/{baseline} MB/s", ours, ratio))
        for variant in ("sealed", "secure"):
            runs = setting_to_calm.get((f"kvstore/{variant}", *setting))
            if ours.system == "kvstore" and runs and ours.mb_per_s:
                ratio = runs[0].mb_per_s / ours.mb_per_s
                rows.append(_ratio_row(f"{variant}/plain MB/s", ours, ratio))
    return rows


def _ratio_row(kind: str, result: Result, ratio: float) -> dict[str, Any]:
    return {
        "kind": kind,
        "op": result.op,
        "block_bytes": result.block_bytes,
        "concurrency": result.concurrency,
        "batch": result.batch,
        "transport": result.transport,
        "ratio": ratio,
    }


def ratios_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="ratios per setting (straggler/calm p99: target <= 1.1)")
    for column in ("ratio", "op", "block", "conc", "batch", "value"):
        table.add_column(column, justify="left" if column in ("ratio", "op") else "right")
    for row in rows:
        table.add_row(
            row["kind"],
            row["op"],
            size_label(row["block_bytes"]),
            str(row["concurrency"]),
            str(row["batch"]),
            f"{row['ratio']:.2f}",
        )
    return table


# Issue 29's targets, best setting of each side: kvstore/baseline MB/s at least this much
# (GET per read transport), and total CPU-seconds per GB at most this multiple of the baseline's.
GET_MB_TARGETS = {"grpc": 1.0, "ucx": 2.0, "local": 1.5}
PUT_MB_TARGET = 1.0
IDLE_NODES_TARGET_CORES = 0.05  # twelve idle nodes together (issue 37)
CPU_TARGETS = {"get": 2.0, "put": 3.0}


def best_of_each(results: list[Result]) -> list[dict[str, Any]]:
    """Per op and block size, kvstore's best setting against each Redis baseline's best: the
    MB/s ratio of the fastest settings and the CPU-per-GB ratio of the cheapest (each side
    picks its own, as a user tuning either system would).

    GETs compare each kvstore read transport; PUTs (the same write path whatever the read
    transport) kvstore's best over all of them. Only calm runs count (no straggler, not the
    repeat). The ``target`` fields hold the issue's targets where this pair has one: PUTs
    are held to the baseline whose fsync matches kvstore's (``appendfsync always`` when the
    nodes fsync), GETs to Redis without persistence.
    """
    calm = [r for r in results if not r.straggler_ms and not r.repeat and r.mb_per_s > 0]
    ours = [r for r in calm if r.system == "kvstore" or r.system == f"kvstore/{r.transport}"]
    baselines = [r for r in calm if r.system.startswith("redis")]
    rows = []
    for op, block_bytes in sorted({(r.op, r.block_bytes) for r in ours}):
        mine = [r for r in ours if (r.op, r.block_bytes) == (op, block_bytes)]
        groups = {"any": mine} if op == "put" else _by_transport(mine)
        for baseline in sorted({r.system for r in baselines}):
            theirs = [
                r
                for r in baselines
                if (r.system, r.op, r.block_bytes) == (baseline, op, block_bytes)
            ]
            if not theirs:
                continue
            for transport, group in groups.items():
                rows.append(_best_row(op, block_bytes, transport, group, theirs))
    return rows


def _by_transport(results: list[Result]) -> dict[str, list[Result]]:
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.transport, []).append(r)
    return groups


def _best_row(
    op: str, block_bytes: int, transport: str, ours: list[Result], theirs: list[Result]
) -> dict[str, Any]:
    fast, cheap = _fastest(ours), _cheapest(ours)
    base_fast, base_cheap = _fastest(theirs), _cheapest(theirs)
    mb_target: float | None = None
    if op == "get" and base_fast.fsync == "off":
        mb_target = GET_MB_TARGETS.get(transport)
    if op == "put" and (base_fast.fsync == "always") == (fast.fsync == "on"):
        mb_target = PUT_MB_TARGET
    return {
        "op": op,
        "block_bytes": block_bytes,
        "transport": transport,
        "fsync": fast.fsync,
        "baseline": base_fast.system,
        "baseline_fsync": base_fast.fsync,
        "mb_per_s": fast.mb_per_s,
        "setting": _setting(fast),
        "baseline_mb_per_s": base_fast.mb_per_s,
        "baseline_setting": _setting(base_fast),
        "mb_ratio": fast.mb_per_s / base_fast.mb_per_s,
        "mb_target": mb_target,
        "total_cpu_s_per_gb": cheap.total_cpu_s_per_gb,
        "cpu_setting": _setting(cheap),
        "baseline_total_cpu_s_per_gb": base_cheap.total_cpu_s_per_gb,
        "baseline_cpu_setting": _setting(base_cheap),
        "cpu_ratio": cheap.total_cpu_s_per_gb / max(base_cheap.total_cpu_s_per_gb, 1e-9),
        "cpu_target": CPU_TARGETS[op] if mb_target is not None else None,
    }


def _fastest(results: list[Result]) -> Result:
    return max(results, key=lambda r: r.mb_per_s)


def _cheapest(results: list[Result]) -> Result:
    return min(results, key=lambda r: r.total_cpu_s_per_gb)


def _setting(r: Result) -> str:
    return f"{r.system} x{r.concurrency} batch {r.batch}"


def best_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        title="best of each (kvstore's best setting / the baseline's best; CPU = client + "
        "servers, CPU-seconds per GB)"
    )
    columns = ("op", "block", "kvstore", "fsync", "vs", "MB/s", "base MB/s", "ratio", "target")
    for column in (*columns, "CPU s/GB", "base CPU s/GB", "CPU ratio", "CPU target"):
        table.add_column(column, justify="left" if column in ("op", "kvstore", "vs") else "right")
    for row in rows:
        table.add_row(
            row["op"],
            size_label(row["block_bytes"]),
            row["transport"],
            row["fsync"],
            f"{row['baseline']} ({row['baseline_fsync']})",
            f"{row['mb_per_s']:,.0f}",
            f"{row['baseline_mb_per_s']:,.0f}",
            f"{row['mb_ratio']:.2f}",
            _target(row["mb_target"], ">="),
            f"{row['total_cpu_s_per_gb']:.2f}",
            f"{row['baseline_total_cpu_s_per_gb']:.2f}",
            f"{row['cpu_ratio']:.2f}",
            _target(row["cpu_target"], "<="),
        )
    return table


def _target(value: float | None, relation: str) -> str:
    return "" if value is None else f"{relation} {value:g}"


def _restart(cluster: LocalCluster, delay_ms: float) -> None:
    extra = ["--inject-delay-ms", f"{delay_ms:g}"] if delay_ms else []
    cluster.restart_node(STRAGGLER_NODE, extra)


async def run_phases(
    bench: Bench,
    systems: list[SystemUnderTest],
    cluster: LocalCluster | None,
    puts_only: bool = False,
) -> list[str]:
    """PUTs on every system; then per GET setting (unless ``puts_only``): calm, straggler,
    calm again (kvstore only; no straggler phase with ``straggler_ms`` 0).

    Restarting the straggler around each setting keeps the calm and straggler runs seconds
    apart, so load from other processes drifts less between the runs being compared.
    """
    for setting in bench.settings():
        await bench.measure("put", setting, systems)
    for setting in [] if puts_only else bench.settings():
        await bench.measure("get", setting, systems)
        straggler_ms = bench.workload.straggler_ms
        if cluster is None or not straggler_ms:
            continue
        await asyncio.to_thread(_restart, cluster, straggler_ms)
        await bench.measure("get", setting, systems[:1], straggler_ms=straggler_ms)
        await asyncio.to_thread(_restart, cluster, 0.0)
        await bench.measure("get", setting, systems[:1], repeat=1)
    if cluster is None and not puts_only:
        return ["straggler GETs skipped: --cluster given, so its nodes cannot be restarted"]
    return []


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload(
        args.block_sizes, args.concurrency, args.seconds, args.straggler_ms, args.rounds, args.batch
    )
    with_redis = args.baseline == "redis" and redis_binary() is not None
    notes = [] if with_redis or args.baseline == "none" else [NO_REDIS]
    num_settings = len(workload.block_sizes) * len(workload.concurrencies) * len(workload.batches)
    with bench_cluster(args) as (cluster_toml, cluster), contextlib.ExitStack() as stack:
        fsync = await asyncio.to_thread(_nodes_fsync, cluster_toml)
        systems = [
            SystemUnderTest(
                await _kvstore_target(cluster_toml, transport, i, cluster, fsync), workload.rng
            )
            for i, transport in enumerate(args.transport)
        ]
        idle_cpu_cores = await _idle_cpu_cores(systems[0].target)
        client = systems[0].target.client
        if args.encryption:
            keys_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kv-keys-")))
            sealed = await _sealed_target(cluster_toml, keys_dir, cluster)
            systems.insert(1, SystemUnderTest(sealed, workload.rng))
        if args.secure:
            secure = await _secure_target(stack, args)
            systems.insert(1, SystemUnderTest(secure, workload.rng))
        if with_redis:
            systems += [
                SystemUnderTest(_redis_target(stack, durable), workload.rng)
                for durable in ([False, True] if fsync == "on" else [False])
            ]
        try:
            phases_per_setting = 1 if args.puts_only else (4 if args.straggler_ms else 2)
            with ProgressReporter("storage", num_settings * phases_per_setting) as progress:
                runner = Bench(workload, progress)
                notes += await run_phases(runner, systems, cluster, args.puts_only)
            idle_nodes = await _idle_nodes(systems[0].target, args.idle_seconds)
            notes.append(f"client counters: {client.read_counters}, {client.write_counters}")
            notes += [_ucx_note(s.target) for s in systems if isinstance(s.target, KVStoreTarget)]
        finally:
            for system in systems:
                await system.target.close()
    results = [_with_idle_share(r, idle_cpu_cores) for r in runner.results]
    return {
        "results": [asdict(r) for r in results],
        "ratios": ratios(results),
        "best": best_of_each(results),
        "seal_cost": seal_cost(workload.block_sizes) if args.encryption else [],
        "idle_nodes": idle_nodes,
        "notes": notes,
        "settings": {
            **_settings(args, workload, with_redis),
            "kvstore_fsync": fsync,
            "servers_idle_cpu_cores": idle_cpu_cores,
        },
    }


def _settings(args: argparse.Namespace, workload: Workload, with_redis: bool) -> dict[str, Any]:
    """The settings a run's JSON records beside its results."""
    return {
        "block_sizes": workload.block_sizes,
        "concurrency": workload.concurrencies,
        "batch": workload.batches,
        "seconds": workload.seconds,
        "rounds": workload.rounds,
        "straggler_ms": workload.straggler_ms,
        "straggler_node": STRAGGLER_NODE,
        "local_cluster": _local_cluster_note(args),
        "get_api": "get_into (batch 1) or get_batch_into, preallocated buffers per task",
        "redis_parser": _redis_parser() if with_redis else "",
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
        "cpus": os.cpu_count(),
    }


async def _kvstore_target(
    cluster_toml: Path,
    transport: str,
    position: int,
    cluster: LocalCluster | None,
    fsync: str,
) -> KVStoreTarget:
    """A client forced onto ``transport`` (Unavailable if UCX cannot work here)."""
    client = await KVClient.connect(cluster_toml, tenant="bench", transport=transport)
    name = "kvstore" if position == 0 else f"kvstore/{transport}"
    return KVStoreTarget(client, transport, name, cluster, fsync)


def _nodes_fsync(cluster_toml: Path) -> str:
    """Whether the cluster's nodes fsync: "on", "off" or "mixed" (from its cluster.toml)."""
    states = {node.fsync for node in load_cluster(cluster_toml).nodes}
    return "mixed" if len(states) > 1 else ("on" if states.pop() else "off")


def _redis_target(stack: contextlib.ExitStack, appendfsync_always: bool) -> RedisTarget:
    """A redis-server started for the run (stopped by ``stack``) and its client."""
    port = stack.enter_context(redis_server(appendfsync_always=appendfsync_always))
    return RedisTarget(port, _redis_pid(port), appendfsync_always=appendfsync_always)


def _with_idle_share(result: Result, idle_cpu_cores: float) -> Result:
    if not result.system.startswith("kvstore") or result.mb_per_s <= 0:
        return result
    idle_s_per_gb = idle_cpu_cores * 1e3 / result.mb_per_s  # cores x s per GB at this MB/s
    return replace(result, server_idle_cpu_s_per_gb=round(idle_s_per_gb, 3))


async def _idle_cpu_cores(target: KVStoreTarget, seconds: float = 2.0) -> float:
    """The nodes' CPU use with no requests (their background loops), in cores: part of every
    record's server CPU per GB, the larger the slower the run."""
    pids = target.server_pids()
    before_s = sum(process_cpu_s(p) for p in pids)
    await asyncio.sleep(seconds)
    return round((sum(process_cpu_s(p) for p in pids) - before_s) / seconds, 3)


async def _idle_nodes(target: Target, seconds: float) -> dict[str, Any] | None:
    """What the nodes burn together over ``seconds`` with no requests, after the workload
    (their background loops with data held: issue 37's idle target); None with
    ``--idle-seconds 0`` or a cluster this bench did not start (its node pids are unknown)."""
    pids = target.server_pids()
    if seconds <= 0 or not pids:
        return None
    before_s = sum(process_cpu_s(p) for p in pids)
    await asyncio.sleep(seconds)
    cpu_s = sum(process_cpu_s(p) for p in pids) - before_s
    return {
        "num_nodes": len(pids),
        "seconds": seconds,
        "cpu_s": round(cpu_s, 3),
        "cores": round(cpu_s / seconds, 4),
        "target_cores": IDLE_NODES_TARGET_CORES,
        "load_avg_1m": os.getloadavg()[0],
    }


def _redis_pid(port: int) -> int:
    import redis

    return int(redis.Redis(host="127.0.0.1", port=port).info("server")["process_id"])


def _redis_parser() -> str:
    """Which reply parser redis-py uses: hiredis (C) when it is installed, else Python's."""
    from redis.utils import HIREDIS_AVAILABLE

    return "hiredis" if HIREDIS_AVAILABLE else "python"


async def _sealed_target(
    cluster_toml: Path, keys_dir: Path, cluster: LocalCluster | None
) -> KVStoreTarget:
    """A client of a tenant whose blocks are sealed, keys under ``keys_dir``."""
    config = await asyncio.to_thread(load_cluster, cluster_toml)
    master = new_master_key(keys_dir / "master.key")
    encryption = EncryptionConfig((SEALED_TENANT,), str(keys_dir / "keyring.json"), str(master))
    client = await KVClient.connect(replace(config, encryption=encryption), tenant=SEALED_TENANT)
    return KVStoreTarget(client, "grpc", "kvstore/sealed", cluster)


async def _secure_target(stack: contextlib.ExitStack, args: argparse.Namespace) -> KVStoreTarget:
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


def seal_cost(block_sizes: list[int], min_s: float = 0.5) -> list[dict[str, Any]]:
    """CPU-seconds per GB of sealing and of opening (into a buffer), one core, per size."""
    with tempfile.TemporaryDirectory(prefix="kv-seal-") as tmp:
        keyring = Keyring(Path(tmp) / "k.json", MasterKeyFile(new_master_key(Path(tmp) / "m")))
        sealer = BlockSealer(SEALED_TENANT, keyring)
        rows = []
        for block_bytes in block_sizes:
            block = memoryview(np.random.default_rng(0).bytes(block_bytes))
            out = memoryview(bytearray(block_bytes))
            key = block_bytes.to_bytes(16, "little")
            sealed = sealer.seal(key, block)
            seal_s = _cpu_s_per_call(lambda: sealer.seal(key, block), min_s)  # noqa: B023
            open_s = _cpu_s_per_call(lambda: sealer.open(key, sealed, out), min_s)  # noqa: B023
            gb = block_bytes / 1e9
            rows.append(
                {
                    "block_bytes": block_bytes,
                    "seal_cpu_s_per_gb": seal_s / gb,
                    "open_cpu_s_per_gb": open_s / gb,
                }
            )
    return rows


def _cpu_s_per_call(call: Callable[[], object], min_s: float) -> float:
    num_calls, start_s = 0, time.process_time()
    while (elapsed_s := time.process_time() - start_s) < min_s:
        call()
        num_calls += 1
    return elapsed_s / num_calls


def _ucx_note(target: KVStoreTarget) -> str:
    ucx = target.client.ucx
    return f"{target.name} ({target.transport}) UCX counters: {ucx.counters if ucx else None}"


def _local_cluster_note(args: argparse.Namespace) -> str:
    if args.cluster is not None:
        return ""
    return f"{args.nodes} nodes, scrub off, fsync {'off' if args.no_fsync else 'on'}"


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore bench storage``."""
    parser.add_argument("--cluster", type=Path, default=None, help="cluster.toml of a cluster")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument(
        "--block-sizes",
        type=list_arg(size_arg),
        default=list_arg(size_arg)("256KiB,1MiB,4MiB"),
        help="block sizes to bench, comma-separated",
    )
    parser.add_argument(
        "--concurrency",
        type=list_arg(int),
        default=[1, 8, 32],
        help="requests in flight (asyncio tasks), comma-separated",
    )
    parser.add_argument(
        "--batch",
        type=list_arg(int),
        default=[1],
        help="keys per call, comma-separated (1: single-key calls; B: get_batch_into and "
        "put_batch of B keys, Redis MGET/MSET)",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per setting")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per setting")
    parser.add_argument(
        "--straggler-ms",
        type=float,
        default=50.0,
        help="delay of the slow node (0: no straggler phase)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=60.0,
        help="after the workload, measure the nodes' CPU this long with no requests (the "
        "JSON's idle_nodes; 0: skip)",
    )
    parser.add_argument(
        "--puts-only",
        action="store_true",
        help="measure PUTs only (the write path against Redis SET, without the GET phases)",
    )
    parser.add_argument(
        "--baseline",
        choices=["none", "redis"],
        default="none",
        help="also bench a redis-server on the same blocks (apt-get install redis-server)",
    )
    _add_system_arguments(parser)


def _add_system_arguments(parser: argparse.ArgumentParser) -> None:
    """What runs under the workload: the cluster, its transports and codec, the baseline."""
    parser.add_argument("--nodes", type=int, default=12, help="nodes of the local cluster")
    parser.add_argument(
        "--transport",
        type=transport_list(("grpc", "ucx", "local")),
        default=["grpc"],
        help="kvstore read transports to bench in one run, e.g. grpc,ucx,local (the straggler "
        "phase runs on the first)",
    )
    parser.add_argument(
        "--backend", choices=["isal", "zfec"], default="isal", help="erasure code backend"
    )
    parser.add_argument("--no-fsync", action="store_true", help="local cluster without fsync")
    parser.add_argument(
        "--encryption",
        action="store_true",
        help="also bench a tenant whose blocks are sealed (AES-GCM), interleaved with plain",
    )
    parser.add_argument(
        "--secure",
        action="store_true",
        help="also bench a second local cluster with tokens and mutual TLS, interleaved",
    )
    parser.add_argument(
        "--malloc",
        choices=["tuned", "default"],
        default="tuned",
        help="tuned: erasure.allocator.tune_glibc_malloc() in the client process first",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the tables, write JSON."""
    malloc_tuned = args.malloc == "tuned" and tune_glibc_malloc()
    report = asyncio.run(bench(args))
    report["settings"]["client_malloc"] = "tuned" if malloc_tuned else "default"
    results = [Result(**r) for r in report["results"]]
    console = make_console()
    print_fitted(results_table(results), console, keep=("MB/s",))
    if report["ratios"]:
        print_fitted(ratios_table(report["ratios"]), console)
    if report["best"]:
        print_fitted(best_table(report["best"]), console, keep=("ratio", "CPU ratio"))
    for row in report["seal_cost"]:
        console.print(
            f"sealing {size_label(row['block_bytes'])}: {row['seal_cpu_s_per_gb']:.2f} CPU-s/GB, "
            f"opening: {row['open_cpu_s_per_gb']:.2f} CPU-s/GB (one core)"
        )
    if idle := report["idle_nodes"]:
        console.print(
            f"{idle['num_nodes']} idle nodes: {idle['cores']:.3f} cores over {idle['seconds']:g} s "
            f"(target <= {idle['target_cores']}; load {idle['load_avg_1m']:.1f})"
        )
    for note in report["notes"]:
        console.print(f"note: {note}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 0
