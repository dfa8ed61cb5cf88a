"""The model against an independent reference: transformers' LlamaForCausalLM."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bench.reference_prefill import hf_llama_config  # noqa: E402
from engine_adapter.config import ModelConfig  # noqa: E402
from engine_adapter.kv_layout import KVBlockLayout  # noqa: E402
from engine_adapter.loader import load_model  # noqa: E402
from engine_adapter.model import Linear, Rotary, rows_are_exact  # noqa: E402
from engine_adapter.paged_kv import BlockTable, PagedKVCache  # noqa: E402
from engine_adapter.weights import _unpermute_rope  # noqa: E402

pytestmark = pytest.mark.engine
BLOCK_TOKENS = 16


def hf_reference(model):  # -> transformers.LlamaForCausalLM with the same weights
    reference = transformers.LlamaForCausalLM(hf_llama_config(model.config, "eager")).eval()
    reference.load_state_dict(model.state_dict(), strict=True)
    return reference


def paged_logits(model, token_ids, chunk_tokens: int, block_ids=None):
    """Logits of every position, prefilled chunk by chunk through a paged cache."""
    layout = KVBlockLayout.for_model(model.config, BLOCK_TOKENS, "float32")
    num_blocks = -(-len(token_ids) // BLOCK_TOKENS)
    cache = PagedKVCache(layout, 2 * num_blocks + 2, torch.device("cpu"))
    table = BlockTable(BLOCK_TOKENS, block_ids or list(range(num_blocks)))
    hidden = [
        model(token_ids[s : s + chunk_tokens], s, cache, table)
        for s in range(0, len(token_ids), chunk_tokens)
    ]
    return model.logits(torch.cat(hidden))


@pytest.fixture(scope="module")
def small_model():
    return load_model("random:small", "cpu", "float32", seed=3).model


def test_random_model_logits_match_transformers(small_model):
    token_ids = torch.randint(
        0, small_model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(0)
    )
    ours = paged_logits(small_model, token_ids, chunk_tokens=32)
    with torch.no_grad():
        reference = hf_reference(small_model)(token_ids[None]).logits[0]
    torch.testing.assert_close(
        ours, reference, atol=1e-4, rtol=1e-4, msg="model math differs from Llama"
    )


def test_default_model_logits_match_transformers(default_model):
    model, tokenizer = default_model.model, default_model.tokenizer
    messages = [{"role": "user", "content": "Explain paged attention in two sentences."}]
    token_ids = torch.tensor(tokenizer.apply_chat_template(messages))
    ours = paged_logits(model, token_ids, chunk_tokens=BLOCK_TOKENS)
    with torch.no_grad():
        reference = hf_reference(model)(token_ids[None]).logits[0]
    torch.testing.assert_close(
        ours, reference, atol=2e-4, rtol=1e-4, msg="SmolLM2 logits differ from transformers"
    )


@pytest.mark.slow  # transformers dequantises the whole file again (~15 s)
def test_gguf_weights_match_transformers_gguf_loader(default_model, default_gguf_path):
    """transformers dequantises and un-permutes GGUF tensors with its own code."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(default_gguf_path))
    config_kwargs = {
        k: v for k, v in parsed["config"].items() if not k.startswith(("_", "model_type"))
    }
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_kwargs))
    reference = load_gguf_checkpoint(
        str(default_gguf_path), return_tensors=True, model_to_load=skeleton
    )
    ours = default_model.model.state_dict()
    assert set(reference["tensors"]) <= set(ours), "weight names differ from transformers'"
    for name, tensor in reference["tensors"].items():
        assert torch.equal(ours[name], tensor.float()), (
            f"{name}: dequantisation or q/k un-permute is wrong"
        )


def test_unpermute_inverts_llama_cpp_permute():
    """convert_hf_to_gguf.py's permute, copied here; ours must be its exact inverse."""

    def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
        shape = weights.shape
        return (
            weights.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
            .swapaxes(1, 2)
            .reshape(shape)
        )

    weights = np.random.default_rng(0).normal(size=(3 * 64, 40)).astype(np.float32)
    assert np.array_equal(_unpermute_rope(llama_cpp_permute(weights, 3), 3), weights)


