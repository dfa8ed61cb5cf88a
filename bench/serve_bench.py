"""``kvstore bench serve``: prefill balance on a mixed-length burst, per routing policy, against
a perfect offline assignment of the same work; with ``--flood``/``--slow-sockets``, the HTTP
front of ``kvstore serve`` under a flood and under slow clients (``bench/serve_load.py``);
with ``--drop-after-first-token``, streams hung up after their first token, probed for a
wedge (``bench/serve_drops.py``, issue 42).

::

    kvstore bench serve [--json PATH] [--model random:small] [--num-requests 48]
        [--prefill-workers 2] [--min-tokens 64] [--max-tokens 3968] [--rounds 3]
        [--policies balanced,least-loaded,round-robin] [--bucket-bounds 512,1024,2048]
    kvstore bench serve --flood 200 [--slow-sockets 120] [--drop-after-first-token 2000]
        [--json PATH] [--cluster TOML]
        [--flood-max-tokens 16] [--serve-args "..."]

Method: a local 12-node cluster, prefill workers and one decode worker (real processes) are
started once. Each round sends, for each policy in turn, a burst of ``--num-requests``
prompts of mixed lengths (seeded: short ones log-uniform in ``[--min-tokens, max/8]``, a
``--long-fraction`` of long ones in ``[max/2, --max-tokens]``; fresh prompts each time, so
nothing is cached), all at once, one generated token each. A
prefill worker serves its requests one after another, so on each worker the time between
two consecutive completions is what the later request occupied it (the first counts from
the burst's start). From those measured occupancies:

- ``makespan_s``: burst start to the last completion (what the policy achieved);
- ``offline_s``: the makespan of the longest-first offline assignment of the same
  occupancies (LPT, within 4/3 of the optimum), and ``bound_s``: no assignment beats
  ``max(total / workers, longest)``;
- ``balance`` = ``offline_s / makespan_s`` (1.0: as good as the offline assignment;
  DeepSeek reports about 0.8 for its online balancer) and ``balance_vs_bound``.

The bucket bounds default to a scaled-down 512/1K/2K (the serving defaults 16K/64K/256K do
not fit a CPU model's context). Figures move with the machine's load; compare policies
within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from deploy.local_cluster import LocalCluster
from engine_adapter.serving.balancer import (
    BalancerConfig,
    list_schedule_makespan_s,
    makespan_lower_bound_s,
)
from engine_adapter.serving.request_api import Completion
from engine_adapter.serving.router import POLICIES, Router
from engine_adapter.serving.worker_pool import WorkerPool
from kvstore.cli.args import list_arg

DEFAULT_BUCKET_BOUNDS = (512, 1024, 2048)


def prompt_lengths(
    num: int, min_tokens: int, max_tokens: int, long_fraction: float, seed: int
) -> list[int]:
    """Seeded mixed lengths: short ones log-uniform in [min, max/8], and a ``long_fraction``
    of long ones uniform in [max/2, max] (chat turns next to long documents)."""
    rng = random.Random(seed)
    low, high = math.log(min_tokens), math.log(max(max_tokens // 8, min_tokens))
    return [
        rng.randint(max_tokens // 2, max_tokens)
        if rng.random() < long_fraction
        else int(math.exp(rng.uniform(low, high)))
        for _ in range(num)
    ]


def occupancies(
    start_s: float, completions: Sequence[tuple[Completion, float]]
) -> dict[str, list[float]]:
    """Per prefill worker, what each of its requests occupied it (see the module doc)."""
    by_worker: dict[str, list[float]] = defaultdict(list)
    for completion, end_s in completions:
        by_worker[completion.prefill_worker_id].append(end_s)
    result = {}
    for worker, ends in by_worker.items():
        ends.sort()
        result[worker] = [b - a for a, b in zip([start_s, *ends[:-1]], ends, strict=True)]
    return result


def summarize(
    policy: str,
    lengths: Sequence[int],
    start_s: float,
    completions: Sequence[tuple[Completion, float]],
    num_workers: int,
) -> dict[str, Any]:
    """One burst's figures (the JSON record)."""
    busy = occupancies(start_s, completions)
    durations = [d for worker in busy.values() for d in worker]
    makespan_s = max(end for _, end in completions) - start_s
    offline_s = list_schedule_makespan_s(durations, num_workers)
    bound_s = makespan_lower_bound_s(durations, num_workers)
    tokens = defaultdict(int)
    for (completion, _), num_tokens in zip(completions, lengths, strict=True):
        tokens[completion.prefill_worker_id] += num_tokens
    ttfts = sorted(c.ttft_s for c, _ in completions)
    return {
        "policy": policy,
        "makespan_s": makespan_s,
        "offline_s": offline_s,
        "bound_s": bound_s,
        "balance": offline_s / makespan_s,
        "balance_vs_bound": bound_s / makespan_s,
        "busy_s_per_worker": {w: sum(d) for w, d in sorted(busy.items())},
        "requests_per_worker": {w: len(d) for w, d in sorted(busy.items())},
        "prompt_tokens_per_worker": dict(sorted(tokens.items())),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


async def burst(
    router: Router, lengths: Sequence[int], seed: int, tenant: str
) -> tuple[float, list[tuple[Completion, float]]]:
    """Send every prompt at once; (start, [(completion, end time)])."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]

    async def one(prompt: list[int]) -> tuple[Completion, float]:
        completion = await router.generate(token_ids=prompt, tenant=tenant, max_new_tokens=1)
        return completion, time.perf_counter()

    start_s = time.perf_counter()
    return start_s, list(await asyncio.gather(*(one(p) for p in prompts)))


async def measure(
    pool: WorkerPool, args: argparse.Namespace, console: Console
) -> list[dict[str, Any]]:
    addresses = pool.addresses("prefill"), pool.addresses("decode")
    async with Router(*addresses, policy="least-loaded") as warm:  # first-call costs
        for index in range(len(addresses[0])):
            await warm.generate(
                token_ids=[7] * 200, tenant="warm-up", max_new_tokens=1, request_id=f"w{index}"
            )
    records = []
    config = BalancerConfig(bucket_bounds_tokens=tuple(args.bucket_bounds))
    for round_index in range(args.rounds):
        lengths = prompt_lengths(
            args.num_requests,
            args.min_tokens,
            args.max_tokens,
            args.long_fraction,
            args.seed + round_index,
        )
        for policy in args.policies:
            async with Router(*addresses, policy=policy, balancer=config, timeout_s=3600) as router:
                tenant = f"bench-{policy}-{round_index}-{time.time_ns()}"
                start_s, completions = await burst(router, lengths, args.seed + round_index, tenant)
            record = summarize(policy, lengths, start_s, completions, len(addresses[0]))
            record["round"] = round_index
            records.append(record)
            balance, makespan_s = record["balance"], record["makespan_s"]
            console.print(
                f"round {round_index} {policy}: balance {balance:.2f}, makespan {makespan_s:.2f} s"
            )
    return records


def results_table(records: Sequence[dict[str, Any]]) -> Table:
    table = Table(title="prefill balance on a mixed-length burst (median over rounds)")
    for name in (
        "policy",
        "makespan s",
        "offline s",
        "bound s",
        "balance",
        "vs bound",
        "TTFT p50 s",
        "requests per worker",
    ):
        table.add_column(
            name, justify="left" if name in ("policy", "requests per worker") else "right"
        )
    for policy, rows in _by_policy(records).items():
        median = {
            k: statistics.median(r[k] for r in rows)
            for k in (
                "makespan_s",
                "offline_s",
                "bound_s",
                "balance",
                "balance_vs_bound",
                "ttft_p50_s",
            )
        }
        table.add_row(
            policy,
            f"{median['makespan_s']:.2f}",
            f"{median['offline_s']:.2f}",
            f"{median['bound_s']:.2f}",
            f"{median['balance']:.2f}",
            f"{median['balance_vs_bound']:.2f}",
            f"{median['ttft_p50_s']:.2f}",
            " / ".join(
                " ".join(f"{w} {n}" for w, n in r["requests_per_worker"].items()) for r in rows
            ),
        )
    return table


def _by_policy(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        grouped[record["policy"]].append(record)
    return grouped


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = sorted(set(names) - set(POLICIES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"policies {unknown or names}: choose from {POLICIES}")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore bench serve``."""
    _add_load_flags(parser)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--model", default="random:small", help="the workers' model")
    parser.add_argument("--num-requests", type=int, default=48, help="prompts per burst")
    parser.add_argument(
        "--prefill-workers",
        type=int,
        default=2,
        help="prefill worker processes",
    )
    parser.add_argument("--min-tokens", type=int, default=64, help="shortest prompt")
    parser.add_argument("--max-tokens", type=int, default=3968, help="longest prompt")
    parser.add_argument("--max-model-len", type=int, default=4096, help="the workers' context")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per policy, interleaved")
    parser.add_argument(
        "--policies",
        type=_policies,
        default=list(POLICIES),
        help="comma-separated routing policies",
    )
    parser.add_argument(
        "--bucket-bounds",
        type=list_arg(int),
        default=DEFAULT_BUCKET_BOUNDS,
        help="length buckets of the balancer",
    )
    parser.add_argument(
        "--calibration-tokens",
        default="64,512,2048,3968",
        help="the prefill workers' calibration lengths",
    )
    parser.add_argument(
        "--long-fraction", type=float, default=0.15, help="share of long prompts (max/2 to max)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--cluster", type=Path, help="use this running cluster (default: start a local 12-node one)"
    )


def _add_load_flags(parser: argparse.ArgumentParser) -> None:
    """The HTTP front's load runs (serve_load.py)."""
    parser.add_argument(
        "--flood",
        type=int,
        default=0,
        help="send this many chat requests at once to kvstore serve (its defaults) instead "
        "of the balance bursts; 0: no flood",
    )
    parser.add_argument(
        "--flood-max-tokens", type=int, default=16, help="max_tokens of each flood request"
    )
    parser.add_argument(
        "--slow-sockets",
        type=int,
        default=0,
        help="open this many slow clients (half never finish their headers, half send a body "
        "at one byte a second) against kvstore serve while normal requests go on; 0: none",
    )
    parser.add_argument(
        "--probe-interval-s", type=float, default=1.0, help="flood: /health probes this often"
    )
    parser.add_argument(
        "--drop-after-first-token",
        type=int,
        default=0,
        help="streamed requests each hung up 0-50 ms after its first token, probed for a "
        "wedge every 50 (bench/serve_drops.py); 0: none",
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help="extra kvstore serve flags for the load runs, e.g. '--max-waiting-requests 8' "
        "(default: none, serve's defaults)",
    )


def run(args: argparse.Namespace) -> int:
    """Start the cluster and workers, run the bursts, print the table, write JSON."""
    if args.flood or args.slow_sockets or args.drop_after_first_token:
        return run_load(args)
    console = Console(width=None if sys.stdout.isatty() else 140)
    work_dir = Path(tempfile.mkdtemp(prefix="kvstore-bench-serve-"))
    worker_args = ["--max-model-len", str(args.max_model_len), "--fetch-policy", "always"]
    worker_args += ["--calibration-tokens", args.calibration_tokens]
    with contextlib.ExitStack() as stack:
        cluster_toml = args.cluster
        if cluster_toml is None:
            cluster = stack.enter_context(
                LocalCluster.start(work_dir / "cluster", num_nodes=12, fsync=False)
            )
            cluster_toml = cluster.cluster_toml
        with console.status("starting workers (calibrating the prefill workers)..."):
            pool = stack.enter_context(
                WorkerPool.start(
                    cluster_toml,
                    work_dir / "serve",
                    num_prefill=args.prefill_workers,
                    num_decode=1,
                    model=args.model,
                    worker_args=worker_args,
                )
            )
        records = asyncio.run(measure(pool, args, console))
    shutil.rmtree(work_dir, ignore_errors=True)  # kept only when the run failed (its logs)
    console.print(results_table(records))
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "records": records,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def run_load(args: argparse.Namespace) -> int:
    """``--flood`` and ``--slow-sockets`` against a real ``kvstore serve`` (serve_load.py)."""
    import shlex
    import signal

    from bench import serve_load

    console = Console(width=None if sys.stdout.isatty() else 140)
    work_dir = Path(tempfile.mkdtemp(prefix="kvstore-bench-serve-load-"))
    serve_args = shlex.split(args.serve_args)
    report: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v)
                                         for k, v in vars(args).items()},
                              "load_average_start": serve_load.load_average()}  # fmt: skip
    with contextlib.ExitStack() as stack:
        cluster_toml = args.cluster
        if cluster_toml is None:
            cluster = stack.enter_context(
                LocalCluster.start(work_dir / "cluster", num_nodes=12, fsync=False)
            )
            cluster_toml = cluster.cluster_toml
        with console.status("starting kvstore serve (its workers load the model)..."):
            proc, base_url = serve_load.start_serve(
                str(cluster_toml), str(work_dir / "serve"), serve_args
            )
        stack.callback(_stop, proc, signal.SIGTERM)
        console.print(f"kvstore serve at {base_url} (log: {work_dir / 'serve' / 'serve.log'})")
        report.update(asyncio.run(_load_runs(args, base_url, serve_args, console)))
    report["load_average_end"] = serve_load.load_average()
    console.print(load_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.json}")
    flood_ok = report.get("flood", {}).get("contract_met", True)
    slow_ok = report.get("slow_sockets", {}).get("all_closed", True)
    no_wedge = not report.get("drops", {}).get("wedges", 0)
    if flood_ok and slow_ok and no_wedge:
        shutil.rmtree(work_dir, ignore_errors=True)
        return 0
    console.print(f"kept {work_dir} (the cluster's and serve's logs)")
    return 1


