"""The engine's Python API: load a model, open a store, prefill with the cache, generate.

::

    engine = Engine.load("default", EngineConfig())          # SmolLM2-135M-Instruct, CPU fp32
    engine.open_store("DIR/cluster.toml")                     # optional: cache-backed prefill
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    out = await engine.generate(ids, max_new_tokens=32, tenant="acme", traffic_class="chat")
    out.text, out.prefill.num_cached_tokens, out.prefill.ttft_s
    await engine.close()

Prefill with a store: the prompt's full blocks are fetched and swapped in (``connector``;
the fetch is the lookup), and only the rest is computed, in chunks of ``prefill_chunk_tokens``
aligned to absolute positions. When the cost model predicts the fetch slower than computing
part of the prefix, the first blocks are computed from the front while the others are
fetched, and the two meet (``FetchPlan.first_block``): a cached prefill is never planned
slower than either alone. At least one token is always computed to produce logits: when the
whole prompt is cached in full blocks, the last block is recomputed (``num_usable_blocks``).
The new full blocks are then written back in the background. Time to first token (TTFT) runs
from the call to the first token's id.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from engine_adapter.config import EngineConfig
from engine_adapter.connector import FetchOutcome, StoreConnector
from engine_adapter.kv_layout import KVBlockLayout
from engine_adapter.loader import LoadedModel, load_model
from engine_adapter.paged_kv import BlockTable, PagedKVCache
from engine_adapter.swap_in import SwapIn
from engine_adapter.tokenizer import ChatTokenizer, Message
from kvstore.config import ClusterConfig
from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_TENANT = "default"


def block_key_salt(tenant: str, cache_salt: str = "") -> str:
    """The salt of a request's block keys: its tenant, narrowed by its ``cache_salt``.

    Requests share cached KV only when both are equal; the store still checks the tenant.
    """
    return f"{tenant}\0{cache_salt}" if cache_salt else tenant


def freeze_startup_heap() -> None:
    """Take every object alive now (torch's modules, the model, the engine and its store
    client: ~200k objects) out of the cyclic collector's full passes. Each full pass walks
    them all, 60-110 ms on the 2-core machine, a pause in the middle of a fetch or a prefill
    that also costs a swap-in 0.05 CPU-s per GB. Call once, when the process is up (serving
    workers and the benches do); objects made later are collected as usual."""
    gc.collect()
    gc.freeze()


@dataclass
class Sequence:
    """One prompt (and what is generated after it) holding KV blocks in the engine's pool."""

    token_ids: list[int]
    table: BlockTable
    tenant: str
    traffic_class: str


@dataclass(frozen=True)
class PrefillResult:
    sequence: Sequence
    logits: torch.Tensor  # [vocab] fp32, for the token after the prompt
    first_token_id: int  # greedy choice from ``logits``
    num_prompt_tokens: int
    num_cached_tokens: int  # swapped in from the store
    num_computed_tokens: int
    num_matched_tokens: int  # the fetch found these (after the tokens computed meanwhile)
    ttft_s: float  # call to first token id, everything included
    lookup_s: float  # 0: the fetch is the lookup
    fetch_s: float
    compute_s: float  # compute after the fetch (waiting for swapped-in layers included)
    fallback: str | None  # why usable tokens were computed anyway (see FetchOutcome)
    # Tokens computed from the front while the fetch ran, and that compute's seconds.
    num_front_tokens: int = 0
    front_compute_s: float = 0.0
    # Placing the fetched blocks into the paged KV cache (dequantise included): on CPU part of
    # compute_s; on CUDA the copy stream's span, beside compute (engine_adapter/swap_in.py).
    place_s: float = 0.0


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # generated tokens, the first one included
    text: str | None  # decoded (special tokens skipped) when the model has a tokenizer
    finish_reason: str  # "stop" (a stop token) or "length"
    prefill: PrefillResult
    decode_s: float


