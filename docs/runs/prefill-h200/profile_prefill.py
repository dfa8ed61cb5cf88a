"""Cold prefill of random:1b on CUDA: our engine (exact 512-token chunks, then each layer's
whole range at once where the config has ``exact_chunks``) against transformers' Llama,
with the torch profiler's top kernels of one 4k cold prefill and of a 2k suffix after a
14k cached prefix. Runs on the old code too (no ``exact_chunks``: its chunk-major loop)."""

import asyncio
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine_bench import make_prompt
from engine_adapter.config import EngineConfig
from engine_adapter.engine import Engine
from engine_adapter.loader import load_model

label = sys.argv[1]
loaded = load_model("random:1b", "cuda", "bfloat16", 0)
modes = (
    {"exact512": True, "whole": False}
    if hasattr(EngineConfig, "compute_chunk_tokens")
    else {"before512": None}
)
engines = {}
for name, exact in modes.items():
    kw = dict(
        block_tokens=64,
        prefill_chunk_tokens=512,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=3,
        max_model_len=16384,
    )
    if exact is not None:
        kw["exact_chunks"] = exact
    engines[name] = Engine(loaded, EngineConfig(**kw))
reference = None
if label == "after":
    from bench.reference_prefill import ReferencePrefill, matmul_tflops, prefill_flops

    reference = ReferencePrefill(loaded.model)
    rate = matmul_tflops(torch.device("cuda"), torch.bfloat16)
    print(f"matmul bf16 TFLOP/s {rate:.0f}")


async def cold(engine, prompt):
    result = await engine.prefill(prompt, use_cache=False)
    engine.release(result.sequence)
    return result.ttft_s, result.first_token_id


async def suffix(engine, prompt, num_prefix):
    seeded = await engine.prefill(
        prompt[:num_prefix], use_cache=False, reserve_tokens=len(prompt) - num_prefix
    )
    seq = seeded.sequence
    torch.cuda.synchronize()
    times = []
    for _ in range(4):
        import time

        started = time.perf_counter()
        _, first = await engine.extend(seq, prompt[num_prefix:])
        times.append(time.perf_counter() - started)
        engine.truncate(seq, num_prefix)
    engine.release(seq)
    return statistics.median(times[1:]), first


for length in (4096, 16384):
    prompt = make_prompt(length, loaded.model.config.vocab_size, 0)
    runs = {name: [] for name in [*engines, "reference"]}
    firsts = {}
    for _ in range(6):
        for name, engine in engines.items():
            t, firsts[name] = asyncio.run(cold(engine, prompt))
            runs[name].append(t)
        if reference:
            t, firsts["reference"] = reference(prompt)
            runs["reference"].append(t)
    for name, values in runs.items():
        if not values:
            continue
        median = statistics.median(values[1:])
        extra = ""
        if reference:
            tflops = prefill_flops(loaded.model.config, 0, length) / median / 1e12
            extra = f" {tflops:.0f} TFLOP/s, MFU {tflops / rate:.0%}"
        ms = [round(v * 1000, 1) for v in values]
        print(f"{label} {length} cold {name}: {median * 1000:.1f} ms{extra} {firsts[name]} {ms}")
    num_prefix = int(0.9 * length) // 512 * 512
    for name, engine in engines.items():
        s, first = asyncio.run(suffix(engine, prompt, num_prefix))
        n = length - num_prefix
        print(f"{label} {length} suffix {n} after {num_prefix} {name}: {s * 1000:.1f} ms, ")
        print(f"  {n / s:.0f} tok/s, first token {first}")

for name, engine in engines.items():
    prompt = make_prompt(4096, loaded.model.config.vocab_size, 0)
    asyncio.run(cold(engine, prompt))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        asyncio.run(cold(engine, prompt))
    print(f"== {label} {name}: top kernels of one 4096-token cold prefill")
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60
        )
    )
if reference:
    prompt = make_prompt(4096, loaded.model.config.vocab_size, 0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        reference(prompt)
    print(f"== {label} reference: top kernels of one 4096-token cold prefill")
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60
        )
    )