async def _load_runs(
    args: argparse.Namespace, base_url: str, serve_args: list[str], console: Console
) -> dict[str, Any]:
    from bench import serve_load

    model = await serve_load.served_model(base_url)
    warm = await serve_load.warm_up(base_url, model)
    result: dict[str, Any] = {"model": model, "single_request_s": warm}
    if args.flood:
        console.print(f"flood: {args.flood} chat requests at once (max_tokens "
                      f"{args.flood_max_tokens})...")  # fmt: skip
        result["flood"] = await serve_load.flood(
            base_url, model, args.flood, args.flood_max_tokens,
            deadline_s=serve_load.flag_value(serve_args, "--request-timeout-s",
                                             serve_load.DEFAULT_TIMEOUT_S),
            probe_interval_s=args.probe_interval_s, seed=args.seed,
        )  # fmt: skip
    if args.slow_sockets:
        console.print(f"slow sockets: {args.slow_sockets} slow clients and normal requests...")
        limits = serve_load.limits_of(serve_args)
        result["slow_sockets"] = await serve_load.slow_sockets(
            base_url, model, args.slow_sockets, limits
        )
    if args.drop_after_first_token:
        from bench import serve_drops

        console.print(f"{args.drop_after_first_token} requests dropped after their first token...")
        result["drops"] = await serve_drops.drops(
            base_url, model, args.drop_after_first_token, seed=args.seed
        )
    return result