class Engine:
    """A Llama-style model with a paged KV cache and an optional store connector."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded, self.config = loaded, config
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        cfg = self.model.config
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.layout = KVBlockLayout.for_model(
            cfg, config.block_tokens, config.dtype, config.kv_format
        )
        self.namespace = self.layout.namespace(loaded.fingerprint)
        self.max_blocks_per_seq = -(-self.max_model_len // config.block_tokens)
        num_blocks = config.max_num_seqs * self.max_blocks_per_seq
        self.cache = PagedKVCache(self.layout, num_blocks, torch.device(config.device))
        self.connector: StoreConnector | None = None
        # The model runs on one thread of its own: torch's CPU thread team stays with it. A
        # forward hopping between the default pool's threads ran 10-20% slower on 2 cores.
        self._compute_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-compute")

    @classmethod
    def load(cls, model: str = "default", config: EngineConfig | None = None) -> Engine:
        """Load ``model`` ('default', 'random:<size>', a .gguf file or a safetensors dir)."""
        config = config or EngineConfig()
        return cls(load_model(model, config.device, config.dtype, config.seed), config)

    def open_store(self, cluster: str | Path | ClusterConfig, token: str | None = None) -> None:
        """Use the cluster of ``cluster.toml`` for cache-backed prefill (clients open lazily)."""
        self.connector = StoreConnector(
            cluster, self.cache, self.namespace, self.config, self.max_blocks_per_seq, token
        )

    def num_usable_blocks(self, num_prompt_tokens: int) -> int:
        """Full blocks that may come from the store: all but what holds the last token."""
        return (num_prompt_tokens - 1) // self.config.block_tokens

    async def prefill(
        self,
        prompt_ids: list[int],
        *,
        tenant: str = DEFAULT_TENANT,
        traffic_class: str | None = None,
        use_cache: bool = True,
        write_back: bool | None = None,
        reserve_tokens: int = 0,
        cache_salt: str = "",
    ) -> PrefillResult:
        """Prefill ``prompt_ids``; the caller owns the sequence (``release`` it when done).

        ``use_cache=False`` leaves the store out entirely; ``write_back`` (default: the
        config's) says whether the new full blocks are stored afterwards; ``reserve_tokens``
        allocates KV blocks for that many more tokens now (decode, ``extend``), so that the
        sequence's blocks stay consecutive and attention reads them without a gather.
        ``cache_salt`` narrows the tenant's block keys (:func:`block_key_salt`).
        """
        started = time.perf_counter()
        traffic_class = traffic_class or self.config.traffic_class
        seq = self._new_sequence(prompt_ids, tenant, traffic_class, reserve_tokens)
        store = self.connector if use_cache else None
        keys = store.keys(prompt_ids, block_key_salt(tenant, cache_salt)) if store else []
        try:
            outcome, logits, first, compute_s, front_s = await self._swap_in_and_compute(
                seq, keys, store
            )
        except BaseException:
            self.release(seq)
            raise
        ttft_s = time.perf_counter() - started
        result = self._result(seq, logits, first, outcome, ttft_s, compute_s, front_s)
        if self.connector:  # every prefill teaches the cost model the compute rate
            # (from the compute after the fetch: the front's ran beside it, slowed by it)
            self.connector.cost_model.observe_compute(
                result.num_computed_tokens - result.num_front_tokens, compute_s
            )
        if store and (self.config.write_back if write_back is None else write_back):
            first_new = outcome.first_uncached_block if outcome else 0
            await store.write_back(keys, seq.table, first_new, tenant, seq.traffic_class)
        return result

    async def _swap_in_and_compute(
        self, seq: Sequence, keys: list[bytes], store: StoreConnector | None
    ) -> tuple[FetchOutcome | None, torch.Tensor, int, float, float]:
        """Fetch what the store has and the plan takes, compute the front meanwhile (when
        the plan says so), then compute the rest.

        Returns (fetch outcome, last logits, greedy next id, compute seconds after the
        fetch, compute seconds during it).
        """
        if store is None:
            started = time.perf_counter()
            logits, first = await self._on_compute_thread(self._compute, seq, 0, None)
            return None, logits, first, time.perf_counter() - started, 0.0
        plan = store.plan(self.num_usable_blocks(len(seq.token_ids)))
        front_end = plan.first_block * self.config.block_tokens
        fetch = asyncio.ensure_future(store.fetch(keys, seq.table, plan, seq.tenant))
        front_s = 0.0
        try:
            if front_end:  # compute the front while the rest is fetched (Cake)
                started = time.perf_counter()
                await self._on_compute_thread(self._forward, seq, 0, front_end, None)
                front_s = time.perf_counter() - started
            outcome = await fetch
        except BaseException:
            fetch.cancel()
            with contextlib.suppress(BaseException):
                store.release(await fetch)
            raise
        try:
            start = front_end + outcome.num_fetched_blocks * self.config.block_tokens
            started = time.perf_counter()
            logits, first = await self._on_compute_thread(
                self._compute, seq, start, outcome.swap_in
            )
            return outcome, logits, first, time.perf_counter() - started, front_s
        finally:
            store.release(outcome)

    async def generate(
        self,
        prompt: str | list[int] | list[Message],
        *,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        tenant: str = DEFAULT_TENANT,
        traffic_class: str | None = None,
        use_cache: bool = True,
    ) -> Generation:
        """Prefill then decode greedily (``temperature`` 0) or by seeded sampling."""
        prompt_ids = self.encode_prompt(prompt)
        if max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self._check_length(len(prompt_ids) + max_new_tokens - 1)
        prefill = await self.prefill(
            prompt_ids,
            tenant=tenant,
            traffic_class=traffic_class,
            use_cache=use_cache,
            reserve_tokens=max_new_tokens - 1,
        )
        sampler = Sampler(temperature, top_k, self.config.seed if seed is None else seed, top_p)
        started = time.perf_counter()
        try:
            token_ids, reason = await self._on_compute_thread(
                self._decode, prefill.sequence, prefill.logits, max_new_tokens, sampler
            )
        finally:
            self.release(prefill.sequence)
        text = self.tokenizer.decode(token_ids) if self.tokenizer else None
        return Generation(token_ids, text, reason, prefill, time.perf_counter() - started)

    async def extend(self, seq: Sequence, token_ids: list[int]) -> tuple[torch.Tensor, int]:
        """Append ``token_ids`` to ``seq`` and compute them; (logits, greedy next id).

        No store involved: e.g. the next turn of a conversation held in this engine.
        """
        if not token_ids:
            raise InvalidArgument("extend() needs at least one token")
        start = len(seq.token_ids)
        self._check_length(start + len(token_ids))
        seq.token_ids.extend(token_ids)
        num_missing = seq.table.num_blocks_for(len(seq.token_ids)) - len(seq.table.block_ids)
        seq.table.block_ids += self.cache.pool.allocate(max(num_missing, 0))
        return await self._on_compute_thread(self._compute, seq, start, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget ``seq``'s tokens from position ``num_tokens`` on.

        Their KV is overwritten by whatever comes next; the blocks stay with the sequence
        (like a list's capacity) until ``release``.
        """
        if not 0 < num_tokens <= len(seq.token_ids):
            raise InvalidArgument(f"can keep 1 to {len(seq.token_ids)} tokens, not {num_tokens}")
        del seq.token_ids[num_tokens:]

    def require_tokenizer(self) -> ChatTokenizer:
        """The model's tokenizer; InvalidArgument for a model without one (random init)."""
        if self.tokenizer is None:
            raise InvalidArgument(f"model {self.loaded.spec!r} has no tokenizer: pass ids")
        return self.tokenizer

    def encode_prompt(self, prompt: str | list[int] | list[Message]) -> list[int]:
        """Token ids of a prompt: ids as given, untrusted text, or chat messages (template)."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            tokenizer = self.require_tokenizer()
            if isinstance(prompt, str):
                return tokenizer.encode(prompt)
            return tokenizer.apply_chat_template(prompt)
        ids = [int(t) for t in prompt]
        if not ids or min(ids) < 0 or max(ids) >= self.model.config.vocab_size:
            raise InvalidArgument(
                f"prompt ids must be non-empty and in [0, {self.model.config.vocab_size})"
            )
        return ids

    def release(self, seq: Sequence) -> None:
        """Return a sequence's KV blocks to the pool."""
        self.cache.pool.free(seq.table.block_ids)
        seq.table.block_ids = []

    async def flush(self) -> None:
        """Wait for background write-backs (tests and benchmarks call this)."""
        if self.connector:
            await self.connector.drain()

    async def close(self) -> None:
        if self.connector:
            await self.connector.close()
        # The compute thread stays: an engine without a store still prefills after close (it
        # idles until then, and ends with the engine)

    async def _on_compute_thread(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` on the engine's compute thread (which runs every forward)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute_thread, fn, *args)

    def _new_sequence(
        self, prompt_ids: list[int], tenant: str, traffic_class: str, reserve_tokens: int
    ) -> Sequence:
        if not prompt_ids:
            raise InvalidArgument("the prompt is empty; pass at least one token")
        num_tokens = len(prompt_ids) + max(reserve_tokens, 0)
        self._check_length(num_tokens)
        table = BlockTable(self.config.block_tokens)
        table.block_ids = self.cache.pool.allocate(table.num_blocks_for(num_tokens))
        return Sequence(list(prompt_ids), table, tenant, traffic_class)

    def _check_length(self, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise InvalidArgument(
                f"{num_tokens} tokens exceed the engine's max_model_len={self.max_model_len}; "
                "shorten the prompt or max_new_tokens"
            )

    def _compute(
        self, seq: Sequence, start: int, swap_in: SwapIn | None
    ) -> tuple[torch.Tensor, int]:
        """Forward the prompt from ``start``; (last token's logits, greedy next id)."""
        hidden = self._forward(seq, start, len(seq.token_ids), swap_in)
        logits = self.model.logits(hidden[-1])  # [vocab]
        return logits, int(logits.argmax())

    def _forward(self, seq: Sequence, start: int, end: int, swap_in: SwapIn | None) -> torch.Tensor:
        """Forward tokens [start, end) in one pass over the layers (chunked within each
        layer where the config keeps chunks exact); their hidden states."""
        ids = torch.tensor(seq.token_ids[start:end], dtype=torch.long, device=self.cache.kv.device)
        hook = swap_in.before_layer if swap_in else None
        chunk_tokens = self.config.compute_chunk_tokens
        return self.model(ids, start, self.cache, seq.table, hook, chunk_tokens)

    def _decode(
        self, seq: Sequence, logits: torch.Tensor, max_new_tokens: int, sampler: Sampler
    ) -> tuple[list[int], str]:
        """Sample, append and forward one token at a time (runs in a worker thread)."""
        stop_ids = {t for t in (self.model.config.eos_token_id,) if t is not None}
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        out: list[int] = []
        while True:
            token_id = sampler.sample(logits)
            out.append(token_id)
            if token_id in stop_ids:
                return out, "stop"
            if len(out) >= max_new_tokens:
                return out, "length"
            logits = self._step(seq, token_id)

    def _step(self, seq: Sequence, token_id: int) -> torch.Tensor:
        position = len(seq.token_ids)
        seq.token_ids.append(token_id)
        if position // self.config.block_tokens >= len(seq.table.block_ids):
            seq.table.block_ids += self.cache.pool.allocate(1)
        ids = torch.tensor([token_id], dtype=torch.long, device=self.cache.kv.device)
        return self.model.logits(self.model(ids, position, self.cache, seq.table)[-1])

    def _result(
        self,
        seq: Sequence,
        logits: torch.Tensor,
        first_token_id: int,
        outcome: FetchOutcome | None,
        ttft_s: float,
        compute_s: float,
        front_s: float,
    ) -> PrefillResult:
        block_tokens = self.config.block_tokens
        num_cached = outcome.num_fetched_blocks * block_tokens if outcome else 0
        return PrefillResult(
            sequence=seq,
            logits=logits,
            first_token_id=first_token_id,
            num_prompt_tokens=len(seq.token_ids),
            num_cached_tokens=num_cached,
            num_computed_tokens=len(seq.token_ids) - num_cached,
            num_matched_tokens=outcome.num_matched_blocks * block_tokens if outcome else 0,
            ttft_s=ttft_s,
            lookup_s=outcome.lookup_s if outcome else 0.0,
            fetch_s=outcome.fetch_s if outcome else 0.0,
            compute_s=compute_s,
            fallback=outcome.fallback if outcome else None,
            num_front_tokens=outcome.first_block * block_tokens if outcome else 0,
            front_compute_s=front_s,
            place_s=outcome.swap_in.place_s() if outcome else 0.0,
        )


class Sampler:
    """Greedy when ``temperature`` is 0, else seeded sampling, optionally among the ``top_k``
    most likely tokens and within the smallest set of probability mass ``top_p``."""

    def __init__(self, temperature: float, top_k: int, seed: int, top_p: float = 1.0) -> None:
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise InvalidArgument(
                "need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got "
                f"{temperature}, {top_k}, {top_p}"
            )
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = torch.Generator().manual_seed(seed)  # CPU: same draws on any device

    def sample(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(logits.argmax())
        scaled = logits.float().cpu() / self.temperature  # [vocab]
        if self.top_k:
            threshold = torch.topk(scaled, min(self.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)  # [vocab]
        if self.top_p < 1:
            probs = _nucleus(probs, self.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` [vocab] with every token outside the smallest top-``top_p`` set zeroed."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [vocab]
    sorted_probs[mass_before >= top_p] = 0.0  # the most likely token always stays
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)
