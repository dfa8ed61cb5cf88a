"""Capacity planning: what a TTL x capacity setting costs in SSDs, nodes and bandwidth.

Pure arithmetic over ``kvstore sim`` records (``ttl.sweep.result_records``) and plain numbers;
``kvstore plan`` (``bench/plan_cli.py``) fills ``TierConfig`` from ``cluster.toml`` and flags.

Per record (one traffic class, or ``all``, at one grid point), with ``B`` KV bytes per block
(``block_tokens x bytes_per_token``), ``k + m`` shards per block, ``P`` the peak resident blocks
and ``X`` the traffic scale (``--scale``: ``X`` independent copies of the trace's traffic, so
footprint, bandwidth and tokens saved scale by ``X``, hit ratios do not)::

    shard payload   s = ceil(B / k)                     (the codec pads the last data shard)
    on disk/shard   s + shard header (48) + segment record header (72)
    logical         X P B                                the KV bytes the setting keeps
    + erasure       X P (k+m) s - logical                parity and padding (10+2: x1.2)
    + headers       X P (k+m) (48 + 72)
    + index         X P (k+m) index_bytes_per_shard       lmdb on the same drives
    + expiry slack  X (expired blocks / s) W (k+m) (s + 120)  expired shards wait for their
                                                         segment's window W to pass
    = stored        and then the watermark headroom:
    raw             stored / high_watermark  without a capacity limit (never reach eviction)
                    stored / low_watermark   with one (eviction brings a node down to low)

Bandwidth at the storage nodes: a hit block reads ``read_fanout`` shards (the read asks k+1
nodes by default and uses the first k), a written block (every block after the prefix hit:
the engine writes back what it computed) writes ``k + m``; mean over the counted window, peak
over the busiest ``rate_window_s`` (the busy hour by default). Nodes: enough drives for
``raw``, enough node bandwidth for the peaks, and at least one placement group (``k + m``).
Cost: ``raw TB x usd_per_tb_month``. Marginal cost
per point of hit ratio: along each class's cost frontier (settings sorted by cost, keeping only
those that hit better than every cheaper one), the extra cost over the next cheaper setting
divided by the token-hit-ratio points it buys; dominated settings get none.

Not counted: carry-forward copies of refreshed blocks and compaction after eviction (brief
extra writes), the OS and filesystem reserve, replacement spares.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Record = dict[str, Any]
TB = 1e12  # drives are sold in decimal terabytes
GB = 1e9
DAY_S = 86_400.0
SHARD_HEADER_BYTES = 48  # erasure.shard.HEADER_BYTES
# kvstore/store/segments.py record format 2: 60 bytes plus the class and tenant names (72 for
# "chat" and an 8-byte tenant; ttl may not import kvstore).
RECORD_HEADER_BYTES = 72
# lmdb bytes per shard entry on a node: the entry and its expiry, access, by-segment and
# by-group keys in B-tree pages, plus the pages lmdb's copy-on-write keeps free. `kvstore bench
# index` measures it with the node's own index (docs/runs/plan/plan_index_bytes.json).
DEFAULT_INDEX_BYTES_PER_SHARD = 582.0

# KV bytes per token of well-known models. DeepSeek V4.1-Flash: DeepSeek's published global KV
# figure; the Llama-style layouts are 2 (K and V) x layers x KV heads x head dim x dtype bytes.
DTYPE_BYTES = {"fp32": 4.0, "float32": 4.0, "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0,
               "float16": 2.0, "fp8": 1.0, "int8": 1.0, "fp4": 0.5}  # fmt: skip
_LAYOUT_RE = re.compile(r"^(\d+)x(\d+)x(\d+)x([a-z0-9]+)$")


def llama_kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: str
) -> float:
    """K and V of every layer for one token: ``2 x layers x KV heads x head dim x dtype``."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"KV dtype {dtype!r}: choose one of {', '.join(DTYPE_BYTES)}")
    if min(num_layers, num_kv_heads, head_dim) < 1:
        raise ValueError("layers, KV heads and head dim must all be >= 1")
    return 2.0 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