def test_safetensors_directory_written_by_transformers(tmp_path):
    cfg = ModelConfig(
        vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, tie_word_embeddings=False, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(hf_llama_config(cfg, "eager")).eval()
    reference.save_pretrained(tmp_path, safe_serialization=True)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    loaded = load_model(str(tmp_path), "cpu", "float32")
    token_ids = torch.arange(40) * 7 % cfg.vocab_size
    with torch.no_grad():
        expected = reference(token_ids[None]).logits[0]
    torch.testing.assert_close(
        paged_logits(loaded.model, token_ids, 16), expected, atol=1e-4, rtol=1e-4
    )


def test_chunking_and_block_placement_do_not_change_logits(small_model):
    token_ids = torch.randint(
        0, small_model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(1)
    )
    whole = paged_logits(small_model, token_ids, chunk_tokens=96)
    scattered = paged_logits(small_model, token_ids, chunk_tokens=32, block_ids=[9, 2, 7, 0, 4, 11])
    one_by_one = paged_logits(small_model, token_ids, chunk_tokens=1)
    torch.testing.assert_close(
        scattered, whole, atol=1e-5, rtol=1e-5, msg="block-table gather is wrong"
    )
    torch.testing.assert_close(
        one_by_one, whole, atol=1e-5, rtol=1e-5, msg="decode-step path differs"
    )


def _one_pass_kv(model, token_ids, chunk_tokens: int, block_ids: list[int]):
    """(hidden states, the cache's KV) of one forward over ``token_ids`` in chunks."""
    layout = KVBlockLayout.for_model(model.config, BLOCK_TOKENS, "float32")
    cache = PagedKVCache(layout, 12, torch.device("cpu"))
    table = BlockTable(BLOCK_TOKENS, block_ids)
    hidden = model(token_ids, 0, cache, table, chunk_tokens=chunk_tokens)
    return hidden, cache.read(0, table, len(token_ids)), cache.read(3, table, len(token_ids))


@pytest.mark.parametrize("block_ids", [[0, 1, 2, 3, 4, 5], [9, 2, 7, 0, 4, 11]])
def test_one_layer_major_pass_is_bitwise_the_chunk_by_chunk_calls(small_model, block_ids):
    """The engine's prefill runs the chunks of each layer in one call (layer-major); its
    hidden states and KV must be the very bits of separate per-chunk calls (chunk-major), or
    swapped-in KV would no longer equal recomputed KV."""
    token_ids = torch.randint(
        0, small_model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(2)
    )
    hidden, *kv = _one_pass_kv(small_model, token_ids, 32, block_ids)
    layout = KVBlockLayout.for_model(small_model.config, BLOCK_TOKENS, "float32")
    cache = PagedKVCache(layout, 12, torch.device("cpu"))
    table = BlockTable(BLOCK_TOKENS, block_ids)
    chunks = [small_model(token_ids[s : s + 32], s, cache, table) for s in range(0, 96, 32)]
    assert torch.equal(hidden, torch.cat(chunks)), "layer-major chunks changed the hidden states"
    assert torch.equal(kv[0], cache.read(0, table, 96)), "layer-major chunks changed layer 0's KV"
    assert torch.equal(kv[1], cache.read(3, table, 96)), "layer-major chunks changed layer 3's KV"
    whole, *_ = _one_pass_kv(small_model, token_ids, 0, block_ids)
    torch.testing.assert_close(whole, hidden, atol=1e-5, rtol=1e-5, msg="one-chunk pass differs")


@pytest.mark.parametrize("num_tokens", [70, 65])
def test_a_short_suffix_gets_the_bits_of_the_whole_pass(small_model, num_tokens):
    """A cached prefill computes only the chunks after the fetched ones, down to a single
    row; each row must get the bits the cold pass over every row gave it (short calls are
    padded to MIN_EXACT_ROWS, where a few-row GEMM would take another kernel)."""
    token_ids = torch.randint(
        0, small_model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(4)
    )
    cold, *cold_kv = _one_pass_kv(small_model, token_ids, 32, list(range(5)))
    layout = KVBlockLayout.for_model(small_model.config, BLOCK_TOKENS, "float32")
    cache = PagedKVCache(layout, 12, torch.device("cpu"))
    table = BlockTable(BLOCK_TOKENS, list(range(5)))
    small_model(token_ids[:64], 0, cache, table, chunk_tokens=32)  # two chunks cached
    suffix = small_model(token_ids[64:], 64, cache, table, chunk_tokens=32)
    assert torch.equal(suffix, cold[64:]), f"the {num_tokens - 64} rows after the cached ones"
    assert torch.equal(cache.read(3, table, num_tokens), cold_kv[1]), "the suffix's KV differs"


class _RowDependentLinear(torch.nn.Linear):
    """A linear layer whose rows depend on the call's other rows, as a kernel chosen by the
    call's size could make them: rows_are_exact must notice."""

    def forward(self, x):
        return super().forward(x) + 1e-3 * x.shape[0]


def test_kernels_that_depend_on_the_calls_rows_keep_each_chunk_on_its_own():
    model = load_model("random:small", "cpu", "float32", seed=3).model  # changed below
    assert rows_are_exact(model.model.layers[0]), "plain torch kernels on this CPU"
    for layer in model.model.layers:
        mlp = layer.mlp
        changed = _RowDependentLinear(mlp.up_proj.in_features, mlp.up_proj.out_features, False)
        changed.weight = mlp.up_proj.weight
        mlp.up_proj = changed
    assert not rows_are_exact(model.model.layers[0])
    token_ids = torch.randint(
        0, model.config.vocab_size, (96,), generator=torch.Generator().manual_seed(5)
    )
    hidden, *kv = _one_pass_kv(model, token_ids, 32, list(range(6)))
    layout = KVBlockLayout.for_model(model.config, BLOCK_TOKENS, "float32")
    cache = PagedKVCache(layout, 12, torch.device("cpu"))
    table = BlockTable(BLOCK_TOKENS, list(range(6)))
    chunks = [model(token_ids[s : s + 32], s, cache, table) for s in range(0, 96, 32)]
    assert torch.equal(hidden, torch.cat(chunks)), "the chunks shared their kernels' calls"
    assert torch.equal(kv[1], cache.read(3, table, 96))


def test_a_linear_layer_follows_its_weight():
    """The engine's Linear may run on a packed copy of its weight (oneDNN on CPU): every
    change of the weight, in place or by load_state_dict, must reach the output."""
    layer = Linear(32, 8)
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(20, 32, generator=generator)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, 32, generator=generator))
    torch.testing.assert_close(layer(x), x @ layer.weight.T)
    with torch.no_grad():
        layer.weight.mul_(2)
    torch.testing.assert_close(layer(x), x @ layer.weight.T, msg="an in-place change was missed")
    layer.load_state_dict({"weight": torch.randn(8, 32, generator=generator)})
    torch.testing.assert_close(layer(x), x @ layer.weight.T, msg="load_state_dict was missed")
    layer.to(torch.float64)
    torch.testing.assert_close(layer(x.double()), x.double() @ layer.weight.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_gives_the_bits_of_rotate_half(dtype):
    """Rotary's tables cast once, with the sign on sin: the bits of Hugging Face's
    ``x * cos + rotate_half(x) * sin`` cast per call, zeros, infinities and NaNs included, and
    on the buffers' new values after a reset or a move."""

    def rotate_half_reference(rotary, x, start):
        cos = rotary.cos[start : start + x.shape[0], None, :].to(x.dtype)
        sin = rotary.sin[start : start + x.shape[0], None, :].to(x.dtype)
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    int_view = torch.int32 if dtype == torch.float32 else torch.int16
    rotary = Rotary(64, 500_000.0, 4096)
    generator = torch.Generator().manual_seed(3)
    for start in (0, 17, 3000):
        x = (torch.randn(96, 4, 64, generator=generator) * 40).to(dtype)
        x[0, 0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
        x[1, 0, 32:34] = torch.tensor([float("-inf"), -0.0])
        expected = rotate_half_reference(rotary, x, start).view(int_view)
        assert torch.equal(rotary(x, start).view(int_view), expected), start
    rotary.theta = 10_000.0  # new tables: the cast copies must follow
    rotary.reset()
    x = torch.randn(8, 2, 64, generator=generator).to(dtype)
    expected = rotate_half_reference(rotary, x, 100).view(int_view)
    assert torch.equal(rotary(x, 100).view(int_view), expected), "a stale cast table was used"


def test_seeded_random_init_is_reproducible():
    first = load_model("random:tiny", "cpu", "float32", seed=5)
    again = load_model("random:tiny", "cpu", "float32", seed=5)
    other = load_model("random:tiny", "cpu", "float32", seed=6)
    assert first.fingerprint == again.fingerprint != other.fingerprint
    for (name, a), b in zip(
        first.model.state_dict().items(), again.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), f"{name}: random init is not seeded"
    assert first.model.lm_head.weight.data_ptr() == first.model.model.embed_tokens.weight.data_ptr()


def hf_mla_config(cfg: ModelConfig):  # -> transformers.DeepseekV3Config, every MLP dense
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.head_dim,
        v_head_dim=cfg.v_head_dim,
        first_k_dense_replace=cfg.num_layers,  # no MoE layer: the engine's MLP is dense
        rope_interleave=False,  # the engine rotates halves, as Llama does
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="eager",
    )


@pytest.fixture(scope="module")
def mla_model():
    return load_model("random:mla-small", "cpu", "float32", seed=3).model


def test_mla_model_logits_match_transformers_deepseek_v3(mla_model):
    """random:mla-small is DeepSeek-V3's latent attention: the same state dict in transformers'
    DeepseekV3ForCausalLM gives the same logits, chunked prefill through the latent cache."""
    cfg = mla_model.config
    assert (cfg.kv_lora_rank, cfg.head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        512,
        64,
        128,
        128,
    ), "mla-small must keep DeepSeek-V3's per-layer latent shapes"
    reference = transformers.DeepseekV3ForCausalLM(hf_mla_config(cfg)).eval()
    reference.load_state_dict(mla_model.state_dict(), strict=True)
    token_ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(0))
    ours = paged_logits(mla_model, token_ids, chunk_tokens=32)
    with torch.no_grad():
        want = reference(token_ids[None]).logits[0]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4, msg="MLA math differs")
    assert cfg.num_params() == sum(p.numel() for p in mla_model.parameters())


