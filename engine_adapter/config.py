"""Engine configuration: the model's shape (``ModelConfig``) and how the engine runs it
(``EngineConfig``). Frozen dataclasses, validated in ``__post_init__``; no torch here.

``random:<preset>`` model specs name the seeded random-init shapes in ``RANDOM_PRESETS``:
``tiny`` and ``small`` for tests, ``135m`` (SmolLM2's shape) and ``1b`` (Llama-3.2-1B's
shape, 16k context) for benchmarks, ``1b-long``: the same shape with Llama-3.2-1B's whole
128k context, for long prompts (32k and 64k tokens on one H200), and ``mla-small``:
DeepSeek-V2/V3's multi-head latent attention with its real per-layer latent (512 compressed
KV + 64 decoupled RoPE key dims per token) in a small, dense model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import asdict, dataclass

from kvstore.config import READ_TRANSPORTS

BYTES_PER_DTYPE = {"float32": 4, "bfloat16": 2, "float16": 2}
ATTENTIONS = ("gqa", "mla")  # Llama-style grouped-query attention; DeepSeek's latent attention
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")
STORE_TRANSPORTS = READ_TRANSPORTS  # KVClient.connect's transports
KV_FORMATS = ("dtype", "e4m3x16")  # how stored KV blocks encode values (kv_format.py)


def add_kv_format_argument(parser: argparse.ArgumentParser) -> None:
    """``--kv-format``: how the engine's KV blocks are stored (EngineConfig.kv_format)."""
    parser.add_argument(
        "--kv-format",
        choices=KV_FORMATS,
        default="dtype",
        help="stored KV blocks: dtype = raw values of the compute dtype (default), e4m3x16 = "
        "FP8 e4m3 with one bf16 scale per 16 values (0.5625x bf16's bytes; docs/engine.md)",
    )


