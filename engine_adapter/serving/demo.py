"""``kvstore demo``: the main job. Serve a small chat and agent workload through the store.

::

    kvstore demo [--cluster DIR/cluster.toml] [--json PATH] [--model default]
                 [--max-new-tokens 16] [--store-transport grpc|auto|ucx]

Starts a local 12-node cluster (unless ``--cluster`` names a running one), two prefill
workers and one decode worker, then replays a multi-turn workload through the router: a
support chat whose users share one system prompt, an agent whose history grows with tool
results, a user of a second tenant (same system prompt, but tenants never share KV) and a
user who comes back later. Requests alternate between the prefill workers (no prefix
affinity), so most prefixes one worker writes are hit by the other. For each request it
prints the traffic class, prompt / cached / computed tokens, time to first token, the
prefill worker and the generated text; then a summary. Everything it started is stopped on
exit, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from deploy.local_cluster import LocalCluster
from engine_adapter.config import add_store_transport_argument
from engine_adapter.serving.request_api import Completion
from engine_adapter.serving.router import Router
from engine_adapter.serving.worker_pool import WorkerPool, cancel_on_signals
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.signals import sigterm_as_interrupt
from kvstore.cli.tables import make_console
from kvstore.errors import KVStoreError

log = logging.getLogger(__name__)

SUPPORT_SYSTEM = (
    "You are the support assistant of Acme Cloud, a hosting company. Answer in one or two "
    "short sentences. Be precise and friendly. Facts you may use: Acme Cloud runs data centres "
    "in Frankfurt, Virginia and Singapore. API keys are created and rotated in the console "
    "under Settings, then Security; old keys keep working for 24 hours after a rotation. "
    "Backups run every night at 02:00 UTC and are kept for 30 days. The free plan includes "
    "one small virtual machine and 10 GB of storage; paid plans start at 12 euros a month. "
    "Support is open around the clock by chat and by email at help@acme.example. Invoices are "
    "sent on the first day of each month and can be paid by card or bank transfer within 14 "
    "days. Virtual machines can be resized in the console without losing data, but resizing "
    "restarts the machine. Object storage is billed per gigabyte stored and per gigabyte sent "
    "out of our network; traffic between our data centres is free. Two-factor authentication "
    "is available for every account and required for accounts with more than five members. "
    "Never share one customer's data with another customer, and never invent features we do "
    "not offer."
)
AGENT_SYSTEM = (
    "You are a deployment agent for Acme Cloud. You fix failed deployments by calling tools. "
    "Reply with exactly one tool call per turn, as JSON on one line, or with DONE and a short "
    "summary when the task is finished. Tools: get_logs(deploy_id) returns the last log lines "
    "of a deployment; get_config(service) returns the service configuration as YAML; "
    "set_config(service, key, value) changes one configuration key; redeploy(service) starts "
    "a new deployment and returns its id; get_status(deploy_id) returns queued, running, "
    "failed or healthy; rollback(service, deploy_id) returns the service to an earlier "
    "deployment; list_deploys(service) returns the ten most recent deployments with their "
    "status and author. Always read the logs before you change anything, change as little as "
    "possible, and check the status after every redeploy. Never change more than one key per "
    "turn. If a redeploy fails twice, roll back to the last healthy deployment and report "
    "DONE with what you tried. Ports below 1024 need root, which services do not have; the "
    "default port for web services is 8080. Secrets are never printed in full: show only "
    "their last four characters."
)


@dataclass
class Step:
    """One request of the workload: who sends what, in which conversation."""

    conversation: str
    tenant: str
    traffic_class: str
    message: dict[str, str]


@dataclass
class Conversation:
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _tool(text: str) -> dict[str, str]:
    return {"role": "tool", "content": text}


# (conversation, tenant, traffic class, the new message). Conversations named agent* use
# AGENT_SYSTEM, the others SUPPORT_SYSTEM.
WORKLOAD: list[Step] = [
    Step("alice", "acme", "chat", _user("How do I rotate my API keys?")),
    Step("bob", "acme", "chat", _user("Which regions can I deploy to?")),
    Step("agent-1", "acme", "agent", _user("Deployment 4812 of the web service failed. Fix it.")),
    Step("alice", "acme", "chat", _user("Will my old key stop working right away?")),
    Step(
        "agent-1",
        "acme",
        "agent",
        _tool("get_logs(4812): ERROR listen tcp :80: bind: permission denied; exit code 1"),
    ),
    Step("bob", "acme", "chat", _user("How long are backups kept?")),
    Step("carol", "globex", "chat", _user("How do I rotate my API keys?")),
    Step(
        "agent-1",
        "acme",
        "agent",
        _tool("set_config(web, port, 8080): ok. redeploy(web): deployment 4813 queued"),
    ),
    Step("agent-2", "acme", "agent", _user("Deployment 977 of the billing worker is stuck.")),
    Step("carol", "globex", "chat", _user("And what does the free plan include?")),
    Step("alice", "acme", "chat", _user("Thanks. One more thing: when do backups run?")),
]


@dataclass
class Row:
    """One request's line of the transcript (and of ``--json``)."""

    index: int
    conversation: str
    tenant: str
    traffic_class: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_s: float
    prefill_worker: str
    decode_worker: str
    swapped_tokens: int  # prompt KV the decode worker read from the store
    text: str


