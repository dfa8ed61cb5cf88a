"""``kvstore bench storage``: cluster PUT/GET throughput and latency, with a straggler, vs Redis.

::

    kvstore bench storage [--cluster DIR/cluster.toml] --json PATH
        [--block-sizes 256KiB,1MiB,4MiB] [--concurrency 1,8,32] [--seconds S]
        [--straggler-ms 50] [--baseline redis] [--no-fsync] [--transport grpc,ucx]
        [--encryption]

One client process runs N concurrent asyncio tasks per setting, each issuing one request after
another for ``--seconds``; systems run interleaved in ``--rounds`` (A B, B A, ...). Order: PUTs
(fresh keys) for every block size and concurrency; then per GET setting: GETs of random written
keys, the same GETs on kvstore with one node restarted with ``--inject-delay-ms``, and again
after restarting it without the delay (the straggler runs only when the bench started the
cluster itself). Each measurement starts with an unmeasured warm-up (a quarter of its first
round), so the client has learned which node is slow, as it would have in steady state. GETs use
``get_into`` with one preallocated buffer per task (the swap-in path). MB/s counts 10**6
bytes of block data per second. The client process tunes glibc's malloc for multi-megabyte
buffers first (``--malloc tuned``, see erasure/allocator.py). With ``--baseline redis`` the
same workload runs through redis-py (hiredis) asyncio against a ``redis-server`` this bench
starts with persistence off. With ``--encryption`` a second kvstore client whose tenant's
blocks are sealed (AES-256-GCM, client/sealer.py) runs the same workload interleaved with the
plain one (``kvstore/sealed``; ratio "sealed/plain MB/s"), and the report's ``seal_cost``
gives the CPU-seconds per GB of sealing and opening alone, on one core.
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
    percentile_ms,
    redis_binary,
    redis_server,
    run_load,
    transport_list,
)
from client import KVClient
from client.keyring import Keyring, MasterKeyFile, new_master_key
from client.sealer import BlockSealer
from deploy.local_cluster import LocalCluster
from erasure.allocator import tune_glibc_malloc
from kvstore.cli import list_arg, size_arg
from kvstore.config import EncryptionConfig, load_cluster
from kvstore.errors import KVStoreError
from kvstore.progress import ProgressReporter
from kvstore.tables import make_console, print_fitted
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
    transport: str = ""  # kvstore's read transport ("grpc" or "ucx"); "" for redis


@dataclass
class Workload:
    block_sizes: list[int]
    concurrencies: list[int]
    seconds: float
    straggler_ms: float
    rounds: int = 2
    rng: random.Random = field(default_factory=lambda: random.Random(0))


class Target(Protocol):
    """One system under test: put, get into a buffer, clean up."""

    name: str

    async def put(self, key: bytes, data: bytes) -> None: ...

    async def get_into(self, key: bytes, out: bytearray) -> bool: ...

    async def close(self) -> None: ...


class KVStoreTarget:
    """kvstore through one client; the first transport benched is "kvstore", others
    "kvstore/<transport>" (the ratios compare "kvstore")."""

    def __init__(self, client: KVClient, transport: str, name: str = "kvstore") -> None:
        self.client = client
        self.transport = transport
        self.name = name

    async def put(self, key: bytes, data: bytes) -> None:
        await self.client.put(key, data, traffic_class="chat")

    async def get_into(self, key: bytes, out: bytearray) -> bool:
        return await self.client.get_into(key, out)

    async def close(self) -> None:
        await self.client.close()


class RedisTarget:
    name = "redis"

    def __init__(self, port: int) -> None:
        import redis.asyncio

        self.redis = redis.asyncio.Redis(host="127.0.0.1", port=port, max_connections=256)

    async def put(self, key: bytes, data: bytes) -> None:
        await self.redis.set(key, data)

    async def get_into(self, key: bytes, out: bytearray) -> bool:
        value = await self.redis.get(key)
        return value is not None

    async def close(self) -> None:
        await self.redis.flushall()
        await self.redis.aclose()


class SystemUnderTest:
    """A target with the keys written to it so far, per block size."""

    def __init__(self, target: Target, rng: random.Random) -> None:
        self.target = target
        self.rng = rng
        self.size_to_keys: dict[int, list[bytes]] = {}
        self._key_numbers = itertools.count()

    def request(
        self, op: str, block_bytes: int, concurrency: int
    ) -> Callable[[int], Awaitable[bool]]:
        """What one task sends: a PUT of a fresh key, or a GET of a random written key."""
        keys = self.size_to_keys.setdefault(block_bytes, [])
        if op == "put":
            blocks = [np.random.default_rng(block_bytes + i).bytes(block_bytes) for i in range(4)]

            async def put(index: int) -> bool:
                number = next(self._key_numbers)
                key = xxhash.xxh3_128_digest(f"{self.target.name}/{block_bytes}/{number}".encode())
                try:
                    await self.target.put(key, blocks[number % len(blocks)])
                except KVStoreError as exc:
                    log.warning("%s put failed: %s", self.target.name, exc)
                    return False
                keys.append(key)
                return True

            return put
        buffers = [bytearray(block_bytes) for _ in range(concurrency)]

        async def get(index: int) -> bool:
            return await self.target.get_into(self.rng.choice(keys), buffers[index])

        return get


class Bench:
    """Measures settings; systems of one setting run in interleaved rounds (A B, B A, ...)."""

    def __init__(self, workload: Workload, progress: ProgressReporter) -> None:
        self.workload = workload
        self.progress = progress
        self.results: list[Result] = []

    def settings(self) -> list[tuple[int, int]]:
        """(block_bytes, concurrency) pairs in the order they run."""
        workload = self.workload
        return [(b, c) for b in workload.block_sizes for c in workload.concurrencies]

    async def measure(
        self,
        op: str,
        setting: tuple[int, int],
        systems: list[SystemUnderTest],
        straggler_ms: float = 0.0,
        repeat: int = 0,
    ) -> None:
        """One setting of ``op`` on ``systems``, with progress."""
        block_bytes, concurrency = setting
        label = f"{op} {size_label(block_bytes)} x{concurrency}"
        if straggler_ms:
            label += f" (+{straggler_ms:g} ms straggler)"
        self.progress.update(description=label)
        await self._measure(op, block_bytes, concurrency, systems, straggler_ms, repeat)
        self.progress.advance()

    async def _measure(
        self,
        op: str,
        block_bytes: int,
        concurrency: int,
        systems: list[SystemUnderTest],
        straggler_ms: float,
        repeat: int,
    ) -> None:
        rounds = self.workload.rounds
        round_s = self.workload.seconds / rounds
        name_to_samples: dict[str, tuple[list[float], list[int], list[float]]] = {
            s.target.name: ([], [], []) for s in systems
        }
        name_to_transport = {s.target.name: getattr(s.target, "transport", "") for s in systems}
        for round_index in range(rounds):
            for system in systems if round_index % 2 == 0 else systems[::-1]:
                request = system.request(op, block_bytes, concurrency)
                if round_index == 0:
                    await run_load(request, concurrency, round_s / 4)  # warm-up
                latencies_s, num_false, elapsed_s = await run_load(request, concurrency, round_s)
                samples = name_to_samples[system.target.name]
                samples[0].extend(latencies_s)
                samples[1].append(num_false)
                samples[2].append(elapsed_s)
        for name, (latencies_s, num_false, elapsed_s) in name_to_samples.items():
            self.results.append(
                Result(
                    system=name,
                    op=op,
                    block_bytes=block_bytes,
                    concurrency=concurrency,
                    straggler_ms=straggler_ms,
                    mb_per_s=(len(latencies_s) - sum(num_false))
                    * block_bytes
                    / sum(elapsed_s)
                    / 1e6,
                    p50_ms=percentile_ms(latencies_s, 50),
                    p99_ms=percentile_ms(latencies_s, 99),
                    p999_ms=percentile_ms(latencies_s, 99.9),
                    num_ops=len(latencies_s),
                    seconds=sum(elapsed_s),
                    num_failed=sum(num_false),
                    repeat=repeat,
                    load_avg_1m=os.getloadavg()[0],
                    transport=name_to_transport[name],
                )
            )


def results_table(results: list[Result]) -> Table:
    table = Table(title="storage benchmark")
    columns = ("system", "op", "block", "conc", "straggler", "MB/s", "p50 ms", "p99 ms")
    for column in (*columns, "p999 ms", "ops", "failed", "load"):
        table.add_column(column, justify="left" if column in ("system", "op") else "right")
    for r in results:
        table.add_row(
            r.system,
            r.op,
            size_label(r.block_bytes),
            str(r.concurrency),
            f"{r.straggler_ms:g} ms" if r.straggler_ms else ("- (again)" if r.repeat else "-"),
            f"{r.mb_per_s:,.0f}",
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.p999_ms:.2f}",
            str(r.num_ops),
            str(r.num_failed),
            f"{r.load_avg_1m:.1f}",
        )
    return table


def ratios(results: list[Result]) -> list[dict[str, Any]]:
    """kvstore/redis MB/s per setting; straggler p99 / calm p99 per GET setting.

    The calm p99 is the mean of the calm runs before and after the straggler phase, so a
    drift in machine load between phases does not pass for a straggler effect.
    """
    setting_to_calm: dict[tuple, list[Result]] = {}
    for r in results:
        if not r.straggler_ms:
            key = (r.system, r.op, r.block_bytes, r.concurrency)
            setting_to_calm.setdefault(key, []).append(r)
    rows = []
    for ours in results:
        if ours.system != "kvstore" or ours.repeat:
            continue
        setting = (ours.op, ours.block_bytes, ours.concurrency)
        if ours.straggler_ms:
            calm = setting_to_calm.get(("kvstore", *setting), [])
            calm_p99_ms = sum(c.p99_ms for c in calm) / len(calm) if calm else 0.0
            if calm_p99_ms:
                rows.append(_ratio_row("straggler/calm p99", ours, ours.p99_ms / calm_p99_ms))
            continue
        redis_runs = setting_to_calm.get(("redis", *setting))
        if redis_runs:
            ratio = ours.mb_per_s / redis_runs[0].mb_per_s
            rows.append(_ratio_row("kvstore/redis MB/s", ours, ratio))
        sealed_runs = setting_to_calm.get(("kvstore/sealed", *setting))
        if sealed_runs and ours.mb_per_s:
            ratio = sealed_runs[0].mb_per_s / ours.mb_per_s
            rows.append(_ratio_row("sealed/plain MB/s", ours, ratio))
    return rows


def _ratio_row(kind: str, result: Result, ratio: float) -> dict[str, Any]:
    return {
        "kind": kind,
        "op": result.op,
        "block_bytes": result.block_bytes,
        "concurrency": result.concurrency,
        "ratio": ratio,
    }


def ratios_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="ratios (targets: kvstore/redis GET >= 1.0, straggler/calm p99 <= 1.1)")
    for column in ("ratio", "op", "block", "conc", "value"):
        table.add_column(column, justify="left" if column in ("ratio", "op") else "right")
    for row in rows:
        table.add_row(
            row["kind"],
            row["op"],
            size_label(row["block_bytes"]),
            str(row["concurrency"]),
            f"{row['ratio']:.2f}",
        )
    return table


def _restart(cluster: LocalCluster, delay_ms: float) -> None:
    extra = ["--inject-delay-ms", f"{delay_ms:g}"] if delay_ms else []
    cluster.restart_node(STRAGGLER_NODE, extra)


async def run_phases(
    bench: Bench, systems: list[SystemUnderTest], cluster: LocalCluster | None
) -> list[str]:
    """PUTs on every system; then per GET setting: calm, straggler, calm again (kvstore only).

    Restarting the straggler around each setting keeps the calm and straggler runs seconds
    apart, so load from other processes drifts less between the runs being compared.
    """
    for setting in bench.settings():
        await bench.measure("put", setting, systems)
    for setting in bench.settings():
        await bench.measure("get", setting, systems)
        if cluster is None:
            continue
        straggler_ms = bench.workload.straggler_ms
        await asyncio.to_thread(_restart, cluster, straggler_ms)
        await bench.measure("get", setting, systems[:1], straggler_ms=straggler_ms)
        await asyncio.to_thread(_restart, cluster, 0.0)
        await bench.measure("get", setting, systems[:1], repeat=1)
    if cluster is None:
        return ["straggler GETs skipped: --cluster given, so its nodes cannot be restarted"]
    return []


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload(
        args.block_sizes, args.concurrency, args.seconds, args.straggler_ms, args.rounds
    )
    with_redis = args.baseline == "redis" and redis_binary() is not None
    notes = [] if with_redis or args.baseline == "none" else [NO_REDIS]
    num_settings = len(workload.block_sizes) * len(workload.concurrencies)
    with bench_cluster(args) as (cluster_toml, cluster), contextlib.ExitStack() as stack:
        systems = [
            SystemUnderTest(await _kvstore_target(cluster_toml, transport, i), workload.rng)
            for i, transport in enumerate(args.transport)
        ]
        client = systems[0].target.client
        if args.encryption:
            keys_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kv-keys-")))
            sealed = await _sealed_target(cluster_toml, keys_dir)
            systems.insert(1, SystemUnderTest(sealed, workload.rng))
        if with_redis:
            port = stack.enter_context(redis_server())
            systems.append(SystemUnderTest(RedisTarget(port), workload.rng))
        try:
            with ProgressReporter("storage", num_settings * 4) as progress:
                runner = Bench(workload, progress)
                notes += await run_phases(runner, systems, cluster)
            notes.append(f"client counters: {client.read_counters}, {client.write_counters}")
            notes += [_ucx_note(s.target) for s in systems if isinstance(s.target, KVStoreTarget)]
        finally:
            for system in systems:
                await system.target.close()
    return {
        "results": [asdict(r) for r in runner.results],
        "ratios": ratios(runner.results),
        "seal_cost": seal_cost(workload.block_sizes) if args.encryption else [],
        "notes": notes,
        "settings": {
            "block_sizes": workload.block_sizes,
            "concurrency": workload.concurrencies,
            "seconds": workload.seconds,
            "rounds": workload.rounds,
            "straggler_ms": workload.straggler_ms,
            "straggler_node": STRAGGLER_NODE,
            "local_cluster": _local_cluster_note(args),
            "get_api": "get_into (preallocated buffer per task)",
            "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
            "cpus": os.cpu_count(),
        },
    }


async def _kvstore_target(cluster_toml: Path, transport: str, position: int) -> KVStoreTarget:
    """A client forced onto ``transport`` (Unavailable if UCX cannot work here)."""
    client = await KVClient.connect(cluster_toml, tenant="bench", transport=transport)
    return KVStoreTarget(client, transport, "kvstore" if position == 0 else f"kvstore/{transport}")


async def _sealed_target(cluster_toml: Path, keys_dir: Path) -> KVStoreTarget:
    """A client of a tenant whose blocks are sealed, keys under ``keys_dir``."""
    config = await asyncio.to_thread(load_cluster, cluster_toml)
    master = new_master_key(keys_dir / "master.key")
    encryption = EncryptionConfig((SEALED_TENANT,), str(keys_dir / "keyring.json"), str(master))
    client = await KVClient.connect(replace(config, encryption=encryption), tenant=SEALED_TENANT)
    return KVStoreTarget(client, "grpc", "kvstore/sealed")


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
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per setting")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per setting")
    parser.add_argument("--straggler-ms", type=float, default=50.0, help="delay of the slow node")
    parser.add_argument(
        "--baseline",
        choices=["none", "redis"],
        default="none",
        help="also bench a redis-server on the same blocks (apt-get install redis-server)",
    )
    parser.add_argument("--nodes", type=int, default=12, help="nodes of the local cluster")
    parser.add_argument(
        "--transport",
        type=transport_list(("grpc", "ucx")),
        default=["grpc"],
        help="kvstore read transports to bench in one run, e.g. grpc,ucx (the straggler "
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
    for row in report["seal_cost"]:
        console.print(
            f"sealing {size_label(row['block_bytes'])}: {row['seal_cpu_s_per_gb']:.2f} CPU-s/GB, "
            f"opening: {row['open_cpu_s_per_gb']:.2f} CPU-s/GB (one core)"
        )
    for note in report["notes"]:
        console.print(f"note: {note}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    return 0
