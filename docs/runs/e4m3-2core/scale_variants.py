"""Which e4m3x16 scale encoding (issue 35): top-1 agreement and perplexity of scale variants
on SmolLM2, the same positions as ``kvstore bench accuracy`` (32 windows of 64 tokens over
pydoc_data.topics), with the prefix KV quantised and dequantised in process instead of going
through the store (the e8m0 row matches the bench's figures exactly). A kept exploration, not
part of the package::

    PYTHONPATH=. python docs/runs/e4m3-2core/scale_variants.py e8m0 e8m0_g8 m3_up bf16_up fp32
"""

import math
import sys
import time

import torch

from bench.accuracy_eval import fixed_text_ids
from engine_adapter.config import EngineConfig
from engine_adapter.engine import Engine
from engine_adapter.loader import load_model
from engine_adapter.paged_kv import BlockTable

T, W = 64, 32  # block tokens, windows
E4M3 = torch.float8_e4m3fn


def e8m0(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """Power-of-two scales: the smallest 2**k with amax / 2**k <= 448."""
    g = x.unflatten(-1, (-1, group))
    amax = g.abs().amax(-1, keepdim=True).float()
    e = (((amax.view(torch.int32) + 0x1FFFFF) >> 23) - 8).clamp(1, 254)
    s = (e << 23).view(torch.float32)
    return ((g / s).to(E4M3).float() * s).flatten(-2)


def float_scale(x: torch.Tensor, round_scale, group: int = 16) -> torch.Tensor:
    """Scale = round_scale(amax / 448), values saturating at 448."""
    g = x.unflatten(-1, (-1, group))
    s = round_scale(g.abs().amax(-1, keepdim=True).float() / 448).clamp_min(1e-30)
    return ((g / s).clamp(-448, 448).to(E4M3).float() * s).flatten(-2)


def round_up_bits(keep_mantissa_bits: int):
    """Round a positive fp32 up to ``keep_mantissa_bits`` mantissa bits (fp32's exponent)."""
    low = (1 << (23 - keep_mantissa_bits)) - 1
    return lambda v: ((v.view(torch.int32) + low) & ~low).view(torch.float32)


VARIANTS = {
    "e8m0": e8m0,  # 1.0625 bytes per value
    "e8m0_g8": lambda x: e8m0(x, 8),  # 1.125
    "m3_up": lambda x: float_scale(x, round_up_bits(3)),  # a one-byte scale's best case
    "bf16_up": lambda x: float_scale(x, round_up_bits(7)),  # 1.125: the chosen encoding
    "fp32": lambda x: float_scale(x, lambda v: v),  # 1.25: the ceiling
}


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    loaded = load_model("default", "cpu", "float32", 0)
    config = EngineConfig(block_tokens=T, prefill_chunk_tokens=T, max_num_seqs=2,
                          max_model_len=(W + 2) * T + 1)  # fmt: skip
    engine = Engine(loaded, config)
    text = fixed_text_ids(engine, (W + 1) * T + 1)
    model, cache = engine.model, engine.cache
    table = BlockTable(T, cache.pool.allocate(W + 1))
    with torch.no_grad():
        logits = [
            model.logits(model(torch.tensor(text[s : s + 256]), s, cache, table)).float()
            for s in range(0, (W + 1) * T, 256)
        ]
    reference = torch.cat(logits)[T : (W + 1) * T]
    targets = torch.tensor(text[T + 1 : (W + 1) * T + 1])
    kv = torch.stack([cache.kv[:, :, :, b * T : (b + 1) * T] for b in table.block_ids])
    cache.pool.free(table.block_ids)
    reference_nll = float(torch.nn.functional.cross_entropy(reference, targets))
    for name in names:
        started, stored, out = time.time(), VARIANTS[name](kv), []
        with torch.no_grad():
            for k in range(1, W + 1):
                window = BlockTable(T, cache.pool.allocate(k + 1))
                for i in range(k):
                    first = window.block_ids[i] * T
                    cache.kv[:, :, :, first : first + T] = stored[i]
                hidden = model(torch.tensor(text[k * T : (k + 1) * T]), k * T, cache, window)
                out.append(model.logits(hidden).float())
                cache.pool.free(window.block_ids)
        got = torch.cat(out)
        agree = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
        nll = float(torch.nn.functional.cross_entropy(got, targets))
        max_diff = float((got - reference).abs().max())
        print(f"{name}: top1 {agree:.4%} ({round((1 - agree) * len(targets))} differ) "
              f"ppl_ratio {math.exp(nll - reference_nll):.4f} "
              f"maxdiff {max_diff:.3f} {time.time() - started:.0f}s")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
