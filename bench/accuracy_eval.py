"""The work of ``kvstore bench accuracy`` (bench/accuracy_bench.py has its arguments and
what it measures); torch and the engine load only when it runs."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from bench.common import bench_cluster
from engine_adapter.config import EngineConfig
from engine_adapter.engine import Engine
from engine_adapter.kv_layout import KVBlockLayout
from engine_adapter.loader import LoadedModel, load_model
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.tables import make_console, print_fitted
from kvstore.errors import InvalidArgument

TENANT = "accuracy"
REFERENCE_CHUNK_TOKENS = 256  # the reference forward's chunks (bounds attention's memory)
PROMPT_TAIL_TOKENS = 7  # greedy prompts: whole stored blocks and this many tokens more


@dataclass
class Record:
    kv_format: str
    kv_bytes_per_token: int
    num_positions: int
    top1_agreement: float
    perplexity: float
    reference_perplexity: float
    perplexity_ratio: float  # this format's perplexity / the reference's
    max_logit_diff: float
    identical_greedy: int  # of num_prompts
    num_prompts: int
    num_cached_tokens: int  # swapped in over every window and prompt (the store was used)
    seconds: float


@dataclass
class Evaluation:
    """One engine's logits at the evaluated positions and its greedy continuations."""

    logits: torch.Tensor  # [num_positions, vocab] fp32
    targets: torch.Tensor  # [num_positions] the text's next tokens
    continuations: list[list[int]]
    num_cached_tokens: int

    def nll(self) -> float:
        """Mean negative log-likelihood of the targets."""
        return float(torch.nn.functional.cross_entropy(self.logits, self.targets))


