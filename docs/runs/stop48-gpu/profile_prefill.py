"""Where a cold prefill and the suffix after a 90% fetch spend their GPU time (issue 43).

Runs the bundled model's forward on its paged KV cache, no store: the prefix's KV is
computed once, then the suffix [prefix, n) is timed and profiled, beside transformers' cold
prefill of all n tokens and our own. Prints medians of 10 (CUDA-synchronised) and the top
kernels by device time. Usage: python3 profile_prefill.py [random:1b] [4096,16384]
"""

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.reference_prefill import ReferencePrefill
from engine_adapter import model as model_module
from engine_adapter.kv_layout import KVBlockLayout
from engine_adapter.loader import load_model
from engine_adapter.paged_kv import BlockTable, PagedKVCache

spec = sys.argv[1] if len(sys.argv) > 1 else "random:1b"
lengths = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4096,16384").split(",")]
m = load_model(spec, "cuda", "bfloat16", 0).model
cfg = m.config
layout = KVBlockLayout.for_model(cfg, 64, "bfloat16")
reference = ReferencePrefill(m)


def timed(fn, repeats=10):
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[2:])


def top_kernels(fn, title, rows=12):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"--- {title}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows))


explicit_mask = model_module._causal_mask


def bool_mask(start, end, device, dtype=None):  # the variant: an explicit [n, S] mask on CUDA too
    if end - start == 1:
        return None
    q = torch.arange(start, end, device=device)[:, None]
    return torch.arange(end, device=device)[None, :] <= q


def measure(n: int) -> None:
    """One prompt length: the timings, then the profiles."""
    blocks = n // 64
    cache = PagedKVCache(layout, blocks + 1, torch.device("cuda"))
    table = BlockTable(64, list(range(blocks)))
    ids = torch.randint(0, cfg.vocab_size, (n,), device="cuda")
    prefix = (int(0.9 * n) // 64) // 8 * 8 * 64  # the bench's 90%: whole 512-token chunks

    def cold():
        m.logits(m(ids, 0, cache, table)[-1:])

    def suffix():
        m.logits(m(ids[prefix:], prefix, cache, table)[-1:])

    def ref():
        reference(ids.tolist())

    cold()
    row = {"n": n, "prefix": prefix, "ref_s": timed(ref), "cold_s": timed(cold)}
    row["suffix_s"] = timed(suffix)
    model_module._causal_mask = bool_mask
    row["suffix_boolmask_s"] = timed(suffix)
    model_module._causal_mask = explicit_mask
    row["suffix_tok_per_s"] = (n - prefix) / row["suffix_s"]
    row["ref_tok_per_s"] = n / row["ref_s"]
    print(row, flush=True)
    top_kernels(suffix, f"suffix [{prefix}, {n}) after the prefix, {spec}")
    if n == lengths[0]:
        top_kernels(cold, f"our cold prefill of {n}")
        top_kernels(ref, f"transformers' cold prefill of {n}")


for n in lengths:
    measure(n)