async def replay(router: Router, steps: Sequence[Step], max_new_tokens: int) -> AsyncIterator[Row]:
    """Send the workload's requests one after another; histories grow with the replies."""
    conversations: dict[str, Conversation] = {}
    for index, step in enumerate(steps):
        system = AGENT_SYSTEM if step.conversation.startswith("agent") else SUPPORT_SYSTEM
        conversation = conversations.setdefault(step.conversation, Conversation(system))
        conversation.messages.append(step.message)
        messages = [{"role": "system", "content": system}, *conversation.messages]
        completion = await router.generate(
            messages=messages,
            tenant=step.tenant,
            traffic_class=step.traffic_class,
            max_new_tokens=max_new_tokens,
        )
        conversation.messages.append({"role": "assistant", "content": completion.text})
        yield _row(index, step, completion)


async def warm_up(router: Router) -> None:
    """One request per prefill worker, two blocks long, under tenant "warmup" (it shares no
    blocks with the workload): first-call costs (connections, allocations, the first
    full-block forward, the first write-back) stay out of the TTFTs shown."""
    message = {"role": "user", "content": " ".join(["warm-up"] * 60)}
    for _ in router.prefill.workers:
        await router.generate(messages=[message], tenant="warmup", max_new_tokens=2)


def _row(index: int, step: Step, completion: Completion) -> Row:
    return Row(
        index=index,
        conversation=step.conversation,
        tenant=step.tenant,
        traffic_class=step.traffic_class,
        prompt_tokens=completion.num_prompt_tokens,
        cached_tokens=completion.num_cached_tokens,
        computed_tokens=completion.num_computed_tokens,
        ttft_s=completion.ttft_s,
        prefill_worker=completion.prefill_worker_id,
        decode_worker=completion.decode_worker_id,
        swapped_tokens=completion.num_swapped_tokens,
        text=completion.text,
    )


def summarize(rows: Sequence[Row], wall_s: float) -> dict[str, Any]:
    """The ``summary`` object: token hit ratio and TTFT of cold vs cached requests."""
    prompt_tokens = sum(r.prompt_tokens for r in rows)
    cached_tokens = sum(r.cached_tokens for r in rows)
    cold = [r.ttft_s for r in rows if r.cached_tokens == 0]
    cached = [r.ttft_s for r in rows if r.cached_tokens > 0]
    workers = sorted({r.prefill_worker for r in rows})
    return {
        "requests": len(rows),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "computed_tokens": prompt_tokens - cached_tokens,
        "token_hit_ratio": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "requests_with_hits": len(cached),
        "ttft_cold_s": statistics.mean(cold) if cold else None,
        "ttft_cached_s": statistics.mean(cached) if cached else None,
        "requests_per_prefill_worker": {
            w: sum(r.prefill_worker == w for r in rows) for w in workers
        },
        "hits_per_prefill_worker": {
            w: sum(r.prefill_worker == w and r.cached_tokens > 0 for r in rows) for w in workers
        },
        "wall_s": wall_s,
    }