def fixed_text_ids(engine: Engine, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of Python's bundled documentation, topics in order."""
    from pydoc_data.topics import topics

    tokenizer = engine.require_tokenizer()
    ids: list[int] = []
    for name in sorted(topics):
        ids += tokenizer.encode(topics[name])
        if len(ids) >= num_tokens:
            return ids[:num_tokens]
    raise InvalidArgument(f"the fixed text has only {len(ids)} tokens, {num_tokens} needed")


async def reference(
    engine: Engine, text: list[int], prompts: list[list[int]], args: argparse.Namespace
) -> Evaluation:
    """The full-precision answers: one forward over the text (logits at the evaluated
    positions), whose KV is then written to the store in the engine's format; greedy
    continuations computed without the store."""
    block = engine.config.block_tokens
    result = await engine.prefill(
        text[:1], tenant=TENANT, use_cache=False, reserve_tokens=len(text) - 1
    )
    seq, logits = result.sequence, []
    try:
        for start in range(1, len(text), REFERENCE_CHUNK_TOKENS):
            ids = torch.tensor(text[start : start + REFERENCE_CHUNK_TOKENS], dtype=torch.long)
            hidden = await asyncio.to_thread(engine.model, ids, start, engine.cache, seq.table)
            logits.append(engine.model.logits(hidden).float())  # positions start ...
        seq.token_ids = list(text)
        store = engine.connector
        assert store is not None, "open_store first"
        await store.write_back(store.keys(text, TENANT), seq.table, 0, TENANT, "chat")
        await engine.flush()
    finally:
        engine.release(seq)
    every = torch.cat([result.logits[None].float(), *logits])  # [len(text), vocab]
    evaluated = [
        p for k in range(1, args.num_windows + 1) for p in range(k * block, (k + 1) * block)
    ]
    continuations = [
        (await engine.generate(ids, max_new_tokens=args.max_new_tokens, use_cache=False)).token_ids
        for ids in prompts
    ]
    return Evaluation(every[evaluated], targets(text, args, block), continuations, 0)


async def from_store(
    engine: Engine, text: list[int], prompts: list[list[int]], args: argparse.Namespace
) -> Evaluation:
    """The same positions and prompts with the prefix KV swapped in from the store."""
    block = engine.config.block_tokens
    logits, cached = [], 0
    with ProgressReporter(f"accuracy {engine.layout.stored_format}", args.num_windows) as progress:
        for k in range(1, args.num_windows + 1):
            window, num_cached = await window_logits(engine, text[: (k + 1) * block + 1], k)
            logits.append(window)
            cached += num_cached
            progress.advance()
    continuations = []
    for ids in prompts:
        generation = await engine.generate(
            ids, max_new_tokens=args.max_new_tokens, tenant=TENANT, use_cache=True
        )
        cached += generation.prefill.num_cached_tokens
        continuations.append(generation.token_ids)
    return Evaluation(torch.cat(logits), targets(text, args, block), continuations, cached)


async def window_logits(engine: Engine, ids: list[int], k: int) -> tuple[torch.Tensor, int]:
    """Logits at positions ``k*T .. (k+1)*T - 1`` of ``ids`` (T = block_tokens): blocks
    ``0..k-1`` swapped in from the store, the rest computed; (logits [T, vocab], cached)."""
    block = engine.config.block_tokens
    result = await engine.prefill(
        ids[: k * block + 1], tenant=TENANT, write_back=False, reserve_tokens=block - 1
    )
    try:
        rest = torch.tensor(ids[k * block + 1 : (k + 1) * block], dtype=torch.long)
        hidden = await asyncio.to_thread(
            engine.model, rest, k * block + 1, engine.cache, result.sequence.table
        )
        logits = torch.cat([result.logits[None], engine.model.logits(hidden)])  # [T, vocab]
    finally:
        engine.release(result.sequence)
    return logits.float(), result.num_cached_tokens


def targets(text: list[int], args: argparse.Namespace, block: int) -> torch.Tensor:
    """The next token of each evaluated position: windows 1 .. num_windows."""
    return torch.tensor(
        [
            t
            for k in range(1, args.num_windows + 1)
            for t in text[k * block + 1 : (k + 1) * block + 1]
        ]
    )


def compare(
    reference: Evaluation, other: Evaluation, layout: KVBlockLayout, seconds: float
) -> Record:
    agree = (reference.logits.argmax(-1) == other.logits.argmax(-1)).float().mean()
    ppl, ref_ppl = math.exp(other.nll()), math.exp(reference.nll())
    same = sum(a == b for a, b in zip(reference.continuations, other.continuations, strict=True))
    return Record(
        kv_format=layout.stored_format,
        kv_bytes_per_token=layout.bytes_per_token,
        num_positions=len(other.targets),
        top1_agreement=float(agree),
        perplexity=ppl,
        reference_perplexity=ref_ppl,
        perplexity_ratio=ppl / ref_ppl,
        max_logit_diff=float((reference.logits - other.logits).abs().max()),
        identical_greedy=same,
        num_prompts=len(other.continuations),
        num_cached_tokens=other.num_cached_tokens,
        seconds=seconds,
    )


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(args.model, "cpu", "float32", 0)
    block = args.block_tokens
    config = EngineConfig(
        block_tokens=block,
        prefill_chunk_tokens=block,
        max_num_seqs=2,
        max_model_len=(args.num_windows + 2) * block + 1,
        fetch_policy="always",
        fetch_deadline_s=args.deadline_s,
        fetch_min_deadline_s=args.deadline_s,
    )
    load_before = os.getloadavg()[0]
    records = []
    with bench_cluster(args) as (cluster_toml, _):
        for name in args.formats:
            started = time.perf_counter()
            quantised = dataclasses.replace(config, kv_format=name)
            full, other = await run_one(loaded, quantised, cluster_toml, args)
            layout = KVBlockLayout.for_model(loaded.model.config, block, "float32", name)
            records.append(compare(full, other, layout, time.perf_counter() - started))
    return {
        "config": {
            "model": args.model,
            "model_fingerprint": loaded.fingerprint,
            "dtype": "float32",
            "block_tokens": block,
            "num_windows": args.num_windows,
            "max_new_tokens": args.max_new_tokens,
            "text": "pydoc_data.topics, topics in sorted order",
            "torch_threads": torch.get_num_threads(),
            "load_average_1m_before_after": [load_before, os.getloadavg()[0]],
        },
        "results": [asdict(record) for record in records],
    }


async def run_one(
    loaded: LoadedModel, config: EngineConfig, cluster_toml: Path, args: argparse.Namespace
) -> tuple[Evaluation, Evaluation]:
    """(the full-precision reference, the same with ``config.kv_format`` blocks from the
    store) on one engine."""
    engine = Engine(loaded, config)
    engine.open_store(cluster_toml)
    try:
        block = config.block_tokens
        text = fixed_text_ids(engine, (args.num_windows + 1) * block + 1)
        prompts = greedy_prompts(text, args.num_prompts, block, args.num_windows)
        full = await reference(engine, text, prompts, args)
        return full, await from_store(engine, text, prompts, args)
    finally:
        await engine.close()


def greedy_prompts(
    text: list[int], num_prompts: int, block: int, num_windows: int
) -> list[list[int]]:
    """``num_prompts`` prefixes of the text: ``k`` blocks (stored already) and a few tokens,
    ``k`` spread over 1 .. num_windows."""
    return [
        text[: (1 + i * (num_windows - 1) // max(num_prompts, 1)) * block + PROMPT_TAIL_TOKENS]
        for i in range(num_prompts)
    ]


def results_table(records: list[Record]) -> Table:
    table = Table(title="KV format accuracy, prefix KV from the store (vs the compute dtype)")
    for name in ["format", "bytes/token", "positions", "top-1", "ppl ratio", "max |dlogit|"]:
        table.add_column(name, justify="right")
    table.add_column("identical greedy", justify="right")
    for r in records:
        table.add_row(
            r.kv_format,
            f"{r.kv_bytes_per_token:,}",
            str(r.num_positions),
            f"{r.top1_agreement:.2%}",
            f"{r.perplexity_ratio:.4f}",
            f"{r.max_logit_diff:.3f}",
            f"{r.identical_greedy}/{r.num_prompts}",
        )
    return table


def run(args: argparse.Namespace) -> int:
    """Run, print the table, write JSON; 1 if the store was never used."""
    args.formats = [args.kv_format] if args.kv_format != "dtype" else ["dtype"]
    report = asyncio.run(bench(args))
    records = [Record(**r) for r in report["results"]]
    console = make_console()
    print_fitted(results_table(records), console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.json}")
    return 0 if records and all(r.num_cached_tokens for r in records) else 1