def test_mla_cache_holds_one_latent_per_token_and_layer(mla_model):
    cfg = mla_model.config
    layout = KVBlockLayout.for_model(cfg, BLOCK_TOKENS, "bfloat16")
    assert layout.shape == (cfg.num_layers, 1, 1, BLOCK_TOKENS, 576)
    assert layout.block_bytes == cfg.kv_bytes_per_token("bfloat16") * BLOCK_TOKENS
    assert layout.layer_bytes == 576 * 2 * BLOCK_TOKENS
    assert "mla-latent-layer-major-v1:3x1x1x16x576" in layout.namespace("fp")
    token_ids = torch.randint(0, cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    whole = paged_logits(mla_model, token_ids, chunk_tokens=96)
    scattered = paged_logits(mla_model, token_ids, chunk_tokens=16, block_ids=[9, 2, 7, 0, 4, 11])
    torch.testing.assert_close(scattered, whole, atol=1e-5, rtol=1e-5, msg="latent gather wrong")


def test_model_config_refuses_half_mla_shapes():
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelConfig(64, 64, 1, 2, 2, 16, 64, attention="mla")
    with pytest.raises(ValueError, match="MLA fields"):
        ModelConfig(64, 64, 1, 2, 2, 16, 64, kv_lora_rank=32)


@pytest.mark.parametrize("num_queries", [5, 40, 63, 64])
def test_queries_after_a_prefix_attend_as_with_the_lower_right_mask(num_queries, monkeypatch):
    """A long suffix's attention runs as plain causal attention of padded queries (the GPU's
    faster kernel); a short one keeps the lower-right mask: either way each query sees the
    prefix and the suffix up to itself."""
    from torch.nn.attention.bias import causal_lower_right

    from engine_adapter import model
    from engine_adapter.model import PAD_QUERIES_ABOVE, _grouped_attention

    monkeypatch.setattr(model, "PAD_MIN_KEYS", 64)  # a short context takes the padded path
    generator = torch.Generator().manual_seed(num_queries)
    num_keys, heads, kv_heads, dim = 64, 8, 2, 16
    q = torch.randn(1, heads, num_queries, dim, generator=generator)
    k = torch.randn(1, kv_heads, num_keys, dim, generator=generator)
    v = torch.randn(1, kv_heads, num_keys, dim, generator=generator)
    got = _grouped_attention(q, k, v, causal_lower_right(num_queries, num_keys))
    visible = torch.arange(num_keys)[None, :] <= torch.arange(num_queries)[:, None] + (
        num_keys - num_queries
    )
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible, enable_gqa=True
    )
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    padded = PAD_QUERIES_ABOVE * num_keys < num_queries < num_keys
    assert padded == (num_queries in (40, 63)), "the cases cover both kernels"
