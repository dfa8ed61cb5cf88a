"""``kvstore bench swapin``: GB/s of cached KV blocks into the engine's buffer pool, per transport.

::

    kvstore bench swapin [--json PATH] [--transport auto] [--cluster DIR/cluster.toml]
        [--model random:135m] [--block-tokens 64] [--dtype float32|bfloat16]
        [--num-blocks 64] [--concurrency 128] [--chunk-blocks 32] [--rounds 5]
        [--device cpu|cuda[:N]] [--timeline-png PATH]
        [--kv-format dtype|e4m3x16|dtype,e4m3x16]
        [--nodes 12] [--no-fsync]

It measures the engine's own fetch path, with no model forward around it. Per transport one
``StoreConnector`` (``EngineConfig(store_transport=...)``, fetch policy "always", a long
deadline) over one paged KV cache of the model's KV layout; a ``random:<size>`` preset only
sets that layout (``random:135m`` is SmolLM2's, the default model's: 2,949,120-byte blocks in
fp32 at 64 tokens). ``--num-blocks`` blocks of seeded random bytes are put once under the
keys the engine derives for a prompt. Then every round runs each transport once, the order
alternating between rounds so that drift from other load hits both alike (after one unmeasured
warm-up each: connections, UCX endpoints). One measurement is ``connector.fetch_prefix``:
``land_batch`` of the blocks in chunks of ``--chunk-blocks`` into slots of the connector's
fetch pool (the client's ``LandingPool``, registered with CUDA: over the local channel each
node writes its data shards straight into the slots), ``--concurrency`` blocks in flight,
each block's host-to-device copy starting on the swap-in side stream as soon as its data
shards are all in place (CUDA); then the swap-in into the paged KV cache runs to its end
(CUDA: synchronize; CPU: every layer placed, as compute would place it). The default
transport is ``auto``: the local channel to this host's nodes.

- ``gb_per_s``: fetched bytes / ``fetch_s`` (every block landed in the host pool and
  verified), median over rounds. 10**9 bytes per GB.
- ``cache_gb_per_s``: fetched bytes / time until the blocks are in the paged KV cache (device
  memory on CUDA); median over rounds.
- ``p50_ms``/``p99_ms``: the ``land_batch`` time of each block's chunk, all rounds pooled.
- ``timeline``: the median round's fetch span by span (client/read_timeline.py: per node its
  request, the node's own read and the client's landing of it; the client's waits, tallies,
  block checks, stop, decode, then the swap-in), ms from the fetch's start; ``--timeline-png``
  draws it.
- ``stages_ms``: where one fetch's time goes, medians over rounds: ``gather`` (node answers
  arriving and tallied: the nodes' reads and the landing), ``stop`` (cancelling what was
  still out), ``decode`` (the block checksum pass, and any parity rebuild), summed over the
  fetch's chunks (chunks overlap, so these can add up to more than the fetch),
  ``swap_in_wait`` (after the fetch, until the KV cache holds every block), and the timeline's
  sums (ReadTimeline.stages_ms: first send to last answer, the median node's read, the
  client's waits, tallies and checks summed).
- ``limits``: the same bytes in the same run, copied from a pinned host buffer to the device
  (``pinned_h2d_gb_per_s``, CUDA) and by one host memcpy (``host_copy_gb_per_s``): the
  ceilings the fetch is measured against; with the stream transport, the same bytes over
  ``--nodes`` loopback TCP connections at once (``loopback_tcp_gb_per_s``, bench/limits.py).
- ``kv_format``: what the blocks hold (the compute dtype, or e4m3x16: FP8 with a scale per 16
  values, dequantised into the cache by the swap-in); ``kv_bytes_per_token``: stored bytes of
  one token's KV; ``tokens_per_s``: tokens through to the paged KV cache per second, median
  over rounds (the figure that compares formats). ``--kv-format`` takes a comma-separated
  list, measured interleaved in one run; a list without ``dtype`` gets it added as the
  baseline, and each e4m3x16 record's ``tokens_per_s_vs_dtype`` is its ratio to it. An
  e4m3x16 run stores seeded normal KV values, quantised (random bytes would hold NaN scales).
- ``codec`` (with e4m3x16): this process's CPU seconds to quantise and to dequantise the
  bench's blocks as bf16 KV on ``--device``, per GB of bf16 KV (medians of ``--rounds``),
  beside one thread's copy of the same bytes (``memcpy_cpu_s_per_gb``); ``kernel``: the
  codec that ran (e4m3x16_native.KERNEL, or ``torch``).
- After every fetch a sample of blocks (first, last and random ones) is checked in its host
  slot and in the KV cache against xxh3-128 of what was written (``bytes_verified``).
- ``client_cpu_s_per_gb``: this process's CPU seconds (every thread: event loop, receiver
  threads, decode pool, CUDA copies) per fetched GB, over each fetch and its swap-in, the
  sample check not counted; ``nodes_cpu_s_per_gb``: the local cluster's node processes' CPU
  seconds per GB over the same spans (0 with ``--cluster``: their processes are not ours);
  ``nodes_idle_cpu_s_per_gb`` the part of it the nodes burn idle anyway (``config``'s
  ``nodes_idle_cpu_cores``, measured for a second before the rounds, over the same spans).
- ``ucx_counters``: the client's UCX counters over the measured rounds (transport ucx/auto);
  ``local_counters``: its local-channel counters (transport local/auto: ``num_placed`` are
  payloads the nodes wrote into the pool themselves); ``transport_used``: what answered the
  node requests (``local``, ``ucx`` or ``grpc``: the one with the most answers).

"ucx" is skipped with a note when this client cannot use it (ucxx not importable, or no node
offers a UCX address it reaches). Without ``--cluster`` a local cluster is started around the
run as ``kvstore bench storage`` does (scrub off).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from bench.common import bench_cluster, process_cpu_s, transport_list
from bench.limits import copy_limits, loopback_tcp_gb_per_s
from bench.swapin_report import (
    GB,
    Record,
    compare_formats,
    make_record,
    results_table,
    ucx_counters,
)
from client import KVClient
from client.read_timeline import CLIENT, ReadTimeline
from engine_adapter import e4m3x16_native, kv_format, weights
from engine_adapter.config import KV_FORMATS, STORE_TRANSPORTS, EngineConfig
from engine_adapter.connector import FetchOutcome, StoreConnector
from engine_adapter.engine import freeze_startup_heap
from engine_adapter.kv_layout import KVBlockLayout
from engine_adapter.paged_kv import BlockTable, PagedKVCache
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.tables import make_console, print_fitted
from kvstore.errors import InvalidArgument, KVStoreError

NUM_SAMPLED = 8  # blocks verified after each fetch (first, last and random ones)
PUT_CONCURRENCY = 8


@dataclass
class Runner:
    """One transport's connector and what its fetches measured."""

    transport: str
    connector: StoreConnector
    kv: KVClient  # the connector's client for the bench's tenant
    fetch_s: list[float] = field(default_factory=list)
    cache_s: list[float] = field(default_factory=list)
    stages_s: list[dict[str, float]] = field(default_factory=list)
    timelines: list[ReadTimeline] = field(default_factory=list)
    fetched_bytes: list[int] = field(default_factory=list)
    block_fetch_s: list[float] = field(default_factory=list)
    num_verified: int = 0
    num_mismatched: int = 0
    incomplete: list[str] = field(default_factory=list)
    ucx_before: dict[str, int] | None = None
    local_before: dict[str, int] | None = None
    client_cpu_s: float = 0.0
    nodes_cpu_s: float = 0.0
    span_s: float = 0.0  # the measured fetches and swap-ins, summed


