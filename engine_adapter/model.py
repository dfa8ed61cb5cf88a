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


class Linear(nn.Linear):
    """``nn.Linear`` without a bias that runs oneDNN's GEMM on a prepacked weight where it can:
    on a CPU with oneDNN, in fp32. torch's own fp32 GEMM there (MKL) took 15-20% longer on
    the 2-core AMD machine (a [1,024 x 576] by [576 x 1,536] product: 10-11 ms against 8.6).
    The packed copy follows the weight: it is made again whenever the weight's storage,
    version (any in-place write, ``load_state_dict`` included), device or dtype changed."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self._packed: torch.Tensor | None = None
        self._packed_for: tuple[int, int, torch.device, torch.dtype] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not (_ONEDNN and weight.device.type == "cpu" and weight.dtype == torch.float32):
            return F.linear(x, weight)
        key = (weight.data_ptr(), weight._version, weight.device, weight.dtype)
        if self._packed_for != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._packed_for = key
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, None, "none", [], ""
        )


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
    """Cos/sin tables for positions [0, max_positions), computed once in fp32, and their copies
    in each dtype and on each device that forward met (cast once, not in every layer)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        # (dtype, device) -> (cos, sin with its first half negated), in that dtype
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables in fp32 on the buffers' device."""
        self._cast.clear()
        if self.cos.is_meta:
            return
        d, device = self.head_dim, self.cos.device
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d
        inv_freq = 1.0 / self.theta**exponents  # [D/2]
        positions = torch.arange(self.max_positions, device=device).float()
        freqs = torch.outer(positions, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, x: torch.Tensor, start: int, rows: int | None = None) -> torch.Tensor:
        """Rotate ``x`` ``[n, heads, D]`` holding positions [start, start + n); only its first
        ``rows`` rows when given (the rest is padding: see ``Chunks``)."""
        if rows is not None and rows < x.shape[0]:
            return torch.cat((self(x[:rows], start), x[rows:]))
        n, half = x.shape[0], x.shape[-1] // 2
        cos, signed_sin = self._tables(x.dtype, x.device)
        # rotate_half(x) * sin with the sign on the table: (-a) * b and a * (-b) are the same
        # bits, and so are the casts of -s and s; three kernels fewer per call (a 512-token
        # suffix on the GPU is bound by its launches: docs/runs/stop48-gpu)
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return x * cos[start : start + n] + swapped * signed_sin[start : start + n]

    def _tables(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dtype, device)
        if key not in self._cast:
            half = self.head_dim // 2
            cos, sin = self.cos.to(device, dtype), self.sin.to(device, dtype)
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
            self._cast[key] = (cos[:, None, :], signed_sin[:, None, :])  # [P, 1, D]
        return self._cast[key]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)

    def forward(self, x: torch.Tensor, chunks: Chunks, layer: int) -> torch.Tensor:
        n, first = x.shape[0], chunks[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)  # [n, H, D]
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [n, Hkv, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        q, k = first.rotary(q, first.start, chunks.rows), first.rotary(k, first.start, chunks.rows)
        first.before_layer(layer)

        def attend(q: torch.Tensor, kv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
            out = _grouped_attention(
                q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
                kv[0].unsqueeze(0),  # [1, Hkv, S, D]
                kv[1].unsqueeze(0),
                ctx.causal_mask,  # [n, S] or a CausalBias; None: all keys visible
            )
            return out[0].transpose(0, 1)  # [n, H, D]

        out = chunks.attend(layer, q, (k, v), attend)  # each K and V written: [n, Hkv, D]
        return self.o_proj(out.reshape(n, -1))  # [n, H*D]


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
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out)
        else:
            self.q_proj = Linear(cfg.hidden_size, q_out)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.latent_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        kv_b_out = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, kv_b_out)
        self.o_proj = Linear(cfg.num_heads * cfg.v_head_dim, cfg.hidden_size)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.low_rank_q:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, chunks: Chunks, layer: int) -> torch.Tensor:
        n, heads, first = x.shape[0], self.num_heads, chunks[0]
        q = self._queries(x).view(n, heads, self.nope_dim + self.rope_dim)  # [n, H, Dn+R]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        compressed, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )  # [n, C], [n, R]
        k_rope = first.rotary(k_rope[:, None], first.start, chunks.rows)  # [n, 1, R]
        latent = torch.cat((self.kv_a_layernorm(compressed)[:, None], k_rope), dim=-1)
        q = torch.cat((q_nope, first.rotary(q_rope, first.start, chunks.rows)), dim=-1)
        first.before_layer(layer)

        def attend(q: torch.Tensor, cached: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
            c_kv, k_rope_all = cached[0, 0].split([self.kv_lora_rank, self.rope_dim], dim=-1)
            kv = self.kv_b_proj(c_kv).view(-1, heads, self.nope_dim + self.v_dim)  # [S, H, Dn+Dv]
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat((k_nope, k_rope_all[:, None].expand(-1, heads, -1)), dim=-1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),  # [1, H, n, Dn+R]
                k.transpose(0, 1).unsqueeze(0),  # [1, H, S, Dn+R]
                v.transpose(0, 1).unsqueeze(0),  # [1, H, S, Dv]
                attn_mask=ctx.causal_mask,
                scale=self.scale,
            )
            return out[0].transpose(0, 1)  # [n, H, Dv]

        out = chunks.attend(layer, q, (latent,), attend)  # the latent written: [n, 1, C+R]
        return self.o_proj(out.reshape(n, -1))  # [n, H*Dv]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LatentAttention(cfg) if cfg.is_mla else Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, chunks: Chunks, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), chunks, layer)
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
        self.causal_mask = _causal_mask(start, end, cache.kv.device, cache.kv.dtype)


