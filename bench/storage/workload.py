"""How ``kvstore bench storage`` measures: the workload, the systems with the keys written to
them, settings measured in interleaved rounds, the phases (PUTs, then calm / straggler / calm
GETs), and the nodes' idle CPU."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xxhash

from bench.common import percentile_ms, process_cpu_s, run_load
from bench.storage.report import IDLE_NODES_TARGET_CORES, Result
from bench.storage.targets import BaselineError, KVStoreTarget, Target
from deploy.local_cluster import LocalCluster
from kvstore.cli.progress import ProgressReporter
from kvstore.errors import KVStoreError
from ttl.units import size_label

log = logging.getLogger(__name__)

STRAGGLER_NODE = "n00"


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
        pooled = self.target.buffers(concurrency * batch, block_bytes)
        buffers = [pooled[i * batch : (i + 1) * batch] for i in range(concurrency)]

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
            transport_used=self.transport_used(),
            **self._cpu_per_gb(moved_bytes),
        )

    def _cpu_per_gb(self, moved_bytes: int) -> dict[str, Any]:
        """The CPU-per-GB fields of the record; None with the reason where no byte moved."""
        if moved_bytes <= 0:
            reason = f"no bytes moved: {self.num_false} of {len(self.latencies_s)} calls failed"
            return {
                "client_cpu_s_per_gb": None,
                "server_cpu_s_per_gb": None,
                "total_cpu_s_per_gb": None,
                "cpu_s_per_gb_none": reason,
            }
        gb = moved_bytes / 1e9
        return {
            "client_cpu_s_per_gb": round(self.client_cpu_s / gb, 3),
            "server_cpu_s_per_gb": round(self.server_cpu_s / gb, 3),
            "total_cpu_s_per_gb": round((self.client_cpu_s + self.server_cpu_s) / gb, 3),
        }


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


def with_idle_share(result: Result, idle_cpu_cores: float) -> Result:
    if not result.system.startswith("kvstore") or result.mb_per_s <= 0:
        return result
    idle_s_per_gb = idle_cpu_cores * 1e3 / result.mb_per_s  # cores x s per GB at this MB/s
    return replace(result, server_idle_cpu_s_per_gb=round(idle_s_per_gb, 3))


async def measure_idle_cores(target: KVStoreTarget, seconds: float = 2.0) -> float:
    """The nodes' CPU use with no requests (their background loops), in cores: part of every
    record's server CPU per GB, the larger the slower the run."""
    pids = target.server_pids()
    before_s = sum(process_cpu_s(p) for p in pids)
    await asyncio.sleep(seconds)
    return round((sum(process_cpu_s(p) for p in pids) - before_s) / seconds, 3)


async def measure_idle_nodes(target: Target, seconds: float) -> dict[str, Any] | None:
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
