"""The records of ``kvstore bench swapin`` (bench/swapin_bench.py has what each field means):
one per transport and KV format, made from what its runner measured, compared across formats,
and the table printed from them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.table import Table

from bench.common import percentile_ms
from client import KVClient

if TYPE_CHECKING:
    from bench.swapin_bench import Bench, Runner

GB = 1e9


@dataclass
class Record:
    """One transport's figures over the measured rounds."""

    transport: str
    device: str
    dtype: str
    block_bytes: int
    num_blocks: int
    concurrency: int
    rounds: int
    gb_per_s: float  # into the host buffer pool
    cache_gb_per_s: float  # through to the paged KV cache (device memory on CUDA)
    p50_ms: float  # per block: its chunk's land_batch
    p99_ms: float
    gb_per_s_rounds: list[float]
    bytes_verified: bool
    num_verified_blocks: int
    incomplete_fetches: list[str]  # fetches that delivered fewer blocks than stored
    ucx_counters: dict[str, int] | None
    local_counters: dict[str, int] | None = None  # transport local/auto: the local channel
    client_cpu_s_per_gb: float = 0.0  # this process, over the measured fetches and swap-ins
    nodes_cpu_s_per_gb: float = 0.0  # the local cluster's node processes, the same spans
    # The part of nodes_cpu_s_per_gb the nodes burn idle anyway (config's
    # nodes_idle_cpu_cores over the same spans): the rest is the reads' own.
    nodes_idle_cpu_s_per_gb: float = 0.0
    stages_ms: dict[str, float] = field(default_factory=dict)  # one fetch, medians
    transport_used: str = ""  # what answered most node requests: local, ucx or grpc
    # The median round's fetch, span by span (client/read_timeline.py): lane, what, ms.
    timeline: list[dict[str, Any]] = field(default_factory=list)
    kv_format: str = ""  # what the blocks hold: the compute dtype, or e4m3x16
    kv_bytes_per_token: int = 0  # stored bytes of one token's KV, all layers
    tokens_per_s: float = 0.0  # tokens through to the paged KV cache, median over rounds
    tokens_per_s_vs_dtype: float = 0.0  # e4m3x16: tokens_per_s over the dtype record's


def ucx_counters(kv: KVClient, path: str = "ucx") -> dict[str, int] | None:
    """The client's UCX (or ``path="local"``: local channel) counters, None without that
    path, whatever counters it keeps."""
    counters = getattr(getattr(kv, path, None), "counters", None)
    if counters is None:
        return None
    return {name: value for name, value in vars(counters).items() if isinstance(value, int)}


def counters_delta(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, int] | None:
    if after is None:
        return None
    return {name: value - (before or {}).get(name, 0) for name, value in after.items()}


def make_record(bench: Bench, runner: Runner) -> Record:
    args, layout = bench.args, bench.layout
    rounds = [b / s / GB for b, s in zip(runner.fetched_bytes, runner.fetch_s, strict=True)]
    to_cache = [b / s / GB for b, s in zip(runner.fetched_bytes, runner.cache_s, strict=True)]
    after = ucx_counters(runner.kv)
    local_after = ucx_counters(runner.kv, "local")
    fetched_gb = sum(runner.fetched_bytes) / GB
    tokens = [
        b / layout.block_bytes * layout.block_tokens / s
        for b, s in zip(runner.fetched_bytes, runner.cache_s, strict=True)
    ]
    return Record(
        transport=runner.transport,
        device=str(bench.device),
        dtype=layout.dtype,
        block_bytes=layout.block_bytes,
        num_blocks=args.num_blocks,
        concurrency=args.concurrency,
        rounds=len(rounds),
        gb_per_s=statistics.median(rounds),
        cache_gb_per_s=statistics.median(to_cache),
        p50_ms=percentile_ms(runner.block_fetch_s, 50),
        p99_ms=percentile_ms(runner.block_fetch_s, 99),
        gb_per_s_rounds=rounds,
        bytes_verified=runner.num_verified > 0 and runner.num_mismatched == 0,
        num_verified_blocks=runner.num_verified,
        incomplete_fetches=runner.incomplete,
        ucx_counters=counters_delta(runner.ucx_before, after),
        local_counters=counters_delta(runner.local_before, local_after),
        client_cpu_s_per_gb=runner.client_cpu_s / fetched_gb if fetched_gb else 0.0,
        nodes_cpu_s_per_gb=runner.nodes_cpu_s / fetched_gb if fetched_gb else 0.0,
        nodes_idle_cpu_s_per_gb=(
            bench.nodes_idle_cpu_cores * runner.span_s / fetched_gb if fetched_gb else 0.0
        ),
        stages_ms={
            name: 1000 * statistics.median(stage.get(name, 0.0) for stage in runner.stages_s)
            for name in (runner.stages_s[0] if runner.stages_s else {})
        },
        transport_used=transport_used(runner.kv),
        timeline=median_timeline(runner),
        kv_format=layout.stored_format,
        kv_bytes_per_token=layout.bytes_per_token,
        tokens_per_s=statistics.median(tokens),
    )