class Bench:
    """The stored blocks and one runner per transport over one paged KV cache."""

    def __init__(self, args: argparse.Namespace, layout: KVBlockLayout) -> None:
        self.args, self.layout = args, layout
        self.device = torch.device(args.device)
        self.cache = PagedKVCache(layout, args.num_blocks, self.device)
        self.table = BlockTable(layout.block_tokens, list(range(args.num_blocks)))
        self.namespace = layout.namespace(f"swapin-bench-{args.model}")
        self.tenant = f"swapin-{time.time_ns():x}"  # fresh keys on a reused cluster
        # One more token than the blocks hold: the engine always computes the last token.
        self.token_ids = list(range(args.num_blocks * layout.block_tokens + 1))
        self.digests: list[bytes] = []
        self.runners: list[Runner] = []
        self.notes: list[str] = []
        self._check = torch.empty(layout.shape, dtype=getattr(torch, layout.dtype))
        self._rng = random.Random(args.seed)
        self.node_pids: list[int] = []  # the local cluster's nodes, for their CPU seconds
        self.nodes_idle_cpu_cores = 0.0  # what they burn with no requests

    def engine_config(self, transport: str) -> EngineConfig:
        return EngineConfig(
            block_tokens=self.layout.block_tokens,
            prefill_chunk_tokens=self.layout.block_tokens,
            device=self.args.device,
            dtype=self.layout.dtype,
            kv_format=self.layout.kv_format,
            max_num_seqs=1,
            fetch_policy="always",
            fetch_deadline_s=self.args.deadline_s,
            fetch_concurrency=self.args.concurrency,
            fetch_chunk_blocks=self.args.chunk_blocks,
            write_back=False,
            store_transport=transport,
        )

    async def open(self, cluster_toml: Path) -> None:
        """A connector per usable transport, then the blocks written once."""
        for transport in self.args.transport:
            config = self.engine_config(transport)
            connector = StoreConnector(
                cluster_toml, self.cache, self.namespace, config, self.args.num_blocks
            )
            try:
                kv = await connector.client(self.tenant)  # connects now: "ucx" may not work
            except KVStoreError as exc:
                self.notes.append(f"{transport} skipped: {exc}")
                await connector.close()
                continue
            self.runners.append(Runner(transport, connector, kv))
        if self.runners:
            await self._write_blocks(self.runners[0].kv)

    async def _write_blocks(self, kv: KVClient) -> None:
        keys = self.keys()
        gate = asyncio.Semaphore(PUT_CONCURRENCY)
        blocks = self._blocks(len(keys))
        self.digests = [xxhash.xxh3_128_digest(block) for block in blocks]

        async def put(key: bytes, block: bytes) -> None:
            async with gate:
                await kv.put(key, block, traffic_class="chat")

        await asyncio.gather(*(put(k, b) for k, b in zip(keys, blocks, strict=True)))

    def _blocks(self, num_blocks: int) -> list[bytes]:
        """Seeded block contents: random bytes, or e4m3x16 blocks of normal KV values."""
        if not self.layout.quantized:
            rng = np.random.default_rng(self.args.seed)
            return [rng.bytes(self.layout.block_bytes) for _ in range(num_blocks)]
        generator = torch.Generator().manual_seed(self.args.seed)
        out = torch.empty(self.layout.num_layers, self.layout.layer_bytes, dtype=torch.uint8)
        blocks = []
        for _ in range(num_blocks):
            kv_format.encode_block(torch.randn(self.layout.shape, generator=generator), out)
            blocks.append(out.numpy().tobytes())
        return blocks

    def keys(self) -> list[bytes]:
        return self.runners[0].connector.keys(self.token_ids, self.tenant)

    async def fetch(self, runner: Runner, label: str, measured: bool) -> None:
        """One fetch into the pool and swap-in to its end; verify a sample, release the slots."""
        keys = self.keys()
        cpu_before = time.process_time(), self._nodes_cpu_s()
        times_before = dataclasses.replace(runner.kv.read_times)
        timeline = runner.kv.timeline = ReadTimeline()
        started = time.perf_counter()
        outcome = await runner.connector.fetch_prefix(keys, self.table, len(keys), self.tenant)
        fetched_at, fetched_ns = time.perf_counter(), time.monotonic_ns()
        self._finish_swap_in(outcome)
        cache_s = time.perf_counter() - started
        runner.kv.timeline = None
        timeline.add(CLIENT, "fetch", timeline.start_ns, fetched_ns)
        timeline.add(CLIENT, "swap-in", fetched_ns)
        client_cpu_s = time.process_time() - cpu_before[0]
        nodes_cpu_s = self._nodes_cpu_s() - cpu_before[1]
        try:
            self._verify(runner, outcome)
        finally:
            runner.connector.release(outcome)
        if outcome.num_fetched_blocks < len(keys):
            runner.incomplete.append(
                f"{label}: {outcome.num_fetched_blocks}/{len(keys)} blocks "
                f"({outcome.fallback or f'lookup matched {outcome.num_matched_blocks}'})"
            )
        if measured:
            runner.fetch_s.append(outcome.fetch_s)
            runner.cache_s.append(cache_s)
            times = runner.kv.read_times
            runner.stages_s.append(
                {
                    "gather": times.gather_s - times_before.gather_s,
                    "stop": times.stop_s - times_before.stop_s,
                    "decode": times.decode_s - times_before.decode_s,
                    "swap_in_wait": time.perf_counter() - fetched_at,
                    **{name: ms / 1000 for name, ms in timeline.stages_ms().items()},
                }
            )
            runner.timelines.append(timeline)
            runner.fetched_bytes.append(outcome.num_fetched_blocks * self.layout.block_bytes)
            runner.block_fetch_s += outcome.block_fetch_s
            runner.client_cpu_s += client_cpu_s
            runner.nodes_cpu_s += nodes_cpu_s
            runner.span_s += cache_s

    def _nodes_cpu_s(self) -> float:
        return sum(process_cpu_s(pid) for pid in self.node_pids)

    def _finish_swap_in(self, outcome: FetchOutcome) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:  # the CPU path places each layer right before compute needs it
            for layer in range(self.layout.num_layers):
                outcome.swap_in.before_layer(layer)

    def _verify(self, runner: Runner, outcome: FetchOutcome) -> None:
        """Sampled blocks, in their host slots and in the KV cache, against what was written."""
        num = outcome.num_fetched_blocks
        if num == 0:
            return
        others = self._rng.sample(range(num), min(NUM_SAMPLED - 2, num))
        for index in sorted({0, num - 1, *others}):
            host_ok = xxhash.xxh3_128_digest(outcome.slots[index].view) == self.digests[index]
            self.cache.save_block(self.table.block_ids[index], self._check)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.layout.quantized:  # the cache holds the dequantised block
                values, scales = kv_format.split_layer(
                    outcome.slots[index].block, self.layout.part_shape
                )
                want = kv_format.dequantize(values, scales, torch.empty_like(self._check))
                cache_ok = torch.equal(self._check, want)
            else:
                cached = self._check.view(torch.uint8).numpy()
                cache_ok = xxhash.xxh3_128_digest(cached) == self.digests[index]
            runner.num_verified += 1
            runner.num_mismatched += not (host_ok and cache_ok)

    async def close(self) -> None:
        for runner in self.runners:
            await runner.connector.close()


