"""The yardsticks of ``kvstore bench engine``: the cold prefill a user would run instead of
ours, and the device's matrix-multiply rate.

- :class:`ReferencePrefill`: transformers' ``LlamaForCausalLM`` (SDPA attention, logits for
  the last position only) with our model's shape, dtype, device and weights (copied from our
  model: random or local, never from a hub). A cached prefill that is not faster than this
  forward is not worth its fetch.
- :func:`matmul_tflops`: a square matrix product's rate (bf16 on GPU, fp32 on CPU, the
  engine's dtype; torch.mm or the engine's linear layer, whichever is faster): what
  ``cold_mfu`` divides by.
- :func:`prefill_flops`: the forward's arithmetic, counted as the matmuls of the layers, the
  causal attention and the last position's LM head.
"""

from __future__ import annotations

import time

import torch

from engine_adapter.config import ModelConfig
from engine_adapter.model import Linear, LlamaModel


def prefill_flops(cfg: ModelConfig, start: int, end: int) -> float:
    """FLOPs to compute positions [start, end) after ``start`` cached ones, logits of the last.

    Linear layers: 2 per weight per token. Attention: 2 per query-key pair and head for the
    scores, 2 more for the values (each query sees the keys up to its own position). MLA's
    per-step expansion of the cached latents is left out.
    """
    n = end - start
    embedding = cfg.vocab_size * cfg.hidden_size
    linear_params = cfg.num_params() - embedding * (1 if cfg.tie_word_embeddings else 2)
    value_dim = cfg.v_head_dim if cfg.is_mla else cfg.head_dim
    pairs = n * start + n * (n + 1) / 2  # query-key pairs under the causal mask
    attention = 2 * cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + value_dim) * pairs
    return 2.0 * linear_params * n + attention + 2.0 * embedding


def matmul_tflops(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> float:
    """The best rate of ``repeats`` square matrix products (8192 on GPU, 2048 on CPU), TFLOP/s,
    by torch.mm or by the engine's linear layer (oneDNN's packed GEMM on CPU in fp32, faster
    there than torch.mm's): the fastest matrix product the engine could run."""
    size = 8192 if device.type == "cuda" else 2048
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    linear = Linear(size, size).to(device=device, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(b.T)
    best_s = float("inf")
    for product in (lambda: torch.mm(a, b), lambda: linear(a)):
        for _ in range(repeats + 1):  # the first one warms up
            _synchronize(device)
            started = time.perf_counter()
            with torch.inference_mode():
                product()
            _synchronize(device)
            best_s = min(best_s, time.perf_counter() - started)
    return 2 * size**3 / best_s / 1e12


class ReferencePrefill:
    """transformers' Llama with our model's weights; ``__call__`` times one cold prefill."""

    def __init__(self, model: LlamaModel) -> None:
        import transformers  # only the benchmark needs it

        cfg = model.config
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        with torch.device(device):
            reference = transformers.LlamaForCausalLM(hf_llama_config(cfg))
        reference.load_state_dict(model.state_dict(), strict=True)  # our weights, bit for bit
        self.model = reference.to(dtype).eval().requires_grad_(False)
        self.device = device

    @torch.inference_mode()
    def __call__(self, prompt: list[int]) -> tuple[float, int]:
        """(seconds from the ids to the first token's id, that id) for a cold ``prompt``."""
        started = time.perf_counter()
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)  # [1, L]
        logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        first_token_id = int(logits[0, -1].argmax())  # waits for the device
        return time.perf_counter() - started, first_token_id


def hf_llama_config(cfg: ModelConfig, attn_implementation: str = "sdpa"):  # -> LlamaConfig
    """Our GQA shape as a ``LlamaConfig`` (SDPA attention: the fast reference; the model
    tests compare against "eager")."""
    import transformers

    if cfg.is_mla:
        raise ValueError("the reference prefill is transformers' Llama: GQA models only")
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation=attn_implementation,
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
