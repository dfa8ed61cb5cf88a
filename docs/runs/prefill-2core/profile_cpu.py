"""CPU profile of one 1,024-token cold prefill of random:135m (fp32, 64-token chunks): the
old chunk-major loop (one model call per chunk, as engine.py ran it) against the layer-major
pass (one call, chunk_tokens=64) and one whole-range pass, interleaved, with the torch
profiler's top ops of each. Usage: PYTHONPATH=. python docs/runs/prefill-2core/profile_cpu.py"""

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.engine_bench import make_prompt
from bench.reference_prefill import ReferencePrefill
from engine_adapter.kv_layout import KVBlockLayout
from engine_adapter.loader import load_model
from engine_adapter.paged_kv import BlockTable, PagedKVCache

LENGTH, CHUNK = 1024, 64
model = load_model("random:135m", "cpu", "float32", 0).model
layout = KVBlockLayout.for_model(model.config, 64, "float32")
cache = PagedKVCache(layout, LENGTH // 64, torch.device("cpu"))
table = BlockTable(64, list(range(LENGTH // 64)))
ids = torch.tensor(make_prompt(LENGTH, model.config.vocab_size, 0))
reference = ReferencePrefill(model)


def chunk_major():
    for s in range(0, LENGTH, CHUNK):
        hidden = model(ids[s : s + CHUNK], s, cache, table)
    return model.logits(hidden[-1])


def layer_major():
    return model.logits(model(ids, 0, cache, table, chunk_tokens=CHUNK)[-1])


def whole():
    return model.logits(model(ids, 0, cache, table, chunk_tokens=0)[-1])


def ref():
    reference(ids.tolist())


runs = {f.__name__: [] for f in (chunk_major, layer_major, whole, ref)}
for _ in range(3):
    for f in (chunk_major, layer_major, whole, ref):
        started = time.perf_counter()
        f()
        runs[f.__name__].append(time.perf_counter() - started)
for name, values in runs.items():
    median = statistics.median(values[1:])
    print(f"{name}: median {median:.3f} s, runs {[round(v, 3) for v in values]}")
for f in (chunk_major, layer_major, ref):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        f()
    print(f"== {f.__name__}: top ops")
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=40
        )
    )