Attend = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


class Chunks(list[ForwardContext]):
    """The chunks of one forward call, in order, over ``rows`` real rows of the hidden states
    (any rows past them are padding: ``LlamaModel.forward``)."""

    def __init__(self, contexts: list[ForwardContext]) -> None:
        super().__init__(contexts)
        self.rows = contexts[-1].end - contexts[0].start
        self.slots = (
            contexts[0].slots if len(contexts) == 1 else torch.cat([c.slots for c in contexts])
        )

    def attend(
        self, layer: int, q: torch.Tensor, parts: tuple[torch.Tensor, ...], attend: Attend
    ) -> torch.Tensor:
        """Each chunk's queries against the cache up to the chunk's end: writes every row of
        ``parts`` (K and V, or the latent) into ``layer`` at once, then calls ``attend(the
        chunk's rows of q, the layer's cache read to the chunk's end, chunk)``; the outputs'
        rows in order."""
        first = self[0]
        first.cache.write(layer, self.slots, *(part[: self.rows] for part in parts))
        if len(self) == 1 and self.rows == q.shape[0]:
            return attend(q, first.cache.read(layer, first.table, first.end), first)
        out: torch.Tensor | None = None
        for ctx in self:
            rows = slice(ctx.start - first.start, ctx.end - first.start)
            chunk_out = attend(q[rows], ctx.cache.read(layer, ctx.table, ctx.end), ctx)
            if out is None:
                out = chunk_out.new_empty(q.shape[0], *chunk_out.shape[1:])
                out[self.rows :] = 0  # padding rows: the layers after are row by row
            out[rows] = chunk_out
        assert out is not None
        return out


# The fewest rows an exact-chunk call runs its row-wise kernels on: math libraries pick
# other kernels for a few rows (torch's CPU fp32 GEMM on the 2-core AMD machine: another sum
# order for 1-11 rows, the same from 12 up), so shorter calls are padded with zero rows.
MIN_EXACT_ROWS = 16
# Row ranges of one 128-row call that rows_are_exact compares with calls of their own
_PROBE_ROWS = 128
_PROBE_SLICES = ((0, 16), (16, 41), (41, 128), (7, 100), (64, 128))


def rows_are_exact(layer: nn.Module) -> bool:
    """Whether each row-wise module of ``layer`` (linear layers, norms) gives a row the same
    bits in a call of any size from ``MIN_EXACT_ROWS`` rows, on the layer's device and dtype.

    Checked on random rows: kernels are chosen by shape, never by value, so shapes that agree
    here agree on any data of those shapes. The layers of a model share their shapes.
    """
    weight = next(layer.parameters())
    generator = torch.Generator(weight.device).manual_seed(0)
    for module in layer.modules():
        if isinstance(module, nn.Linear):
            width = module.in_features
        elif isinstance(module, RMSNorm):
            width = module.weight.shape[0]
        else:
            continue
        x = torch.randn(_PROBE_ROWS, width, generator=generator, device=weight.device)
        x = x.to(weight.dtype)
        whole = module(x)
        if not all(torch.equal(module(x[a:b]), whole[a:b]) for a, b in _PROBE_SLICES):
            return False
    return True


