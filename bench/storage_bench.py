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
the cores (null where no byte moved, every call having failed: ``cpu_s_per_gb_none`` says
so), and its ``fsync`` state (kvstore's nodes "on"/"off", Redis "off"/"always");
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
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import NO_REDIS, bench_cluster, redis_binary, transport_list
from bench.storage.redis import redis_parser, redis_target
from bench.storage.report import (
    Result,
    best_of_each,
    best_table,
    ratios,
    ratios_table,
    results_table,
)
from bench.storage.targets import (
    POOL_SUFFIX,
    SEALED_TENANT,
    KVStoreTarget,
    kvstore_target,
    nodes_fsync,
    sealed_target,
    secure_target,
    ucx_note,
)
from bench.storage.workload import (
    STRAGGLER_NODE,
    Bench,
    SystemUnderTest,
    Workload,
    measure_idle_cores,
    measure_idle_nodes,
    run_phases,
    with_idle_share,
)
from client.keyring import Keyring, MasterKeyFile, new_master_key
from client.sealer import BlockSealer
from erasure.allocator import tune_glibc_malloc
from kvstore.cli.args import list_arg, size_arg
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.tables import make_console, print_fitted
from ttl.units import size_label

# Re-exported: the names tests and readers used from this module before it was split.
__all__ = ["Result", "bench", "best_of_each", "configure", "run", "seal_cost"]


def pool_shape(workload: Workload) -> tuple[int, int]:
    """A landing pool's (slot bytes, slots) for every GET of the workload at once."""
    return max(workload.block_sizes), max(workload.concurrencies) * max(workload.batches)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload(
        args.block_sizes, args.concurrency, args.seconds, args.straggler_ms, args.rounds, args.batch
    )
    with_redis = args.baseline == "redis" and redis_binary() is not None
    notes = [] if with_redis or args.baseline == "none" else [NO_REDIS]
    num_settings = len(workload.block_sizes) * len(workload.concurrencies) * len(workload.batches)
    with bench_cluster(args) as (cluster_toml, cluster), contextlib.ExitStack() as stack:
        fsync = await asyncio.to_thread(nodes_fsync, cluster_toml)
        systems = [
            SystemUnderTest(
                await kvstore_target(
                    cluster_toml, transport, i, cluster, fsync, pool_shape(workload)
                ),
                workload.rng,
            )
            for i, transport in enumerate(args.transport)
        ]
        idle_cpu_cores = await measure_idle_cores(systems[0].target)
        client = systems[0].target.client
        if args.encryption:
            keys_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kv-keys-")))
            sealed = await sealed_target(cluster_toml, keys_dir, cluster)
            systems.insert(1, SystemUnderTest(sealed, workload.rng))
        if args.secure:
            secure = await secure_target(stack, args)
            systems.insert(1, SystemUnderTest(secure, workload.rng))
        if with_redis:
            systems += [
                SystemUnderTest(redis_target(stack, durable), workload.rng)
                for durable in ([False, True] if fsync == "on" else [False])
            ]
        try:
            phases_per_setting = 1 if args.puts_only else (4 if args.straggler_ms else 2)
            with ProgressReporter("storage", num_settings * phases_per_setting) as progress:
                runner = Bench(workload, progress)
                notes += await run_phases(runner, systems, cluster, args.puts_only)
            idle_nodes = await measure_idle_nodes(systems[0].target, args.idle_seconds)
            notes.append(f"client counters: {client.read_counters}, {client.write_counters}")
            notes += [ucx_note(s.target) for s in systems if isinstance(s.target, KVStoreTarget)]
        finally:
            for system in systems:
                await system.target.close()
    results = [with_idle_share(r, idle_cpu_cores) for r in runner.results]
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
        "redis_parser": redis_parser() if with_redis else "",
        "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
        "cpus": os.cpu_count(),
    }


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
        type=transport_list(("grpc", "ucx", "local", "stream", "local" + POOL_SUFFIX)),
        default=["grpc"],
        help="kvstore read transports to bench in one run, e.g. grpc,ucx,local (the straggler "
        "phase runs on the first); local+pool: the local channel into a landing pool's slots, "
        "as engines read",
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