def _stop(proc: Any, sig: int) -> None:
    import subprocess

    proc.send_signal(sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def load_table(report: dict[str, Any]) -> Table:
    """The load runs' figures, one row each."""
    table = Table(title="kvstore serve under load")
    table.add_column("run", justify="left")
    table.add_column("figures", justify="left")
    if "flood" in report:
        flood = report["flood"]
        ok = "met" if flood["contract_met"] else "MISSED"
        table.add_row(
            f"flood of {flood['num_requests']}",
            f"statuses {flood['status_counts']}, codes {flood['code_counts']}; late "
            f"{flood['num_late']}, 504s {flood['num_504']}; /health agreement "
            f"{flood['health_agreement_ratio']:.2f} of {flood['health_probes']}; contract {ok}",
        )
    if "slow_sockets" in report:
        slow = report["slow_sockets"]
        ok = "yes" if slow["all_closed_within_timeout_plus_2s"] else "NO"
        table.add_row(
            f"{slow['num_sockets']} slow sockets",
            f"closed by the server {slow['num_closed_by_server']}, at most "
            f"{slow['closed_after_timeout_s'].get('max', 0):.1f} s after their timeout (all in "
            f"time: {ok}); normal request p50 {slow['normal_latency_before_s']['p50']:.2f} s "
            f"before, {slow['normal_latency_during_s']['p50']:.2f} s during (ratio "
            f"{slow['normal_latency_ratio_p50']:.2f})",
        )
    if "drops" in report:
        drops = report["drops"]
        table.add_row(
            f"{drops['tries']} drops after the first token",
            f"{drops['dropped_after_first_token']} saw a token before the hang-up; wedges "
            f"{drops['wedges']} in {drops['probes']} probes (probe p50 {drops['probe_p50_s']} s)",
        )
    return table