MODEL_PRESETS: dict[str, float] = {
    "deepseek-v4.1-flash": 890.0,
    "llama-3.1-8b-bf16": llama_kv_bytes_per_token(32, 8, 128, "bf16"),
    "llama-3.1-70b-bf16": llama_kv_bytes_per_token(80, 8, 128, "bf16"),
    "qwen2.5-7b-bf16": llama_kv_bytes_per_token(28, 4, 128, "bf16"),
    "smollm2-135m-fp32": llama_kv_bytes_per_token(30, 3, 64, "fp32"),
}


def parse_bytes_per_token(text: str) -> float:
    """``"890"``, a preset (``MODEL_PRESETS``) or a layout ``LAYERSxKV_HEADSxHEAD_DIMxDTYPE``
    (``32x8x128xbf16``) -> KV bytes per token."""
    value = text.strip().lower()
    if value in MODEL_PRESETS:
        return MODEL_PRESETS[value]
    layout = _LAYOUT_RE.match(value)
    if layout:
        layers, heads, dim, dtype = layout.groups()
        return llama_kv_bytes_per_token(int(layers), int(heads), int(dim), dtype)
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not number > 0 or math.isinf(number):
        raise ValueError(
            f"--bytes-per-token {text!r}: give a number (890), a preset "
            f"({', '.join(MODEL_PRESETS)}) or a layout LAYERSxKV_HEADSxHEAD_DIMxDTYPE "
            "(32x8x128xbf16)"
        )
    return number