def add_store_transport_argument(parser: argparse.ArgumentParser) -> None:
    """``--store-transport``: how the engine's fetched KV blocks travel from the store."""
    parser.add_argument(
        "--store-transport",
        choices=STORE_TRANSPORTS,
        default="auto",
        help="how fetched KV blocks travel from the store: auto = the local channel to "
        "nodes on this host, UCX where it reaches, the stream channel (TCP) to the rest, "
        "gRPC as the last (docs/data-paths.md)",
    )


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder: RMSNorm, RoPE, SwiGLU, and either Llama-style grouped-query
    attention (``attention="gqa"``) or DeepSeek-V2/V3 multi-head latent attention ("mla").

    MLA caches one latent vector per token and layer instead of per-head K and V: the
    compressed KV (``kv_lora_rank``, after its RMSNorm) and the decoupled RoPE key shared by
    all heads (``qk_rope_head_dim``, after RoPE). Each head's key is ``[nope | rope]``
    (``qk_nope_head_dim`` + ``qk_rope_head_dim``) and its value ``v_head_dim``, both expanded
    from the latent by ``kv_b_proj``. For MLA ``head_dim`` is the RoPE dim (as Hugging Face's
    DeepseekV3Config has it), ``num_kv_heads`` equals ``num_heads``, and ``q_lora_rank`` 0
    means a plain ``q_proj`` (DeepSeek-V2-Lite) instead of the low-rank ``q_a``/``q_b`` pair.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    attention: str = "gqa"
    kv_lora_rank: int = 0  # MLA only, as the fields below
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        sizes = (self.vocab_size, self.hidden_size, self.num_layers, self.num_heads)
        if min(*sizes, self.num_kv_heads, self.head_dim, self.intermediate_size) <= 0:
            raise ValueError(f"every model dimension must be > 0, got {self}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (grouped-query attention shares each KV head)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r}: choose one of {ATTENTIONS}")
        if self.attention == "mla":
            self._check_mla()
        elif any(getattr(self, name) for name in _MLA_FIELDS):
            raise ValueError(f"{_MLA_FIELDS} are MLA fields: set attention='mla' or leave them 0")

    def _check_mla(self) -> None:
        if min(self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim) <= 0:
            raise ValueError(
                "an MLA model needs kv_lora_rank, qk_nope_head_dim and v_head_dim > 0 "
                f"(DeepSeek-V3: 512, 128, 128), got {self}"
            )
        if self.q_lora_rank < 0 or self.num_kv_heads != self.num_heads:
            raise ValueError("MLA needs q_lora_rank >= 0 and num_kv_heads == num_heads")

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: ``[nope | rope]`` for MLA, ``head_dim`` otherwise."""
        return self.qk_nope_head_dim + self.head_dim if self.is_mla else self.head_dim

    @property
    def latent_dim(self) -> int:
        """MLA's cached values per token and layer: compressed KV, then the RoPE key."""
        return self.kv_lora_rank + self.head_dim

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of the KV cache, all layers, for one token stored in ``dtype``, or in
        ``e4m3x16`` (a byte per value and a bf16 scale per 16 values: kv_format.py)."""
        per_layer = self.latent_dim if self.is_mla else 2 * self.num_kv_heads * self.head_dim
        if dtype == "e4m3x16":
            return self.num_layers * (per_layer + per_layer // 16 * 2)
        return self.num_layers * per_layer * BYTES_PER_DTYPE[dtype]

    def num_params(self) -> int:
        """Parameter count (the tied embedding counted once)."""
        h = self.hidden_size
        attn = self._mla_params() if self.is_mla else self._gqa_params()
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    def _gqa_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        return h * self.num_heads * self.head_dim * 2 + h * kv * 2

    def _mla_params(self) -> int:
        h, heads, q_out = self.hidden_size, self.num_heads, self.num_heads * self.qk_head_dim
        r = self.q_lora_rank
        q = h * r + r + r * q_out if r else h * q_out
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + h * self.latent_dim + self.kv_lora_rank + kv_b + heads * self.v_head_dim * h

    def fingerprint(self) -> str:
        """Short stable digest of the shape (weights are fingerprinted separately). A GQA
        config leaves the MLA fields out, so its digest is what it was before they existed."""
        shape = asdict(self)
        if not self.is_mla:
            for name in ("attention", *_MLA_FIELDS):
                del shape[name]
        blob = json.dumps(shape, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


RANDOM_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=2048,
    ),
    "small": ModelConfig(
        vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=32, intermediate_size=256, max_position_embeddings=4096,
    ),
    "135m": ModelConfig(
        vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, rope_theta=100_000.0,
    ),
    "1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, intermediate_size=8192, rope_theta=500_000.0, max_position_embeddings=16384,
    ),
    "1b-long": ModelConfig(
        vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, intermediate_size=8192, rope_theta=500_000.0,
        max_position_embeddings=131072,
    ),
    # DeepSeek-V3's attention shapes per layer (latent 512 + RoPE key 64, per head nope 128,
    # value 128, low-rank queries) with few heads and layers and a dense MLP.
    "mla-small": ModelConfig(
        vocab_size=1024, hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=64, intermediate_size=512, max_position_embeddings=4096, attention="mla",
        kv_lora_rank=512, q_lora_rank=192, qk_nope_head_dim=128, v_head_dim=128,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model and talks to the store.

    ``prefill_chunk_tokens`` is a multiple of ``block_tokens`` and chunks start at absolute
    multiples of it, so every chunk runs the same kernels on the same shapes whether the
    tokens before it were fetched or computed: swapped-in KV is then bitwise equal to
    recomputed KV on the fp32 CPU path. (The connector fetches whole chunks for the same
    reason.) One block per chunk is the default; larger chunks suit GPUs.

    ``exact_chunks`` says whether a prefill runs each chunk's kernels on that chunk alone
    (True, the default on CPU: the bitwise equality above) or each layer's kernels on all
    the tokens being computed at once (False, the default on other devices: fewer, larger
    kernels, whose rounding then depends on how much of the prompt was cached; chunks still
    set what is fetched). Either way the forward runs layer by layer (``LlamaModel.forward``).
    """

    block_tokens: int = 64
    prefill_chunk_tokens: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    # How stored KV blocks encode the values: "dtype" (raw values of ``dtype``) or "e4m3x16"
    # (FP8 with one bf16 scale per 16 values, 0.5625 of bf16's bytes: kv_format.py)
    kv_format: str = "dtype"
    max_num_seqs: int = 2  # sequences that can hold KV at once (sizes the block pool)
    max_model_len: int = 0  # longest sequence in tokens; 0 = the model's context length
    traffic_class: str = "chat"  # default class of writes; a request may name its own
    # "always": fetch every cached block (the measured best on an H200: runs 4-6 in
    # docs/runs/swapin-h200); "cost": the cost model may compute a front meanwhile, or all
    fetch_policy: str = "always"
    fetch_deadline_s: float = 2.0  # upper bound on any fetch; the cost model may cut it
    fetch_min_deadline_s: float = 0.1  # a fetch always gets at least this long
    fetch_concurrency: int = 512  # blocks in flight per fetch (in land_batch chunks)
    fetch_chunk_blocks: int = 64  # blocks per land_batch call: the H2D copy of a block
    # starts as soon as it landed, while later chunks are still on their way
    # How fetched blocks travel (KVClient.connect's transport): "auto" (the local channel to
    # nodes on this host, where they write into the engine's landing pool themselves; UCX to
    # the nodes shared memory or RDMA reach; gRPC for the rest), "local", "ucx" or "grpc"
    # (docs/data-paths.md).
    store_transport: str = "auto"
    write_back: bool = True  # store newly computed full blocks after prefill
    write_concurrency: int = 4  # puts in flight during write-back
    seed: int = 0  # random init and sampling default
    exact_chunks: bool | None = None  # None: True on CPU, False elsewhere (see above)

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.prefill_chunk_tokens % self.block_tokens:
            raise ValueError(
                f"prefill_chunk_tokens={self.prefill_chunk_tokens} must be a positive multiple "
                f"of block_tokens={self.block_tokens} (e.g. {4 * max(self.block_tokens, 1)})"
            )
        if self.prefill_chunk_tokens <= 0:
            raise ValueError("prefill_chunk_tokens must be > 0")
        if self.dtype not in BYTES_PER_DTYPE:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {sorted(BYTES_PER_DTYPE)}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format {self.kv_format!r}: choose one of {KV_FORMATS}")
        if self.max_num_seqs <= 0 or self.max_model_len < 0:
            raise ValueError("max_num_seqs must be > 0 and max_model_len >= 0")
        if self.fetch_policy not in ("cost", "always"):
            raise ValueError(f"fetch_policy {self.fetch_policy!r}: choose 'cost' or 'always'")
        if not 0 < self.fetch_min_deadline_s <= self.fetch_deadline_s:
            raise ValueError("need 0 < fetch_min_deadline_s <= fetch_deadline_s")
        if self.store_transport not in STORE_TRANSPORTS:
            raise ValueError(
                f"store_transport {self.store_transport!r}: choose one of {STORE_TRANSPORTS}"
            )
        if self.fetch_concurrency <= 0 or self.write_concurrency <= 0:
            raise ValueError("fetch_concurrency and write_concurrency must be > 0")
        if self.fetch_chunk_blocks <= 0:
            raise ValueError(f"fetch_chunk_blocks must be > 0, got {self.fetch_chunk_blocks}")

    @property
    def compute_chunk_tokens(self) -> int:
        """Tokens per kernel call in a prefill: a chunk when chunks are exact, else 0 (all)."""
        exact = self.device == "cpu" if self.exact_chunks is None else self.exact_chunks
        return self.prefill_chunk_tokens if exact else 0

    @property
    def blocks_per_chunk(self) -> int:
        return self.prefill_chunk_tokens // self.block_tokens
