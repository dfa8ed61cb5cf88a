"""``kvstore bench engine``: time to first token (TTFT), cold vs cached, and how close to ideal.

::

    kvstore bench engine --json PATH [--model default|random:<size>|PATH] [--device cpu|cuda]
        [--prompt-lengths 1024,4096,8192] [--cached-fractions 0,0.5,0.9,1.0]
        [--cluster DIR/cluster.toml] [--repeats 3] [--block-tokens 64] [--chunk-tokens N]
        [--fetch-policy always|cost] [--fetch-deadline-s 10] [--fetch-chunk-blocks 64]
        [--store-transport auto|local|ucx|grpc] [--plot PNG]

Without ``--cluster`` a 12-node local cluster is started in a temporary directory (fsync off:
only reads are timed) and stopped at the end. For each prompt length L (seeded random token
ids; capped at the model's context length, with a line saying so: ``random:1b-long`` has
Llama-3.2-1B's 128k context for 32k and 64k prompts):

- ``ttft_cold_s``: prefill of the whole prompt with no store at all (median of repeats).
- For each cached fraction f, under a fresh tenant (so nothing else is cached): a seeding
  prefill of the first ``u`` full blocks writes them to the store, where ``u`` is what the
  cached prefill can use (f*L rounded down to whole blocks and chunks; at least one block is
  always recomputed). The seeding sequence stays in the engine; extending it by the rest of
  the prompt (no store) is ``suffix_compute_s``, the compute an ideal cache leaves.
- ``ttft_s``: cache-backed prefill of the whole prompt (fetch, swap-in, compute of the rest,
  first token), write-back off so repeats see the same cache. ``--fetch-policy always`` (the
  default, as the engine runs) swaps in whatever is cached; ``cost`` lets the cost model
  choose, computing the first blocks while it fetches the others where it predicts that is
  faster (``front_compute_s``).
- One untimed round warms up first; then runs are interleaved round by round (see ``Bench``)
  and reported as medians, with every run (``ttft_cold_s_runs``, ``ttft_s_runs``) and the
  spread of each, (max - min) / median; the 1-minute load average before and after goes into
  the JSON, since other processes skew wall time.
- ``speedup = ttft_cold_s / ttft_s``; ``free_cache_speedup = ttft_cold_s /
  suffix_compute_s``: what a cache that cost nothing at all would give (only the rest of the
  prompt computed), and ``of_free_cache = speedup / free_cache_speedup``: the store's own
  time counts against it. ``ideal_speedup = ttft_cold_s / (suffix_compute_s + fetch_s)`` and
  ``ratio_to_ideal`` are the older yardstick, which forgives the fetch time.
- ``fetch_gb_per_s``: bytes swapped in / fetch time; ``compute_tokens_per_s``: L / cold TTFT.
- The yardsticks (``bench/reference_prefill.py``), for GQA models: ``ttft_reference_cold_s``,
  transformers' ``LlamaForCausalLM`` (SDPA, logits for the last position only) with our
  weights, shape, dtype and device, timed cold in the same rounds as ours (median; every
  run in ``ttft_reference_cold_s_runs``); ``speedup_vs_reference = ttft_reference_cold_s /
  ttft_s``, what a user who would otherwise recompute sees. ``cold_tflops``: the prompt's
  FLOPs (``prefill_flops``) over our cold TTFT, and ``cold_mfu``: that over the matrix
  product rate measured at the start of the run (``config.matmul_tflops``: bf16 on GPU,
  fp32 on CPU, the engine's dtype). ``suffix_tokens_per_s``: computed tokens / suffix
  compute, beside ``reference_tokens_per_s``: L / reference cold TTFT.
  ``break_even_gb_per_s``: KV bytes per token x reference tokens/s, the swap-in rate at
  which fetching ties with the reference's recompute; the table prints it beside the
  measured fetch rate.
- Where a cached TTFT goes (medians): ``fetch_s`` (the fetch is the lookup: ``lookup_s`` is
  0), ``front_compute_s`` (blocks computed while it ran), ``compute_s`` (the forward pass of
  the rest, waiting for swapped-in layers included) and ``other_s`` (the remainder: key
  hashing, swap-in start, thread hand-offs; TTFT - max(fetch, front) - compute).
  ``place_s``: placing the fetched blocks into the paged KV cache, the e4m3x16 dequantise
  included: on CPU a part of ``compute_s``; on CUDA the copy stream's span, beside compute.
- ``limits``: the fetched bytes of the longest prompt copied from pinned host memory to the
  device (``pinned_h2d_gb_per_s``, CUDA) and by a host memcpy, in the same run (bench/limits.py);
  ``store_transport_used``: what answered the fetches (local, ucx or grpc).

Every cached run's first token is compared with the cold run's (``same_first_token``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.limits import copy_limits
from bench.reference_prefill import ReferencePrefill, matmul_tflops, prefill_flops
from deploy.local_cluster import LocalCluster
from engine_adapter.config import EngineConfig, add_kv_format_argument, add_store_transport_argument
from engine_adapter.engine import Engine, PrefillResult, Sequence, freeze_startup_heap
from engine_adapter.loader import load_model
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.tables import make_console, print_fitted

GB = 1e9
DEFAULT_LENGTHS = "1024,4096,8192"
DEFAULT_FRACTIONS = "0,0.5,0.9,1.0"


@dataclass
class Row:
    prompt_tokens: int
    cached_fraction: float  # requested
    cached_tokens: int  # actually swapped in
    computed_tokens: int
    ttft_s: float
    ttft_cold_s: float
    speedup: float
    free_cache_speedup: float  # cold / the rest's compute: a cache that costs nothing
    of_free_cache: float  # speedup / free_cache_speedup
    ideal_speedup: float
    ratio_to_ideal: float
    suffix_compute_s: float
    lookup_s: float
    fetch_s: float
    # Where a cached TTFT goes: max(fetch_s, front_compute_s) + compute_s (the rest's forward
    # pass, waiting for swapped-in layers included) + other_s (key hashing, swap-in start).
    compute_s: float
    other_s: float
    fetch_gb_per_s: float
    compute_tokens_per_s: float
    same_first_token: bool
    fallback: str | None
    repeats: int
    # Every timed run, and (max - min) / median of each: the spread of the repeats.
    ttft_cold_s_runs: list[float] = field(default_factory=list)
    ttft_s_runs: list[float] = field(default_factory=list)
    ttft_cold_spread: float = 0.0
    ttft_spread: float = 0.0
    front_compute_s: float = 0.0  # blocks computed from the front while the fetch ran
    place_s: float = 0.0  # fetched blocks into the KV cache, dequantise included
    kv_format: str = ""  # what the store holds: the compute dtype, or e4m3x16
    kv_bytes_per_token: int = 0  # stored bytes of one token's KV, all layers
    # The yardsticks (bench/reference_prefill.py): transformers' cold prefill of the same
    # prompt, timed in the same rounds, and our cold prefill's rate against the device's.
    ttft_reference_cold_s: float = 0.0  # 0 where there is no reference (MLA models)
    speedup_vs_reference: float = 0.0  # ttft_reference_cold_s / ttft_s
    ttft_reference_cold_s_runs: list[float] = field(default_factory=list)
    cold_tflops: float = 0.0  # prefill_flops of the prompt / ttft_cold_s
    cold_mfu: float = 0.0  # cold_tflops / the matmul rate measured in this run
    suffix_tokens_per_s: float = 0.0  # computed_tokens / suffix_compute_s
    reference_tokens_per_s: float = 0.0  # prompt_tokens / ttft_reference_cold_s
    # A swap-in at this rate ties with the reference's recompute: KV bytes per token x
    # reference tokens/s (fetch_gb_per_s beside it)
    break_even_gb_per_s: float = 0.0


@dataclass
class Setup:
    """One cached fraction of one prompt: its tenant and the stored prefix, held in the engine."""

    fraction: float
    tenant: str
    prefix: Sequence | None  # the seeding sequence (None when nothing is cached)
    suffix_compute_s: list[float] = field(default_factory=list)
    cached: list[PrefillResult] = field(default_factory=list)


class Bench:
    """One engine, one store, the measurements of one run.

    First one untimed round warms everything up (kernels, allocator, store connections and
    UCX endpoints, the cost model); then ``repeats`` rounds of interleaved runs (the
    yardsticks, our cold prefill and the reference's, then every fraction's suffix compute and
    cached prefill; the yardsticks last in every other round) so that load from other
    processes hits every measurement alike; each figure is the median of its repeats, and
    each row gives every run and their spread."""

    def __init__(
        self,
        engine: Engine,
        repeats: int,
        progress: ProgressReporter,
        reference: ReferencePrefill | None = None,
    ) -> None:
        self.engine, self.repeats = engine, repeats
        self.progress, self.reference = progress, reference
        self.run_id = f"{time.time_ns():x}"
        self.matmul_tflops = 0.0  # set by the caller: the device's rate in this run
        # The reference runs on one thread of its own, as the engine's model does
        self._reference_thread = ThreadPoolExecutor(1, thread_name_prefix="reference")

    async def prompt_rows(self, prompt: list[int], fractions: list[float]) -> list[Row]:
        setups = [await self._seed(prompt, fraction) for fraction in fractions]
        await self._prefill(prompt, use_cache=False)  # warm-up, untimed
        await self._reference_s(prompt)
        for setup in setups:
            if setup.prefix is not None:
                await self._suffix_compute_s(setup, prompt)
            await self._prefill(prompt, tenant=setup.tenant, write_back=False)
        cold, reference_s = list[PrefillResult](), list[float]()
        for repeat in range(self.repeats):
            # The yardsticks go first every other round: what ran before falls on all alike.
            if not repeat % 2:
                await self._yardsticks(prompt, repeat, cold, reference_s)
            for setup in setups:
                if setup.prefix is not None:  # nothing cached: the rest is the whole prompt
                    setup.suffix_compute_s.append(await self._suffix_compute_s(setup, prompt))
                setup.cached.append(
                    await self._prefill(prompt, tenant=setup.tenant, write_back=False)
                )
            if repeat % 2:
                await self._yardsticks(prompt, repeat, cold, reference_s)
            self.progress.advance()
        for setup in setups:
            if setup.prefix is not None:
                self.engine.release(setup.prefix)
        rows = [make_row(prompt, s, cold, self.engine) for s in setups]
        return [add_yardsticks(r, reference_s, self.matmul_tflops, self.engine) for r in rows]

    async def _reference_s(self, prompt: list[int]) -> float:
        """One cold prefill of ``prompt`` by the reference (0 without one)."""
        if self.reference is None:
            return 0.0
        loop = asyncio.get_running_loop()
        elapsed_s, _ = await loop.run_in_executor(self._reference_thread, self.reference, prompt)
        return elapsed_s

    async def _seed(self, prompt: list[int], fraction: float) -> Setup:
        """Store the blocks a cached prefill of ``prompt`` may use at ``fraction``."""
        tenant = f"bench-{self.run_id}-{len(prompt)}-{fraction}"
        num_blocks = self._usable_blocks(len(prompt), fraction)
        if num_blocks == 0:
            return Setup(fraction, tenant, None)
        prefix = prompt[: num_blocks * self.engine.config.block_tokens]
        reserve = len(prompt) - len(prefix)  # room for the suffix: consecutive blocks
        seeded = await self.engine.prefill(prefix, tenant=tenant, reserve_tokens=reserve)
        await self.engine.flush()
        return Setup(fraction, tenant, seeded.sequence)

    async def _yardsticks(
        self, prompt: list[int], repeat: int, cold: list[PrefillResult], reference_s: list[float]
    ) -> None:
        """One cold prefill of ours and one of the reference, in the order ``repeat`` says."""
        if repeat // 2 % 2:
            reference_s.append(await self._reference_s(prompt))
        cold.append(await self._prefill(prompt, use_cache=False))
        if not repeat // 2 % 2:
            reference_s.append(await self._reference_s(prompt))

    async def _suffix_compute_s(self, setup: Setup, prompt: list[int]) -> float:
        """Time to compute the uncached rest with the prefix already in the KV cache."""
        assert setup.prefix is not None
        num_prefix = len(setup.prefix.token_ids)
        started = time.perf_counter()
        await self.engine.extend(setup.prefix, prompt[num_prefix:])
        elapsed_s = time.perf_counter() - started
        self.engine.truncate(setup.prefix, num_prefix)
        return elapsed_s

    def _usable_blocks(self, num_tokens: int, fraction: float) -> int:
        config = self.engine.config
        wanted = min(
            int(fraction * num_tokens) // config.block_tokens,
            self.engine.num_usable_blocks(num_tokens),
        )
        return wanted // config.blocks_per_chunk * config.blocks_per_chunk

    async def _prefill(self, prompt: list[int], **kwargs: Any) -> PrefillResult:
        result = await self.engine.prefill(prompt, **kwargs)
        self.engine.release(result.sequence)
        return result


def make_row(prompt: list[int], setup: Setup, cold: list[PrefillResult], engine: Engine) -> Row:
    """Medians of the repeats and the ratios derived from them (see the module doc)."""
    cached, fraction = setup.cached, setup.fraction
    suffix_compute_s = statistics.median(setup.suffix_compute_s or [r.ttft_s for r in cold])
    ttft_cold_s = statistics.median(r.ttft_s for r in cold)
    ttft_s = statistics.median(r.ttft_s for r in cached)
    lookup_s = statistics.median(r.lookup_s for r in cached)
    fetch_s = statistics.median(r.fetch_s for r in cached)
    compute_s = statistics.median(r.compute_s for r in cached)
    front_compute_s = statistics.median(r.front_compute_s for r in cached)
    other_s = statistics.median(
        r.ttft_s - max(r.fetch_s, r.front_compute_s) - r.compute_s for r in cached
    )
    cached_tokens = min(r.num_cached_tokens for r in cached)
    fetched_bytes = cached_tokens // engine.config.block_tokens * engine.layout.block_bytes
    ideal_speedup = ttft_cold_s / (suffix_compute_s + fetch_s) if cached_tokens else 1.0
    speedup = ttft_cold_s / ttft_s
    free_cache_speedup = ttft_cold_s / suffix_compute_s if suffix_compute_s else 1.0
    return Row(
        prompt_tokens=len(prompt),
        cached_fraction=fraction,
        cached_tokens=cached_tokens,
        computed_tokens=len(prompt) - cached_tokens,
        ttft_s=ttft_s,
        ttft_cold_s=ttft_cold_s,
        speedup=speedup,
        free_cache_speedup=free_cache_speedup,
        of_free_cache=speedup / free_cache_speedup,
        ideal_speedup=ideal_speedup,
        ratio_to_ideal=speedup / ideal_speedup,
        suffix_compute_s=suffix_compute_s,
        lookup_s=lookup_s,
        fetch_s=fetch_s,
        compute_s=compute_s,
        other_s=other_s,
        fetch_gb_per_s=fetched_bytes / fetch_s / GB if fetched_bytes and fetch_s else 0.0,
        compute_tokens_per_s=len(prompt) / ttft_cold_s,
        same_first_token=all(r.first_token_id == cold[0].first_token_id for r in cached),
        fallback=next((r.fallback for r in cached if r.fallback), None),
        repeats=len(cached),
        ttft_cold_s_runs=[r.ttft_s for r in cold],
        ttft_s_runs=[r.ttft_s for r in cached],
        ttft_cold_spread=_spread([r.ttft_s for r in cold]),
        ttft_spread=_spread([r.ttft_s for r in cached]),
        front_compute_s=front_compute_s,
        place_s=statistics.median(r.place_s for r in cached),
        kv_format=engine.layout.stored_format,
        kv_bytes_per_token=engine.layout.bytes_per_token,
    )


def add_yardsticks(row: Row, reference_s: list[float], matmul_tflops: float, engine: Engine) -> Row:
    """``row`` with the reference's figures and our cold prefill's rate (see ``Row``)."""
    cold_tflops = prefill_flops(engine.model.config, 0, row.prompt_tokens) / row.ttft_cold_s / 1e12
    computed = row.computed_tokens
    extra: dict[str, Any] = {
        "cold_tflops": cold_tflops,
        "cold_mfu": cold_tflops / matmul_tflops if matmul_tflops else 0.0,
        "suffix_tokens_per_s": computed / row.suffix_compute_s if row.suffix_compute_s else 0.0,
    }
    if any(reference_s):
        reference_cold_s = statistics.median(reference_s)
        kv_bytes_per_token = engine.layout.bytes_per_token  # of the stored format
        extra |= {
            "ttft_reference_cold_s": reference_cold_s,
            "speedup_vs_reference": reference_cold_s / row.ttft_s,
            "ttft_reference_cold_s_runs": reference_s,
            "reference_tokens_per_s": row.prompt_tokens / reference_cold_s,
            "break_even_gb_per_s": kv_bytes_per_token * row.prompt_tokens / reference_cold_s / GB,
        }
    return dataclasses.replace(row, **extra)


def _spread(values: list[float]) -> float:
    """(max - min) / median: how far apart the repeats of one figure were."""
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else 0.0


def results_table(rows: list[Row], title: str) -> Table:
    table = Table(title=title)
    columns = ["prompt", "cached", "TTFT cold s", "ref cold s", "TTFT s", "spread", "speedup"]
    columns += ["vs ref", "cold MFU", "free cache", "of free"]
    columns += ["fetch/front/compute/other ms", "fetch / break-even GB/s", "compute tok/s"]
    for name in columns:
        table.add_column(name, justify="right")
    table.add_column("same 1st", justify="right")
    for row in rows:
        table.add_row(
            str(row.prompt_tokens),
            f"{row.cached_fraction:.0%} ({row.cached_tokens})",
            f"{row.ttft_cold_s:.3f}",
            f"{row.ttft_reference_cold_s:.3f}",
            f"{row.ttft_s:.3f}",
            f"{row.ttft_cold_spread:.0%} / {row.ttft_spread:.0%}",
            f"{row.speedup:.2f}x",
            f"{row.speedup_vs_reference:.2f}x",
            f"{row.cold_mfu:.0%}",
            f"{row.free_cache_speedup:.2f}x",
            f"{row.of_free_cache:.2f}",
            "/".join(
                f"{1000 * s:.0f}"
                for s in (row.fetch_s, row.front_compute_s, row.compute_s, row.other_s)
            ),
            f"{row.fetch_gb_per_s:.2f} / {row.break_even_gb_per_s:.2f}",
            f"{row.compute_tokens_per_s:.0f}",
            "yes" if row.same_first_token else "NO",
        )
    return table


def plot(rows: list[Row], title: str, path: Path) -> None:
    """Speedup vs cached fraction, measured (solid) and ideal (dashed), per prompt length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for num_tokens in sorted({r.prompt_tokens for r in rows}):
        mine = [r for r in rows if r.prompt_tokens == num_tokens]
        fractions = [r.cached_fraction for r in mine]
        line = ax.plot(
            fractions, [r.speedup for r in mine], marker="o", label=f"{num_tokens} tokens"
        )
        ax.plot(fractions, [r.ideal_speedup for r in mine], ls="--", color=line[0].get_color())
    ax.set(
        xlabel="cached fraction of the prompt", ylabel="TTFT speedup (cold / cached)", title=title
    )
    ax.set_yscale("log")
    ax.legend(title="measured (solid), ideal (dashed)", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def make_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """Seeded random token ids, clear of the low ids where control tokens usually live."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        min(100, vocab_size // 2), vocab_size, (num_tokens,), generator=generator
    ).tolist()


@contextlib.contextmanager
def cluster_toml(path: Path | None, num_nodes: int) -> Iterator[Path]:
    """The given cluster, or a local one started (and stopped) around the run."""
    if path is not None:
        yield path
        return
    with (
        tempfile.TemporaryDirectory(prefix="kvstore-engine-bench-") as root,
        LocalCluster.start(root, num_nodes=num_nodes, fsync=False) as cluster,
    ):
        yield cluster.cluster_toml


def engine_config(args: argparse.Namespace, max_model_len: int, num_fractions: int) -> EngineConfig:
    cuda = args.device.startswith("cuda")
    return EngineConfig(
        block_tokens=args.block_tokens,
        prefill_chunk_tokens=args.chunk_tokens or (512 if cuda else args.block_tokens),
        device=args.device,
        dtype=args.dtype or ("bfloat16" if cuda else "float32"),
        kv_format=args.kv_format,
        max_num_seqs=num_fractions + 2,  # the held prefixes, a prefill and a spare
        max_model_len=max_model_len,
        fetch_policy=args.fetch_policy,
        fetch_deadline_s=args.fetch_deadline_s,
        fetch_chunk_blocks=args.fetch_chunk_blocks,
        store_transport=args.store_transport,
        seed=args.seed,
    )


async def bench(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    fractions = [float(x) for x in args.cached_fractions.split(",")]
    config = engine_config(args, 0, 0)
    loaded = load_model(args.model, config.device, config.dtype, config.seed)
    context = loaded.model.config.max_position_embeddings
    for capped in sorted(n for n in lengths if n > context):
        console.print(
            f"note: prompt length {capped} capped to {args.model}'s context of {context} tokens "
            "(random:1b-long has a 128k context)"
        )
    lengths = sorted({min(n, context) for n in lengths})
    engine = Engine(loaded, engine_config(args, max(lengths), len(fractions)))
    rows: list[Row] = []
    load_before = os.getloadavg()
    with (
        cluster_toml(args.cluster, args.nodes) as toml,
        ProgressReporter("engine bench", len(lengths) * args.repeats) as progress,
    ):
        engine.open_store(toml)
        reference = None if engine.model.config.is_mla else ReferencePrefill(engine.model)
        runner = Bench(engine, args.repeats, progress, reference)
        runner.matmul_tflops = matmul_tflops(engine.cache.kv.device, engine.cache.kv.dtype)
        freeze_startup_heap()  # as a serving worker does once it is up
        for num_tokens in lengths:
            prompt = make_prompt(num_tokens, engine.model.config.vocab_size, args.seed)
            rows += await runner.prompt_rows(prompt, fractions)
        config = describe(args, engine)
        config |= {"matmul_tflops": runner.matmul_tflops, "reference": _reference_name(reference)}
        await engine.close()
    config["load_average_1m_before_after"] = [load_before[0], os.getloadavg()[0]]
    most_fetched = max((r.cached_tokens for r in rows), default=0)
    num_bytes = max(most_fetched // engine.config.block_tokens, 1) * engine.layout.block_bytes
    limits = copy_limits(num_bytes, torch.device(args.device), args.repeats)
    return {"config": config, "limits": limits, "results": [asdict(r) for r in rows]}


def _reference_name(reference: ReferencePrefill | None) -> str:
    if reference is None:
        return ""
    import transformers

    return f"transformers {transformers.__version__} LlamaForCausalLM, sdpa, last logits only"


def describe(args: argparse.Namespace, engine: Engine) -> dict[str, Any]:
    cfg = engine.model.config
    return {
        "model": args.model,
        "model_fingerprint": engine.loaded.fingerprint,
        "num_params": cfg.num_params(),
        "device": args.device,
        "device_name": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or platform.machine(),
        "dtype": engine.config.dtype,
        "torch_threads": torch.get_num_threads(),
        "block_tokens": engine.config.block_tokens,
        "prefill_chunk_tokens": engine.config.prefill_chunk_tokens,
        "block_bytes": engine.layout.block_bytes,
        "kv_format": engine.layout.stored_format,
        "kv_bytes_per_token": engine.layout.bytes_per_token,
        "fetch_policy": engine.config.fetch_policy,
        "fetch_chunk_blocks": engine.config.fetch_chunk_blocks,
        "store_transport": engine.config.store_transport,
        "store_transport_used": engine.connector.transport_used() if engine.connector else "",
        "cluster": str(args.cluster) if args.cluster else f"local, {args.nodes} nodes, fsync off",
        "repeats": args.repeats,
        "connector_stats": asdict(engine.connector.stats) if engine.connector else {},
    }


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore bench engine``."""
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    _add_model_flags(parser)
    _add_workload_flags(parser)
    _add_engine_flags(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' token ids")
    parser.add_argument("--plot", type=Path, default=None, help="also write a PNG of the speedups")


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Which model runs where, in which dtype."""
    parser.add_argument(
        "--model",
        default="default",
        help="default | random:<size> | a .gguf file | a safetensors dir",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 (default: float32 on CPU, bfloat16 on CUDA)",
    )
    add_kv_format_argument(parser)


def _add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """The prompts, the cluster they are cached in, and how often each setting runs."""
    parser.add_argument(
        "--prompt-lengths",
        default=DEFAULT_LENGTHS,
        help=f"comma-separated (default {DEFAULT_LENGTHS})",
    )
    parser.add_argument(
        "--cached-fractions",
        default=DEFAULT_FRACTIONS,
        help=f"comma-separated (default {DEFAULT_FRACTIONS})",
    )
    parser.add_argument("--cluster", type=Path, help="DIR/cluster.toml (default: a local cluster)")
    parser.add_argument("--nodes", type=int, default=12, help="nodes of the local cluster")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's blocks, chunks and fetches."""
    parser.add_argument(
        "--block-tokens", type=int, default=64, help="tokens per KV block (the store's block)"
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="prefill chunk (default: one block on CPU, 512 on CUDA)",
    )
    parser.add_argument(
        "--fetch-policy",
        default="always",
        choices=["always", "cost"],
        help="always: fetch every cached block, the engine's default (default); cost: compute "
        "the front while fetching the rest where the cost model predicts that is faster",
    )
    parser.add_argument(
        "--fetch-deadline-s", type=float, default=10.0, help="longest wait for cached blocks"
    )
    parser.add_argument(
        "--fetch-chunk-blocks", type=int, default=64, help="blocks per land_batch call of a fetch"
    )
    add_store_transport_argument(parser)


def run(args: argparse.Namespace) -> int:
    console = make_console()
    report = asyncio.run(bench(args, console))
    rows = [Row(**r) for r in report["results"]]
    config = report["config"]
    title = f"engine TTFT: {config['model']} on {config['device']} ({config['dtype']})"
    print_fitted(results_table(rows, title), console)
    limits = ", ".join(f"{name} {value:.2f}" for name, value in report["limits"].items())
    console.print(f"limits, the fetched bytes in this run: {limits}")
    console.print(f"store transport: {config['store_transport_used']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    console.print(f"wrote {args.json}")
    if args.plot:
        plot(rows, title, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if all(r.same_first_token for r in rows) else 1