@dataclass(frozen=True)
class TierConfig:
    """The storage tier a plan sizes: coding, on-disk overheads, nodes and prices."""

    data_shards: int = 10
    parity_shards: int = 2
    read_fanout: int = 11  # shards a read asks for (cluster.toml [client] read_fanout)
    expiry_window_s: float = 3600.0
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    drive_bytes: float = 15.36e12
    drives_per_node: int = 16
    node_read_bytes_per_s: float = 40e9
    node_write_bytes_per_s: float = 20e9
    usd_per_tb_month: float | None = None
    index_bytes_per_shard: float = DEFAULT_INDEX_BYTES_PER_SHARD
    # Share of the nodes' space the cluster fills before its first node evicts: 1.0 when
    # placement follows the byte limits (ttl/cluster_fill.py usable_fraction).
    usable_fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.data_shards < 1 or self.parity_shards < 0:
            raise ValueError(f"need k >= 1 and m >= 0, got {self.data_shards}+{self.parity_shards}")
        if not self.data_shards <= self.read_fanout <= self.width:
            raise ValueError(
                f"read fanout {self.read_fanout} must be in [k={self.data_shards}, "
                f"k+m={self.width}]"
            )
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark < high_watermark <= 1 (cluster.toml [node])")
        positive = {
            "expiry window": self.expiry_window_s,
            "drive size": self.drive_bytes,
            "drives per node": self.drives_per_node,
            "node read bandwidth": self.node_read_bytes_per_s,
            "node write bandwidth": self.node_write_bytes_per_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.usd_per_tb_month is not None and self.usd_per_tb_month < 0:
            raise ValueError(f"usd per TB-month must be >= 0, got {self.usd_per_tb_month}")
        if not 0 < self.usable_fraction <= 1:
            raise ValueError(f"usable fraction must be in (0, 1], got {self.usable_fraction}")
        if self.index_bytes_per_shard < 0:
            raise ValueError(
                f"index bytes per shard must be >= 0, got {self.index_bytes_per_shard}"
            )

    @property
    def width(self) -> int:
        return self.data_shards + self.parity_shards

    @property
    def node_bytes(self) -> float:
        return self.drive_bytes * self.drives_per_node


@dataclass(frozen=True)
class BlockBytes:
    """Bytes one KV block costs in the tier: as stored, as read on a hit, as written."""

    block_bytes: float
    shard_payload_bytes: int
    disk_bytes_per_shard: int  # payload + shard header + segment record header

    @classmethod
    def of(cls, block_bytes: float, tier: TierConfig) -> BlockBytes:
        payload = math.ceil(block_bytes / tier.data_shards)
        return cls(block_bytes, payload, payload + SHARD_HEADER_BYTES + RECORD_HEADER_BYTES)

    def coded_bytes(self, tier: TierConfig) -> int:
        return tier.width * self.shard_payload_bytes

    def disk_bytes(self, tier: TierConfig) -> int:
        return tier.width * self.disk_bytes_per_shard

    def read_bytes(self, tier: TierConfig) -> int:
        return tier.read_fanout * self.disk_bytes_per_shard


_NEEDED_KEYS = (
    *("traffic_class", "policy", "capacity_blocks", "block_tokens", "window_s", "peak_blocks"),
    *("expired_blocks", "hit_blocks", "written_blocks", "tokens_saved"),
    *("peak_hit_blocks_per_s", "peak_written_blocks_per_s"),
)


def plan_record(record: Record, bytes_per_token: float, tier: TierConfig, scale: float) -> Record:
    """The plan of one simulation record (module docstring: the arithmetic)."""
    if not scale > 0:
        raise ValueError(f"traffic scale must be > 0, got {scale}")
    missing = [key for key in _NEEDED_KEYS if key not in record]
    if missing:
        raise ValueError(
            f"simulation record lacks {', '.join(missing)}: it comes from an older kvstore sim; "
            "run kvstore sim again (or give kvstore plan the trace and grid)"
        )
    sizes = BlockBytes.of(record["block_tokens"] * bytes_per_token, tier)
    window_s = record["window_s"]
    peak = scale * record["peak_blocks"]
    logical = peak * sizes.block_bytes
    items = {
        "logical_tb": logical,
        "erasure_tb": peak * sizes.coded_bytes(tier) - logical,
        "headers_tb": peak * tier.width * (SHARD_HEADER_BYTES + RECORD_HEADER_BYTES),
        "index_tb": peak * tier.width * tier.index_bytes_per_shard,
        "expiry_slack_tb": _per_s(scale * record["expired_blocks"], window_s)
        * tier.expiry_window_s
        * sizes.disk_bytes(tier),
    }
    stored = sum(items.values())
    watermark = tier.high_watermark if record["capacity_blocks"] is None else tier.low_watermark
    raw = stored / watermark
    items["watermark_tb"] = raw - stored
    rates = _rates(record, sizes, tier, scale)
    nodes = _nodes(raw, rates, tier)
    usd = None if tier.usd_per_tb_month is None else raw / TB * tier.usd_per_tb_month
    saved_per_day = _per_s(scale * record["tokens_saved"], window_s) * DAY_S
    return {
        **{key: record.get(key) for key in _SIM_KEYS},
        **{name: value / TB for name, value in items.items()},
        "raw_tb": raw / TB,
        "watermark": watermark,
        **nodes,
        **{name: value / GB for name, value in rates.items()},
        "usd_per_month": usd,
        "prefill_tokens_saved_per_day": saved_per_day,
        "bytes_per_token": bytes_per_token,
        "block_bytes": sizes.block_bytes,
        "scale": scale,
    }


_SIM_KEYS = (
    *("traffic_class", "ttl_s", "ttl_label", "ttl_by_class", "capacity_blocks"),
    *("capacity_label", "policy", "token_hit_ratio", "block_hit_ratio", "requests"),
)


def _per_s(count: float, window_s: float) -> float:
    return count / window_s if window_s > 0 else 0.0


def _rates(record: Record, sizes: BlockBytes, tier: TierConfig, scale: float) -> dict[str, float]:
    """Bytes per second at the storage nodes: peak (the contract fields) and mean."""
    read, write = scale * sizes.read_bytes(tier), scale * sizes.disk_bytes(tier)
    window_s = record["window_s"]
    return {
        "read_gb_per_s": read * record["peak_hit_blocks_per_s"],
        "write_gb_per_s": write * record["peak_written_blocks_per_s"],
        "mean_read_gb_per_s": read * _per_s(record["hit_blocks"], window_s),
        "mean_write_gb_per_s": write * _per_s(record["written_blocks"], window_s),
    }


def _nodes(raw_bytes: float, rates: dict[str, float], tier: TierConfig) -> dict[str, Any]:
    """Nodes for capacity, for peak reads, for peak writes, and one placement group."""
    need = {
        "capacity": math.ceil(raw_bytes / (tier.node_bytes * tier.usable_fraction)),
        "read": math.ceil(rates["read_gb_per_s"] / tier.node_read_bytes_per_s),
        "write": math.ceil(rates["write_gb_per_s"] / tier.node_write_bytes_per_s),
        "group": tier.width,
    }
    bound_by = max(need, key=lambda name: need[name])
    return {
        "nodes": need[bound_by],
        "nodes_bound_by": bound_by,
        **{f"nodes_for_{name}": count for name, count in need.items() if name != "group"},
    }


def plan_records(
    records: Iterable[Record], bytes_per_token: float, tier: TierConfig, scale: float = 1.0
) -> list[Record]:
    """Plan every record, then add the marginal cost per point of hit ratio per class."""
    planned = [plan_record(r, bytes_per_token, tier, scale) for r in records]
    add_marginal_costs(planned)
    return planned


def parse_count(text: str) -> float:
    """``"155T"`` -> 1.55e14: a count with an optional k, M, G, T or P (powers of 1000)."""
    value = text.strip()
    factor = _COUNT_SUFFIXES.get(value[-1:].upper(), 1.0) if value else 1.0
    digits = value[:-1] if factor != 1.0 else value
    try:
        number = float(digits) * factor
    except ValueError:
        number = math.nan
    if not number > 0 or math.isinf(number):
        raise ValueError(f"bad count {text!r}: a positive number with k, M, G, T or P, e.g. 155T")
    return number


_COUNT_SUFFIXES = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def scale_for_tokens_per_day(records: Sequence[Record], tokens_per_day: float) -> float:
    """The ``--scale`` that makes the trace's input tokens per day ``tokens_per_day``."""
    totals = [r for r in records if r["traffic_class"] == "all" and r["window_s"] > 0]
    if not totals:
        raise ValueError("the simulation has no counted window: cannot scale to tokens per day")
    trace_per_day = totals[0]["input_tokens"] / totals[0]["window_s"] * DAY_S
    if not trace_per_day > 0:
        raise ValueError("the trace's counted window has no input tokens to scale")
    return tokens_per_day / trace_per_day


def add_marginal_costs(planned: list[Record]) -> None:
    """Set ``marginal_raw_tb_per_point`` (and ``marginal_usd_per_point`` when priced) and
    ``dominated`` on each record, along its class's cost frontier (module docstring)."""
    by_class: dict[tuple, list[Record]] = {}
    for record in planned:
        by_class.setdefault((record["traffic_class"], record["policy"]), []).append(record)
    for rows in by_class.values():
        ordered = sorted(rows, key=lambda r: (r["raw_tb"], -_hit_points(r)))
        best: Record | None = None
        for record in ordered:
            dominated = best is not None and _hit_points(record) <= _hit_points(best)
            record["dominated"] = dominated
            record["marginal_raw_tb_per_point"] = record["marginal_usd_per_point"] = None
            if best is not None and not dominated:
                points = _hit_points(record) - _hit_points(best)
                record["marginal_raw_tb_per_point"] = (record["raw_tb"] - best["raw_tb"]) / points
                if record["usd_per_month"] is not None:
                    extra_usd = record["usd_per_month"] - best["usd_per_month"]
                    record["marginal_usd_per_point"] = extra_usd / points
            if not dominated:
                best = record


def _hit_points(record: Record) -> float:
    ratio = record["token_hit_ratio"]
    return -math.inf if ratio is None else 100.0 * ratio