def layout_for(args: argparse.Namespace, kv_format_name: str = "dtype") -> KVBlockLayout:
    if not args.model.startswith("random:"):
        raise InvalidArgument(
            f"--model {args.model!r}: give a random:<size> preset; only its KV layout matters "
            "here (random:135m has the default model's)"
        )
    cfg = weights.random_config(args.model.removeprefix("random:"))
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return KVBlockLayout.for_model(cfg, args.block_tokens, dtype, kv_format_name)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    formats = kv_formats(args.kv_format)
    benches = [Bench(args, layout_for(args, name)) for name in formats]
    layout = benches[0].layout  # the first format's, for the limits and the config
    load_before = os.getloadavg()[0]
    with bench_cluster(args) as (cluster_toml, cluster):
        try:
            for swapin in benches:
                if cluster is not None:
                    swapin.node_pids = [proc.pid for proc in cluster.procs.values()]
                await swapin.open(cluster_toml)
            nodes_idle_cpu = await nodes_idle_cpu_cores(benches[0].node_pids)
            for swapin in benches:
                swapin.nodes_idle_cpu_cores = nodes_idle_cpu
            freeze_startup_heap()  # as a serving worker does once it is up
            await measure(benches)
            records = [make_record(b, runner) for b in benches for runner in b.runners]
        finally:
            for swapin in benches:
                await swapin.close()
    compare_formats(records)
    codec = [codec_cpu_s_per_gb(b.layout, args) for b in benches if b.layout.quantized]
    num_bytes = args.num_blocks * layout.block_bytes
    limits = copy_limits(num_bytes, torch.device(args.device), args.rounds)
    if "stream" in args.transport:
        limits["loopback_tcp_gb_per_s"] = loopback_tcp_gb_per_s(num_bytes, args.nodes, args.rounds)
    return {
        "limits": limits,
        "config": {
            "model": args.model,
            "kv_shape": list(layout.shape),
            "block_bytes": layout.block_bytes,
            "device": args.device,
            "dtype": layout.dtype,
            "kv_formats": [b.layout.stored_format for b in benches],
            "num_blocks": args.num_blocks,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "cluster": str(args.cluster) if args.cluster else f"local, {args.nodes} nodes",
            "fsync": not args.no_fsync,
            "cpus": os.cpu_count(),
            "nodes_idle_cpu_cores": swapin.nodes_idle_cpu_cores,
            "load_average_1m_before_after": [load_before, os.getloadavg()[0]],
        },
        "results": [asdict(record) for record in records],
        "notes": [note for b in benches for note in b.notes],
        "codec": codec[0] if codec else {},
    }