def median_timeline(runner: Runner) -> list[dict[str, Any]]:
    """The spans of the round whose fetch took the median time."""
    if not runner.timelines:
        return []
    order = sorted(range(len(runner.fetch_s)), key=lambda i: runner.fetch_s[i])
    return runner.timelines[order[len(order) // 2]].rows()


def transport_used(kv: KVClient) -> str:
    """What answered most of the client's node requests: local, ucx or grpc."""
    counts = kv.replies_by_transport()
    return max(counts, key=lambda name: counts[name])


def compare_formats(records: list[Record]) -> None:
    """Each quantised record's tokens/s over the dtype record's of the same transport."""
    baseline = {r.transport: r.tokens_per_s for r in records if r.kv_format != "e4m3x16"}
    for record in records:
        if record.kv_format == "e4m3x16" and baseline.get(record.transport):
            record.tokens_per_s_vs_dtype = record.tokens_per_s / baseline[record.transport]


def results_table(records: list[Record], title: str) -> Table:
    table = Table(title=title)
    for name in ["transport", "format", "block", "blocks", "conc", "host GB/s", "cache GB/s"]:
        table.add_column(name, justify="right")
    for name in ["p50 ms", "p99 ms", "gather/decode/wait ms", "CPU s/GB client/nodes (idle)"]:
        table.add_column(name, justify="right")
    table.add_column("tokens/s (x dtype)", justify="right")
    table.add_column("verified", justify="right")
    table.add_column("UCX replies/shards/inline/fallback", justify="right")
    for r in records:
        ucx = r.ucx_counters or {}
        shards = "/".join(
            str(ucx.get(name, "-"))
            for name in ("num_ucx_replies", "num_ucx_shards", "num_inline_shards", "num_fallbacks")
        )
        stages = "/".join(
            f"{r.stages_ms.get(name, 0.0):.0f}" for name in ("gather", "decode", "swap_in_wait")
        )
        table.add_row(
            r.transport if r.transport != "auto" else f"auto ({r.transport_used})",
            r.kv_format,
            f"{r.block_bytes:,}",
            str(r.num_blocks),
            str(r.concurrency),
            f"{r.gb_per_s:.2f}",
            f"{r.cache_gb_per_s:.2f}",
            f"{r.p50_ms:.1f}",
            f"{r.p99_ms:.1f}",
            stages,
            f"{r.client_cpu_s_per_gb:.2f}/{r.nodes_cpu_s_per_gb:.2f} "
            f"({r.nodes_idle_cpu_s_per_gb:.2f})",
            f"{r.tokens_per_s:,.0f}"
            + (f" ({r.tokens_per_s_vs_dtype:.2f}x)" if r.tokens_per_s_vs_dtype else ""),
            f"yes ({r.num_verified_blocks})" if r.bytes_verified else "NO",
            shards if r.ucx_counters is not None else "-",
        )
    return table
