"""What several benchmarks share: load loops, percentiles, the cluster they run on, Redis.

Each ``bench/*_bench.py`` module is one ``kvstore bench ...`` command; this module is not a
command. Sizes and lists on the command line parse with ``kvstore.cli.size_arg`` and
``list_arg``; labels come from ``ttl.units.size_label``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from deploy.local_cluster import LocalCluster
from deploy.local_nodes import free_ports

NO_REDIS = (
    "redis baseline skipped: no redis-server on this machine "
    "(Debian/Ubuntu: apt-get install -y redis-server)"
)


def percentile_ms(latencies_s: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(latencies_s), q) * 1000) if latencies_s else 0.0


async def run_load(
    request: Callable[[int], Awaitable[bool]], concurrency: int, seconds: float
) -> tuple[list[float], int, float]:
    """``concurrency`` tasks call ``request(task_index)`` back to back for ``seconds``.

    Returns per-request latencies, the number of requests that returned False, and the
    elapsed wall time.
    """
    latencies_s: list[float] = []
    num_false = 0
    stop_s = time.perf_counter() + seconds

    async def worker(index: int) -> None:
        nonlocal num_false
        while True:
            start_s = time.perf_counter()
            ok = await request(index)
            end_s = time.perf_counter()
            latencies_s.append(end_s - start_s)
            num_false += not ok
            if end_s >= stop_s:
                return

    start_s = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return latencies_s, num_false, time.perf_counter() - start_s


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc); 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/sbin:/usr/bin")


@contextmanager
def redis_server(*, appendfsync_always: bool = False) -> Iterator[int]:
    """A throwaway redis-server on a free 127.0.0.1 port, persistence off; yields the port.

    ``appendfsync_always``: the append-only file on, fsynced before every reply (Redis's
    durable setting, the baseline for a store that fsyncs), in a temporary directory, with
    automatic AOF rewrites off (a forked rewrite would run outside the measured process).
    """
    (port,) = free_ports(1)
    command = [
        redis_binary() or "redis-server",
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
    ]
    command += ["--protected-mode", "no", "--logfile", ""]
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-") as aof_dir:
        if appendfsync_always:
            command += ["--appendonly", "yes", "--appendfsync", "always", "--dir", aof_dir]
            command += ["--auto-aof-rewrite-percentage", "0"]
        else:
            command += ["--appendonly", "no"]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for_redis(port, proc)
            yield port
        finally:
            proc.terminate()
            proc.wait(10)


def _wait_for_redis(port: int, proc: subprocess.Popen[bytes]) -> None:
    import redis

    deadline_s = time.monotonic() + 10
    while time.monotonic() < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            redis.Redis(host="127.0.0.1", port=port).ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not answer PING within 10 s")


@contextmanager
def bench_cluster(args: argparse.Namespace) -> Iterator[tuple[Path, LocalCluster | None]]:
    """``args.cluster``, or a local cluster of ``args.nodes`` (``args.backend``,
    ``args.no_fsync``) started around the run: (its cluster.toml, the cluster if started)."""
    if args.cluster is not None:
        yield args.cluster, None
        return
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmp:
        overrides = bench_node_overrides(args)
        with LocalCluster.start(tmp, num_nodes=args.nodes, backend=args.backend, **overrides) as c:
            yield c.cluster_toml, c


def bench_node_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """NodeConfig fields of every node of a bench's local cluster (``args.no_fsync``)."""
    # The background scrub (64 MiB/s per node by default) would compete with the measured
    # requests for this machine's cores; it is off here and measured on its own elsewhere.
    overrides: dict[str, Any] = {"scrub_bytes_per_s": 0}
    if args.no_fsync:
        overrides["fsync"] = False
    return overrides


def transport_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated distinct read transports out of ``allowed``."""

    def parse(text: str) -> list[str]:
        transports = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [t for t in transports if t not in allowed]
        if not transports or unknown or len(set(transports)) != len(transports):
            raise argparse.ArgumentTypeError(
                f"--transport takes distinct values of {', '.join(allowed)}, got {text!r}"
            )
        return transports

    return parse