def transcript_table(rows: Sequence[Row]) -> Table:
    table = Table(title="kvstore demo: 2 prefill workers, 1 decode worker, KV through the store")
    for name, justify in [
        ("#", "right"),
        ("conversation", "left"),
        ("class", "left"),
        ("prompt", "right"),
        ("cached", "right"),
        ("computed", "right"),
        ("TTFT ms", "right"),
        ("prefill", "left"),
        ("generated text", "left"),
    ]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            str(r.index),
            f"{r.conversation} ({r.tenant})",
            r.traffic_class,
            str(r.prompt_tokens),
            str(r.cached_tokens),
            str(r.computed_tokens),
            f"{r.ttft_s * 1000:.0f}",
            r.prefill_worker,
            r.text.replace("\n", " "),
        )
    return table


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.0f} ms"

    console.print(
        f"{summary['requests']} requests, {summary['prompt_tokens']} prompt tokens, "
        f"{summary['cached_tokens']} served from the store: token hit ratio "
        f"{summary['token_hit_ratio']:.1%}; {summary['requests_with_hits']} requests hit"
    )
    console.print(
        f"time to first token: cold {ms(summary['ttft_cold_s'])}, "
        f"cached {ms(summary['ttft_cached_s'])} (mean); prefill requests (hits) per worker: "
        + ", ".join(
            f"{w} {n} ({summary['hits_per_prefill_worker'][w]})"
            for w, n in summary["requests_per_prefill_worker"].items()
        )
        + f"; wall {summary['wall_s']:.1f} s"
    )


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore demo``."""
    parser.add_argument("--cluster", type=Path, help="use this running cluster (cluster.toml)")
    parser.add_argument("--json", type=Path, help="write the rows and the summary here")
    parser.add_argument("--model", default="default", help="default, random:<size>, .gguf, dir")
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, help="tokens generated per request"
    )
    parser.add_argument("--dir", type=Path, help="work directory (default: a temporary one)")
    add_store_transport_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Run the demo; everything started here is stopped before returning."""
    console = make_console()
    start_s = time.perf_counter()
    work_dir = args.dir or Path(tempfile.mkdtemp(prefix="kvstore-demo-"))
    cluster_toml = args.cluster or work_dir / "cluster" / "cluster.toml"
    try:
        with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            rows = _run_workload(console, stack, args, work_dir, cluster_toml)
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("\ninterrupted: workers and nodes stopped")
        return 130
    except (KVStoreError, ValueError) as exc:
        console.print(f"error: {exc}\n(logs under {work_dir})")
        return 1
    summary = summarize(rows, time.perf_counter() - start_s)
    print_summary(console, summary)
    if args.json:
        payload = {"rows": [asdict(r) for r in rows], "summary": summary}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def _run_workload(
    console: Console,
    stack: contextlib.ExitStack,
    args: argparse.Namespace,
    work_dir: Path,
    cluster_toml: Path,
) -> list[Row]:
    """Start workers (and the cluster while they load), replay the workload, show rows."""
    starting = "starting 2 prefill + 1 decode workers (loading the model)..."
    if not console.is_terminal:  # a status spinner shows nothing in a log or a pipe
        console.print(starting)
    with console.status(starting):
        pool = stack.enter_context(
            WorkerPool.spawn_all(
                cluster_toml,
                work_dir / "serve",
                2,
                1,
                args.model,
                ["--store-transport", args.store_transport],
            )
        )
        if args.cluster is None:
            stack.enter_context(LocalCluster.start(cluster_toml.parent, num_nodes=12))
            console.print(f"12 storage nodes serving (10+2 erasure code): {cluster_toml}")
        pool.wait_ready()
    console.print(
        f"workers ready: {pool.pids()} (logs: {work_dir / 'serve' / 'logs'}); "
        "one warm-up request per prefill worker, not shown"
    )
    return asyncio.run(_replay_live(console, pool, args.max_new_tokens))


async def _replay_live(console: Console, pool: WorkerPool, max_new_tokens: int) -> list[Row]:
    cancel_on_signals()
    rows: list[Row] = []
    # Least-loaded rotates between idle workers, so prefixes one worker wrote are hit by the
    # other: what the demo is about. (`balanced` would send these one-at-a-time requests to
    # whichever worker its cost model finds faster.)
    addresses = pool.addresses("prefill"), pool.addresses("decode")
    async with Router(*addresses, policy="least-loaded") as router:
        await warm_up(router)
        # Off a terminal the live table shows only at the end: progress lines say how far.
        with (
            Live(transcript_table(rows), console=console, auto_refresh=False) as live,
            ProgressReporter(
                "demo requests", len(WORKLOAD), enabled=not console.is_terminal
            ) as progress,
        ):
            async for row in replay(router, WORKLOAD, max_new_tokens):
                rows.append(row)
                live.update(transcript_table(rows), refresh=True)
                progress.advance()
    console.print()
    return rows
