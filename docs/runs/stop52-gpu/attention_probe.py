"""Which attention kernel a suffix's queries get, and what it costs: random:1b's shape (32 query
heads, 8 KV heads, head dim 64, bf16) on CUDA, n suffix queries against S keys.

    python docs/runs/stop52-gpu/attention_probe.py

Per (n, S): SDPA with a lower-right causal bias and ``enable_gqa`` (the engine's call today),
the same queries padded at the front to S rows with ``is_causal=True`` (the last n rows kept),
and the flash op called directly (lower-right causal) on K and V expanded to 32 heads; the
largest difference from the first, and torch's own reason when flash is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right

HEADS, KV_HEADS, DIM = 32, 8, 64


def timed(call, repeats: int = 20) -> tuple[float, torch.Tensor]:
    out = call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        out = call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, out


def main() -> None:
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    for n, s in [(14848, 16384), (2048, 16384), (16384, 16384), (512, 4096), (4096, 4096)]:
        like = {"device": device, "dtype": torch.bfloat16, "generator": generator}
        q = torch.randn(1, HEADS, n, DIM, **like)
        k = torch.randn(1, KV_HEADS, s, DIM, **like)
        v = torch.randn_like(k)
        params = SDPAParams(q, k, v, None, 0.0, False, True)
        flash_ok = can_use_flash_attention(params, debug=True)
        efficient_ok = can_use_efficient_attention(params, debug=False)
        bias = causal_lower_right(n, s)
        today_ms, today = timed(
            lambda q=q, k=k, v=v, bias=bias: F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, enable_gqa=True
            )
        )
        padded_q = torch.cat((q.new_zeros(1, HEADS, s - n, DIM), q), dim=2)
        padded_ms, padded = timed(
            lambda padded_q=padded_q, k=k, v=v, n=n: F.scaled_dot_product_attention(
                padded_q, k, v, is_causal=True, enable_gqa=True
            )[:, :, -n:]
        )

        def flash(q=q, k=k, v=v) -> torch.Tensor:
            group = HEADS // KV_HEADS
            k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k_all, v_all, 0.0, True)[0]

        flash_ms, direct = timed(flash)
        padded_diff = (padded - today).abs().max().item()
        direct_diff = (direct - today).abs().max().item()
        print(
            f"n={n:6d} S={s:6d}: lower-right bias {today_ms:7.2f} ms | padded causal "
            f"{padded_ms:7.2f} ms (max diff {padded_diff:.3g}) | flash "
            f"op, expanded KV {flash_ms:7.2f} ms (max diff {direct_diff:.3g})"
            f" | can use flash (GQA): {flash_ok}, efficient: {efficient_ok}",
            flush=True,
        )


if __name__ == "__main__":
    main()