def chunk_bounds(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) cut at absolute multiples of ``chunk_tokens`` (0: not cut at all)."""
    if chunk_tokens <= 0:
        return [(start, end)]
    bounds = [start, *range((start // chunk_tokens + 1) * chunk_tokens, end, chunk_tokens), end]
    return list(itertools.pairwise(bounds))


def _causal_mask(
    start: int, end: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor | CausalBias | None:
    """Query at position p sees keys at positions <= p (None when n == 1: it sees all).

    On CUDA a lower-right causal bias lets SDPA pick its flash kernel; elsewhere an explicit
    ``[n, S]`` additive mask (0 or -inf, the bits SDPA's CPU kernel gives a bool mask, which it
    would convert in every layer; CausalBias would rebuild it for every layer).
    """
    if end - start == 1:
        return None
    if device.type == "cuda":
        return causal_lower_right(end - start, end)
    query_pos = torch.arange(start, end, device=device)[:, None]
    hidden = torch.arange(end, device=device)[None, :] > query_pos
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, -torch.inf)


# Where n queries follow a cached prefix (n < S keys), SDPA's lower-right causal flash kernel
# costs about 1.5x per query-key pair what its plain causal kernel does on S queries (H100,
# random:1b's heads: docs/runs/stop52-gpu/attention_probe.txt: n=14,848, S=16,384: 3.64 ms a
# layer against 2.33 for S=16,384 padded rows; n=2,048: 0.86 against 2.29). Padding the
# queries to S rows pays where S*S/2 < 1.5 * (n*S - n*n/2): n above about 0.42 S, and only
# for long contexts: in the engine (docs/runs/stop52-gpu, call 4) 16k at 10% cached computed
# its suffix in 120 ms against 135, at 50% in 84 against 88; 4k at 50% in 18 against 16.
PAD_QUERIES_ABOVE = 0.42
PAD_MIN_KEYS = 8192


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | CausalBias | None
) -> torch.Tensor:
    """SDPA of ``q`` [1, H, n, D] over ``k``, ``v`` [1, Hkv, S, D] under ``mask``. A lower-right
    causal mask with n above PAD_QUERIES_ABOVE of S, S at least PAD_MIN_KEYS, runs as plain
    causal attention of the queries padded at the front with zero rows, whose outputs are
    dropped: the same attention, the faster kernel."""
    n, s = q.shape[2], k.shape[2]
    if isinstance(mask, CausalBias) and PAD_QUERIES_ABOVE * s < n < s and s >= PAD_MIN_KEYS:
        padded = torch.cat((q.new_zeros(*q.shape[:2], s - n, q.shape[3]), q), dim=2)
        out = F.scaled_dot_product_attention(padded, k, v, is_causal=True, enable_gqa=True)
        return out[:, :, s - n :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


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
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # one row a call
        self.tie_weights()
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self._rows_exact_for: tuple[torch.device, torch.dtype] | None = None
        self._rows_exact_answer = False

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

        ``chunk_tokens`` > 0 cuts the tokens at absolute multiples of it, and a chunk gives
        the same bits whether the tokens before it were fetched or computed: its attention
        reads the cache up to the chunk's end alone, and the row-wise kernels (linear
        layers, norms) give its rows the same bits in any call. Where ``rows_are_exact``
        finds that so on this device, those kernels run on all the tokens of a layer at once
        (calls padded to ``MIN_EXACT_ROWS``): 64-row GEMMs ran at half the rate of 1,024-row
        ones on the 2-core CPU. Elsewhere each chunk runs its whole layer alone, layer-major
        (every chunk of layer 0, then of layer 1 ...). 0 runs all the tokens through each
        layer at once, attention included: the fewest, largest kernels (a GPU's choice),
        whose rounding depends on how much of the prompt was cached.
        """
        end = start + token_ids.shape[0]
        if end > self.config.max_position_embeddings:
            raise ValueError(
                f"position {end - 1} is past the model's context length "
                f"{self.config.max_position_embeddings}; shorten the prompt"
            )
        bounds = chunk_bounds(start, end, chunk_tokens)
        chunks = Chunks([  # the hook goes with the first chunk: it waits once per layer
            ForwardContext(self.rotary, cache, table, a, b, before_layer if k == 0 else None)
            for k, (a, b) in enumerate(bounds)
        ])  # fmt: skip
        x = self.model.embed_tokens(token_ids)  # [n, hidden]
        if chunk_tokens > 0 and not self._rows_exact():
            for i, layer in enumerate(self.model.layers):  # each chunk's kernels on their own
                x = _per_chunk(
                    lambda part, ctx, i=i, layer=layer: layer(part, Chunks([ctx]), i), x, chunks
                )
            return _per_chunk(lambda part, ctx: self.model.norm(part), x, chunks)
        n = x.shape[0]
        if chunk_tokens > 0 and n < MIN_EXACT_ROWS:
            x = torch.cat((x, x.new_zeros(MIN_EXACT_ROWS - n, x.shape[1])))
        for i, layer in enumerate(self.model.layers):
            x = layer(x, chunks, i)
        return self.model.norm(x)[:n]

    def _rows_exact(self) -> bool:
        """rows_are_exact for this model's layers, checked once (again after a move)."""
        weight = self.lm_head.weight
        key = (weight.device, weight.dtype)
        if self._rows_exact_for != key:
            self._rows_exact_answer = rows_are_exact(self.model.layers[0])
            self._rows_exact_for = key
        return self._rows_exact_answer

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[..., vocab]`` in fp32."""
        return self.lm_head(hidden).float()
