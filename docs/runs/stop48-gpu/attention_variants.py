"""The suffix's attention on CUDA, three ways (issue 43's 16k suffix runs FA2, not cuDNN).

For a suffix of n queries after a prefix of S - n cached keys (random:1b's heads: 32 query
heads, 8 KV heads, head dim 64, bf16), medians of 20 of one layer's attention:
- lower-right: SDPA with a lower-right causal bias (what the engine runs);
- square: the queries padded to S rows, then SDPA with is_causal (cuDNN's kernel), the
  padding's rows thrown away;
- no-mask prefix + causal suffix: the two parts' work alone (what a split with a
  log-sum-exp merge would cost, merge left out).
Usage: python3 attention_variants.py
"""

import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def timed(fn, repeats=20):
    times = []
    for _ in range(repeats + 3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:]) * 1e3


def variants(total: int, n: int) -> dict[str, float]:
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(1, 32, n, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(1, 8, total, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(1, 8, total, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = causal_lower_right(n, total)
    padded = torch.zeros(1, 32, total, 64, device="cuda", dtype=torch.bfloat16)
    prefix = total - n

    def lower_right():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    def square():
        padded[:, :, prefix:] = q
        out = F.scaled_dot_product_attention(padded, k, v, is_causal=True, enable_gqa=True)
        return out[:, :, prefix:]

    def split_parts():
        F.scaled_dot_product_attention(q, k[:, :, :prefix], v[:, :, :prefix], enable_gqa=True)
        F.scaled_dot_product_attention(
            q, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, enable_gqa=True
        )

    same = torch.allclose(lower_right().float(), square().float(), atol=2e-2, rtol=0)
    return {
        "total": total,
        "queries": n,
        "lower_right_ms": timed(lower_right),
        "square_ms": timed(square),
        "split_parts_ms": timed(split_parts),
        "square_agrees": same,
    }


for total, n in ((16384, 2048), (16384, 14848), (4096, 512), (16384, 8192)):
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in variants(total, n).items()})