async def nodes_idle_cpu_cores(pids: list[int], seconds: float = 1.0) -> float:
    """What the node processes burn with no requests (their background loops), in cores."""
    if not pids:
        return 0.0
    before_s = sum(process_cpu_s(pid) for pid in pids)
    await asyncio.sleep(seconds)
    return round((sum(process_cpu_s(pid) for pid in pids) - before_s) / seconds, 3)


def codec_cpu_s_per_gb(layout: KVBlockLayout, args: argparse.Namespace) -> dict[str, Any]:
    """CPU seconds (this process, every thread) to quantise the bench's blocks as bf16 KV on
    ``--device`` into block buffers (as the write-back does into host slots), and to
    dequantise them back, per GB of that bf16 KV, beside one thread's copy of the same bf16
    bytes (``memcpy``: what a single pass over them costs) in the same rounds: medians of
    ``--rounds``. The C codec's steps run back to back, as in use (one thread: nothing spins
    after them); the torch codec's each wait for its intra-op threads to stop spinning (a
    few ms of CPU after a parallel op), counted to the step that left them."""
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.num_blocks, *layout.shape)  # [n, L, P, H, T, D]
    kv = torch.randn(shape, generator=generator).to(device, torch.bfloat16)
    out = torch.empty_like(kv)
    blocks = torch.empty((*shape[:2], layout.layer_bytes), dtype=torch.uint8, device=device)
    gb = kv.numel() * 2 / GB
    steps = {
        "quantize": lambda: kv_format.encode_block(kv, blocks),
        "dequantize": lambda: kv_format.decode_layer(blocks, layout.part_shape, out),
        "memcpy": lambda: _one_thread_copy(out, kv),
    }
    native = e4m3x16_native.usable(kv)
    settle_s = 0.0 if native else SETTLE_S  # a sleep would let others evict our caches
    time.sleep(SETTLE_S)  # until the threads that made kv stop spinning
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds + 1):  # the first is a warm-up
        for name, step in steps.items():
            seconds[name].append(_step_cpu_s(step, device, settle_s))
    per_gb = {name: statistics.median(s[1:]) / gb for name, s in seconds.items()}
    return {
        "bf16_gb": gb,
        "kernel": e4m3x16_native.KERNEL if native else "torch",
        "quantize_cpu_s_per_gb": per_gb["quantize"],
        "dequantize_cpu_s_per_gb": per_gb["dequantize"],
        "cpu_s_per_gb": per_gb["quantize"] + per_gb["dequantize"],
        "memcpy_cpu_s_per_gb": per_gb["memcpy"],
    }


