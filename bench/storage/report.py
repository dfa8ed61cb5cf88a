"""``kvstore bench storage``'s records and what is read from them: the per-setting results
table, the ratios per setting, and each side's best setting against the other's (the
"best of each" rows, with the issue's targets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from ttl.units import size_label


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
    # CPU seconds per GB moved; None (JSON null) where no byte moved, cpu_s_per_gb_none says why.
    client_cpu_s_per_gb: float | None = 0.0  # the client process's
    server_cpu_s_per_gb: float | None = 0.0  # the nodes' (or redis-server's)
    total_cpu_s_per_gb: float | None = 0.0  # client + servers: what a GB costs the machine
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
    cpu_s_per_gb_by_side: dict[str, float | None] = field(default_factory=dict)
    # Why the CPU-per-GB fields are None ("" when they are figures): a quotient by zero bytes
    # would be an absurd figure that a table or a ratio passes on as if it were measured.
    cpu_s_per_gb_none: str = ""


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
            _figure(r.client_cpu_s_per_gb),
            _figure(r.server_cpu_s_per_gb),
            f"{r.server_idle_cpu_s_per_gb:.2f}",
            _figure(r.total_cpu_s_per_gb),
            f"{r.load_avg_1m:.1f}",
        )
    return table


def _figure(value: float | None) -> str:
    """A CPU-per-GB cell: "-" where the record has none (no byte moved)."""
    return "-" if value is None else f"{value:.2f}"


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
GET_MB_TARGETS = {"grpc": 1.0, "stream": 1.0, "ucx": 2.0, "local": 1.5, "local+pool": 1.5}
PUT_MB_TARGET = 1.0
IDLE_NODES_TARGET_CORES = 0.05  # twelve idle nodes together (issue 37)
CPU_TARGETS = {"get": 2.0, "put": 3.0}
GET_CPU_TARGETS = {"ucx": 1.5}  # issue 37: UCX at most 1.5x Redis's CPU per GB, others 2x


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
    calm = [r for r in calm if r.total_cpu_s_per_gb is not None]  # None: no byte moved
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
        "cpu_target": _cpu_target(op, transport) if mb_target is not None else None,
    }


def _cpu_target(op: str, transport: str) -> float:
    return GET_CPU_TARGETS.get(transport, CPU_TARGETS[op]) if op == "get" else CPU_TARGETS[op]


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
