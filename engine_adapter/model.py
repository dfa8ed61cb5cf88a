"""A Llama-architecture decoder in plain torch: RMSNorm, RoPE, grouped-query attention,
SwiGLU, tied or untied embeddings, reading and writing a paged KV cache; or, with
``attention="mla"``, DeepSeek-V2/V3's multi-head latent attention in place of GQA.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` (``model.layers.0.self_attn.
q_proj.weight`` ...) and, for MLA, ``DeepseekV3ForCausalLM`` with dense MLPs (``q_a_proj``,
``kv_a_proj_with_mqa``, ``kv_b_proj`` ...), so one state dict loads into both and tests can
compare logits. RoPE uses the Hugging Face "rotate half" convention: q/k weights from GGUF
files are un-permuted on load (``weights.py``).

Shapes: ``n`` new tokens, ``S`` tokens attended to, ``H`` query heads, ``Hkv`` KV heads,
``D`` head dim; MLA: ``C`` compressed KV width (kv_lora_rank), ``R`` RoPE key width,
``Dn`` per-head key width without RoPE, ``Dv`` value width. One forward call processes a
range of one sequence's tokens, chunk by chunk or all at once (``LlamaModel.forward``).
"""

from __future__ import annotations

import itertools
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
        ctx.cache.write(layer, ctx.slots, k, v)  # each [n, Hkv, D]
        kv = ctx.cache.read(layer, ctx.table, ctx.end)  # [2, Hkv, S, D]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            kv[0].unsqueeze(0),  # [1, Hkv, S, D]
            kv[1].unsqueeze(0),
            attn_mask=ctx.causal_mask,  # [n, S] (or a CausalBias), None when all keys are visible
            enable_gqa=True,
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))  # [n, H*D]


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA), the "naive" form: the cache holds one
    latent per token (compressed KV after its norm, and the RoPE key shared by all heads);
    each step expands the cached latents into per-head keys and values with ``kv_b_proj``.
    What is cached, and so what the store holds, is exactly vLLM's MLA cache content."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.rope_dim = cfg.num_heads, cfg.head_dim
        self.kv_lora_rank, self.nope_dim, self.v_dim = (
            cfg.kv_lora_rank,
            cfg.qk_nope_head_dim,
            cfg.v_head_dim,
        )
        self.scale = cfg.qk_head_dim**-0.5
        q_out = cfg.num_heads * cfg.qk_head_dim
        self.low_rank_q = cfg.q_lora_rank > 0
        if self.low_rank_q:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        kv_b_out = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, kv_b_out, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.low_rank_q:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        n, heads = x.shape[0], self.num_heads
        q = self._queries(x).view(n, heads, self.nope_dim + self.rope_dim)  # [n, H, Dn+R]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        compressed, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )  # [n, C], [n, R]
        k_rope = ctx.rotary(k_rope[:, None], ctx.start)  # [n, 1, R]
        latent = torch.cat((self.kv_a_layernorm(compressed)[:, None], k_rope), dim=-1)
        ctx.before_layer(layer)
        ctx.cache.write(layer, ctx.slots, latent)  # [n, 1, C+R]
        cached = ctx.cache.read(layer, ctx.table, ctx.end)[0, 0]  # [S, C+R]
        c_kv, k_rope_all = cached.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(-1, heads, self.nope_dim + self.v_dim)  # [S, H, Dn+Dv]
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope_all[:, None].expand(-1, heads, -1)), dim=-1)  # [S, H, Dn+R]
        q = torch.cat((q_nope, ctx.rotary(q_rope, ctx.start)), dim=-1)  # [n, H, Dn+R]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, Dn+R]
            k.transpose(0, 1).unsqueeze(0),  # [1, H, S, Dn+R]
            v.transpose(0, 1).unsqueeze(0),  # [1, H, S, Dv]
            attn_mask=ctx.causal_mask,
            scale=self.scale,
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))  # [n, H*Dv]


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
        self.self_attn = LatentAttention(cfg) if cfg.is_mla else Attention(cfg)
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


def chunk_bounds(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) cut at absolute multiples of ``chunk_tokens`` (0: not cut at all)."""
    if chunk_tokens <= 0:
        return [(start, end)]
    bounds = [start, *range((start // chunk_tokens + 1) * chunk_tokens, end, chunk_tokens), end]
    return list(itertools.pairwise(bounds))


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


def _per_chunk(
    fn: Callable[[torch.Tensor, ForwardContext], torch.Tensor],
    x: torch.Tensor,
    contexts: list[ForwardContext],
) -> torch.Tensor:
    """``fn`` applied to each chunk's rows of ``x`` ``[n, hidden]`` on its own."""
    if len(contexts) == 1:
        return fn(x, contexts[0])
    first, out = contexts[0].start, torch.empty_like(x)
    for ctx in contexts:
        out[ctx.start - first : ctx.end - first] = fn(x[ctx.start - first : ctx.end - first], ctx)
    return out


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
        chunk_tokens: int = 0,
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` after the final norm for tokens at [start, start+n).

        Writes the tokens' K and V into ``cache`` through ``table`` (which must already
        cover position start + n - 1). ``before_layer(i)`` runs once, before layer ``i``
        first reads the cache: the swap-in waits there for that layer's fetched blocks.

        ``chunk_tokens`` > 0 cuts the tokens at absolute multiples of it and runs each
        chunk's kernels on the chunk alone, so a chunk gives the same bits whether the
        tokens before it were fetched or computed. The loop is layer-major (every chunk of
        layer 0, then of layer 1 ...): one layer's weights stay in cache across its chunks,
        where chunk-major order streamed all the weights once per chunk (64-token chunks
        cost 1.8x on a 2-core CPU that way). 0 runs all the tokens through each layer at
        once: the fewest, largest kernels (a GPU's choice).
        """
        end = start + token_ids.shape[0]
        if end > self.config.max_position_embeddings:
            raise ValueError(
                f"position {end - 1} is past the model's context length "
                f"{self.config.max_position_embeddings}; shorten the prompt"
            )
        bounds = chunk_bounds(start, end, chunk_tokens)
        contexts = [  # the hook goes with the first chunk: it waits once per layer
            ForwardContext(self.rotary, cache, table, a, b, before_layer if k == 0 else None)
            for k, (a, b) in enumerate(bounds)
        ]
        x = self.model.embed_tokens(token_ids)  # [n, hidden]
        for i, layer in enumerate(self.model.layers):
            x = _per_chunk(lambda part, ctx, i=i, layer=layer: layer(part, ctx, i), x, contexts)
        return _per_chunk(lambda part, ctx: self.model.norm(part), x, contexts)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[..., vocab]`` in fp32."""
        return self.lm_head(hidden).float()
