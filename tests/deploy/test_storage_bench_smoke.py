"""A tiny run of `kvstore bench storage` end to end (local cluster, straggler, Redis if present)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.local_nodes import health
from kvstore.config import load_cluster
from tests.leftover_processes import is_gone, live_pids, parent_pid

# Minutes on a loaded 2-core machine (a cluster, a sealed client, Redis, straggler restarts).
pytestmark = pytest.mark.timeout(480)

FIELDS = {"system", "op", "block_bytes", "concurrency", "straggler_ms", "mb_per_s"}
FIELDS |= {"p50_ms", "p99_ms", "p999_ms", "batch", "client_cpu_s_per_gb", "server_cpu_s_per_gb"}
FIELDS |= {"total_cpu_s_per_gb", "fsync", "transport_used", "cpu_s_per_gb_by_side"}


def test_bench_storage_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    baseline = "redis" if shutil.which("redis-server") else "none"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "storage", "--json", str(out)]
    command += ["--block-sizes", "64KiB", "--concurrency", "1,4", "--batch", "1,3"]
    command += ["--seconds", "0.2", "--idle-seconds", "2"]
    command += ["--straggler-ms", "20", "--baseline", baseline, "--no-fsync", "--encryption"]
    command += ["--transport", "grpc,local+pool"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=450)
    assert run.returncode == 0, f"bench failed:\n{run.stdout}\n{run.stderr}"
    assert "storage benchmark" in run.stdout, "the results table was not printed"
    report = json.loads(out.read_text())
    results = report["results"]
    assert all(set(r) >= FIELDS for r in results), "a result record lacks a required field"
    ours = [r for r in results if r["system"] == "kvstore"]
    settings = {(r["op"], r["concurrency"], r["batch"], r["straggler_ms"]) for r in ours}
    calm = {(op, c, b, 0) for op in ("put", "get") for c in (1, 4) for b in (1, 3)}
    assert settings == calm | {("get", c, b, 20) for c in (1, 4) for b in (1, 3)}, settings
    assert all(r["mb_per_s"] > 0 and r["num_failed"] == 0 for r in ours), "requests failed"
    assert all(r["client_cpu_s_per_gb"] > 0 for r in ours), "client CPU per GB not measured"
    assert all(r["server_cpu_s_per_gb"] > 0 for r in ours), "node CPU per GB not measured"
    assert all(r["fsync"] == "off" for r in ours), "the nodes' fsync state not recorded"
    assert {r["transport_used"] for r in ours} == {"grpc"}, "reads or writes left gRPC"
    assert all(set(r["cpu_s_per_gb_by_side"]) == {"client", "nodes"} for r in ours)
    idle = report["idle_nodes"]
    assert idle["num_nodes"] == 12 and idle["seconds"] == 2, idle
    # A generous bound (the target is 0.05 over 60 s): loops that poll every 50 ms would
    # exceed it even on a quiet machine, and the shared CI machine's load inflates it.
    assert 0 <= idle["cores"] < 0.5, f"idle nodes burn {idle['cores']} cores"
    assert report["settings"]["kvstore_fsync"] == "off"
    # Reads into a landing pool's slots, which the nodes on this host write in place.
    pooled = [r for r in results if r["system"] == "kvstore/local+pool"]
    assert {(r["op"], r["concurrency"], r["batch"]) for r in pooled} == {
        (op, c, b) for op, c, b, _ in calm
    }, "the pooled reads were not measured in every calm setting"
    assert all(r["mb_per_s"] > 0 and r["num_failed"] == 0 for r in pooled), "pooled reads failed"
    assert {r["transport_used"] for r in pooled if r["op"] == "get"} == {"local"}
    sealed = [r for r in results if r["system"] == "kvstore/sealed"]
    assert sealed and all(r["mb_per_s"] > 0 and r["num_failed"] == 0 for r in sealed)
    assert any(row["kind"] == "sealed/plain MB/s" for row in report["ratios"])
    assert report["seal_cost"] and report["seal_cost"][0]["seal_cpu_s_per_gb"] > 0
    if baseline == "redis":
        systems = {"kvstore", "kvstore/local+pool", "kvstore/sealed", "redis"}
        assert {r["system"] for r in results} == systems
        redis = [r for r in results if r["system"] == "redis"]
        assert all(r["transport_used"] == "resp/tcp" for r in redis)
        assert all(set(r["cpu_s_per_gb_by_side"]) == {"client", "redis-server"} for r in redis)
        assert any(row["kind"] == "kvstore/redis MB/s" for row in report["ratios"])
        assert report["settings"]["redis_parser"] in ("hiredis", "python")
        best = {(row["op"], row["transport"], row["baseline"]) for row in report["best"]}
        want = {("get", "grpc", "redis"), ("get", "local+pool", "redis"), ("put", "any", "redis")}
        assert best == want, best
        assert "best of each" in run.stdout, "the best-of-each table was not printed"


def _child_nodes(parent: int) -> dict[int, Path]:
    """The node processes ``parent`` started: pid -> its cluster.toml."""
    nodes = {}
    for pid in live_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvstore.cli" in argv and b"node" in argv and parent_pid(pid) == parent:
            nodes[pid] = Path(argv[argv.index(b"--config") + 1].decode())
    return nodes


def test_sigterm_stops_the_embedded_cluster(tmp_path: Path) -> None:
    """`kill` (SIGTERM) of a benchmark ends it as Ctrl-C does: its embedded cluster's nodes
    are stopped, not left running orphaned, and it exits with 128 + 15."""
    command = [sys.executable, "-m", "kvstore.cli", "bench", "storage", "--json", "-"]
    command += ["--block-sizes", "64KiB", "--concurrency", "1", "--seconds", "600"]
    command += ["--straggler-ms", "0", "--idle-seconds", "0", "--no-fsync"]
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        nodes: dict[int, Path] = {}
        while time.monotonic() < deadline and bench.poll() is None:
            nodes = _child_nodes(bench.pid)
            if len(nodes) == 12:  # every node up and serving: the workload runs
                config = load_cluster(next(iter(nodes.values())))
                if all(health(n.address, 1.0) for n in config.nodes):
                    break
            time.sleep(0.2)
        else:
            pytest.fail(f"the benchmark's 12 nodes never served: {bench.poll()}")
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=120)
        assert bench.returncode == 128 + signal.SIGTERM, stderr.decode(errors="replace")
        stop_by = time.monotonic() + 30
        while not all(is_gone(pid) for pid in nodes) and time.monotonic() < stop_by:
            time.sleep(0.1)
        assert all(is_gone(pid) for pid in nodes), "nodes outlived a SIGTERMed benchmark"
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