def _one_thread_copy(out: torch.Tensor, source: torch.Tensor) -> None:
    """``out.copy_(source)`` on one thread (a plain memcpy) where both are dense host tensors."""
    if out.device.type == "cpu" and out.is_contiguous() and source.is_contiguous():
        ctypes.memmove(out.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
    else:
        out.copy_(source)


SETTLE_S = 0.05  # libgomp's workers spin for a few ms after a parallel op before they sleep


def _step_cpu_s(step: Callable[[], object], device: torch.device, settle_s: float) -> float:
    """This process's CPU seconds over ``step`` and what its threads spin ``settle_s`` after."""
    start = time.process_time()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    time.sleep(settle_s)
    return time.process_time() - start


def kv_formats(text: str) -> list[str]:
    """``--kv-format``'s list, with the dtype baseline first (added when missing)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in KV_FORMATS:
            raise InvalidArgument(f"--kv-format {name!r}: choose from {KV_FORMATS}")
    return ["dtype", *(name for name in dict.fromkeys(names) if name != "dtype")]


async def measure(benches: list[Bench]) -> None:
    """A warm-up fetch per transport and format, then rounds with the order alternating
    (A B, B A, ...)."""
    pairs = [(bench, runner) for bench in benches for runner in bench.runners]
    for bench, runner in pairs:
        await bench.fetch(runner, "warm-up", measured=False)
        runner.ucx_before = ucx_counters(runner.kv)
        runner.local_before = ucx_counters(runner.kv, "local")
    rounds = benches[0].args.rounds
    with ProgressReporter("swap-in", rounds * len(pairs)) as progress:
        for round_index in range(rounds):
            order = pairs if round_index % 2 == 0 else pairs[::-1]
            for bench, runner in order:
                await bench.fetch(runner, f"round {round_index}", measured=True)
                progress.advance()


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore bench swapin``."""
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--transport",
        type=transport_list(STORE_TRANSPORTS),
        default=["auto"],
        help="store transports to measure in one run, interleaved (default auto: the local "
        "channel to this host's nodes)",
    )
    parser.add_argument("--cluster", type=Path, default=None, help="DIR/cluster.toml")
    parser.add_argument("--nodes", type=int, default=12, help="nodes of the local cluster")
    parser.add_argument(
        "--backend", choices=["isal", "zfec"], default="isal", help="erasure code backend"
    )
    parser.add_argument("--no-fsync", action="store_true", help="local cluster without fsync")
    parser.add_argument(
        "--model", default="random:135m", help="random:<size>: the KV layout (default SmolLM2's)"
    )
    parser.add_argument(
        "--block-tokens", type=int, default=64, help="tokens per KV block (the store's block)"
    )
    parser.add_argument(
        "--dtype", default=None, help="KV dtype (default: float32 on CPU, bfloat16 on CUDA)"
    )
    parser.add_argument(
        "--kv-format",
        default="dtype",
        help="stored block formats, comma-separated: dtype (raw values of --dtype), e4m3x16 "
        "(FP8 with a bf16 scale per 16 values); dtype is always measured as the baseline",
    )
    parser.add_argument("--num-blocks", type=_positive, default=64, help="blocks per fetch")
    parser.add_argument(
        "--concurrency",
        type=_positive,
        default=EngineConfig.fetch_concurrency,
        help="blocks in flight per fetch",
    )
    parser.add_argument(
        "--chunk-blocks",
        type=_positive,
        default=EngineConfig.fetch_chunk_blocks,
        help="blocks per get_batch_into call",
    )
    parser.add_argument("--rounds", type=_positive, default=5, help="measured fetches each")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="fetch deadline")
    parser.add_argument("--seed", type=int, default=0, help="seed of the blocks' contents")
    parser.add_argument(
        "--timeline-png",
        type=Path,
        default=None,
        help="draw each transport's median fetch, stage by stage, into this PNG (matplotlib)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write JSON; 1 if a block was wrong or missing."""
    report = asyncio.run(bench(args))
    records = [Record(**r) for r in report["results"]]
    config = report["config"]
    console = make_console()
    title = (
        f"swap-in into the engine's buffer pool: {config['model']} {config['dtype']}, "
        f"{config['cluster']}"
    )
    print_fitted(results_table(records, title), console)
    limits = ", ".join(f"{name} {value:.2f}" for name, value in report["limits"].items())
    console.print(f"limits, the same bytes in this run: {limits}")
    if report["codec"]:
        codec = report["codec"]
        console.print(
            f"e4m3x16 codec ({codec['kernel']}), bf16 KV: quantise "
            f"{codec['quantize_cpu_s_per_gb']:.3f} + dequantise "
            f"{codec['dequantize_cpu_s_per_gb']:.3f} = {codec['cpu_s_per_gb']:.3f} CPU-s per GB "
            f"(a copy of the same bytes: {codec['memcpy_cpu_s_per_gb']:.3f})"
        )
    for note in report["notes"]:
        console.print(f"note: {note}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.json}")
    if args.timeline_png and records:
        from bench.timeline_plot import plot_timelines  # matplotlib: only when asked

        plot_timelines(records, title, args.timeline_png)
        console.print(f"wrote {args.timeline_png}")
    ok = all(r.bytes_verified and not r.incomplete_fetches for r in records)
    return 0 if records and ok else 1
