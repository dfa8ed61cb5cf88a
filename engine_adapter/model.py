"""A Llama-architecture decoder in plain torch: RMSNorm, RoPE, grouped-query attention,
SwiGLU, tied or untied embeddings, reading and writing a paged KV cache.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.self_attn.
q_proj.weight`` ...), so one state dict loads into both and tests can compare logits. RoPE
uses the Hugging Face "rotate half" convention: q/k weights from GGUF files are un-permuted
on load (``weights.py``).

Shapes: ``n`` new tokens, ``S`` tokens attended to, ``H`` query heads, ``Hkv`` KV heads,
``D`` head dim. One forward call processes one chunk of one sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right

from engine_adapter.config import ModelConfig
from engine_adapter.paged_kv import BlockTable, PagedKVCache

LayerHook = Callable[[int], None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference, whatever the compute dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Cos/sin tables for positions [0, max_positions), computed once in fp32."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables in fp32 on the buffers' device."""
        if self.cos.is_meta:
            return
        d, device = self.head_dim, self.cos.device
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
        inv_freq = 1.0 / self.theta**exponents  # [D/2]
        positions = torch.arange(self.max_positions, device=device).float()
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate ``x`` ``[n, heads, D]`` holding positions [start, start + n)."""
        n, half = x.shape[0], x.shape[-1] // 2
        cos = self.cos[start : start + n, None, :].to(x.dtype)  # [n, 1, D]
        sin = self.sin[start : start + n, None, :].to(x.dtype)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # [n, H, D]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = ctx.rotary(q, ctx.start), ctx.rotary(k, ctx.start)
        ctx.before_layer(layer)
        ctx.cache.write(layer, ctx.slots, k, v)
        kv = ctx.cache.read(layer, ctx.table, ctx.end)  # [2, Hkv, S, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            kv[0].unsqueeze(0),  # [1, Hkv, S, D]
            kv[1].unsqueeze(0),
            attn_mask=ctx.causal_mask,  # [n, S] (or a CausalBias), None when all keys are visible
            enable_gqa=True,
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))  # [n, H*D]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class ForwardContext:
    """Everything one chunk's forward pass needs besides the weights."""

    def __init__(
        self,
        rotary: Rotary,
        cache: PagedKVCache,
        table: BlockTable,
        start: int,
        end: int,
        before_layer: LayerHook | None,
    ) -> None:
        self.rotary, self.cache, self.table = rotary, cache, table
        self.start, self.end = start, end
        self.before_layer = before_layer or (lambda layer: None)
        self.slots = cache.slots(table, start, end)  # [n], computed once for every layer
        self.causal_mask = _causal_mask(start, end, cache.kv.device)


def _causal_mask(start: int, end: int, device: torch.device) -> torch.Tensor | CausalBias | None:
    """Query at position p sees keys at positions <= p (None when n == 1: it sees all).

    On CUDA a lower-right causal bias lets SDPA pick its flash kernel; elsewhere an explicit
    ``[n, S]`` bool mask (the same values; CausalBias would rebuild it for every layer).
    """
    if end - start == 1:
        return None
    if device.type == "cuda":
        return causal_lower_right(end - start, end)
    query_pos = torch.arange(start, end, device=device)[:, None]
    return torch.arange(end, device=device)[None, :] <= query_pos


class Backbone(nn.Module):
    """Hugging Face's ``model.*`` part: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """The decoder plus LM head; ``forward`` runs one chunk against the paged cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head if the config says so (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        start: int,
        cache: PagedKVCache,
        table: BlockTable,
        before_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` after the final norm for tokens at [start, start+n).

        Writes the chunk's K and V into ``cache`` through ``table`` (which must already
        cover position start + n - 1). ``before_layer(i)`` runs before layer ``i`` reads the
        cache: the swap-in waits there for that layer's fetched blocks.
        """
        end = start + token_ids.shape[0]
        if end > self.config.max_position_embeddings:
            raise ValueError(
                f"position {end - 1} is past the model's context length "
                f"{self.config.max_position_embeddings}; shorten the prompt"
            )
        ctx = ForwardContext(self.rotary, cache, table, start, end, before_layer)
        x = self.model.embed_tokens(token_ids)  # [n, hidden]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ctx, i)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[..., vocab]`` in fp32."""
        return self.lm_head(hidden).float()
