"""The slice of each block's KV a TP rank holds and the key namespace that names it (the
connector's module doc has the layout), checked against what the connector supports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from engine_adapter.engine_keys import EngineKeyNamespace
from engine_adapter.kv_layout import E4M3X16_ENCODING, E4M3X16_GROUP_VALUES, e4m3x16_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class KVSlice:
    """The part of each block's KV one TP rank holds, and the key namespace that names it."""

    namespace: EngineKeyNamespace
    writer_rank: int  # the first TP rank holding this slice writes it


def tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's TP rank: from vLLM's TP group once it exists, else from the worker's
    global rank (``parallel_config.rank``, which vLLM's WorkerBase sets; TP varies fastest)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size == 1:
        return 0
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_rank()
    return parallel.rank % parallel.tensor_parallel_size


def check_spec(kv_cache_config: KVCacheConfig) -> FullAttentionSpec:
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if len(groups) == 1 else None
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ValueError(
            "KVStoreConnector supports models whose layers are all full attention (or all "
            f"MLA) with one KV cache group; got {[type(g.kv_cache_spec).__name__ for g in groups]}"
            " (sliding-window and hybrid models are not supported yet)"
        )
    if spec.tokens_per_state != 1 or getattr(spec, "model_version", None):
        raise ValueError(
            "KVStoreConnector supports one KV state per token; this model's MLA cache holds "
            f"{spec.tokens_per_state} tokens per state (DeepSeek-V4-style sparse MLA)"
        )
    return spec


def kv_slices(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    model: str,
    stored_dtype: Callable[[str], str] = lambda dtype: dtype,
) -> tuple[list[str], int, list[KVSlice]]:
    """The layers in store-block order, the bytes of one layer's page of a block as stored,
    and each TP rank's slice (several ranks may share one: see the module doc).
    ``stored_dtype`` maps the cache's dtype to the stored format's name
    (:meth:`AdapterConfig.stored_kv_format`): e4m3x16 pages are 1.125 bytes a value."""
    spec = check_spec(kv_cache_config)
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("KVStoreConnector does not support pipeline parallelism yet")
    if vllm_config.model_config.revision:
        model += f"@{vllm_config.model_config.revision}"
    layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
    channels = spec.state_content_size_bytes // torch.empty((), dtype=spec.dtype).element_size()
    layer_page_bytes = spec.num_heads * spec.block_size * spec.state_content_size_bytes
    dtype = stored_dtype(str(spec.dtype).removeprefix("torch."))
    if dtype == E4M3X16_ENCODING:
        if channels % E4M3X16_GROUP_VALUES:
            raise ValueError(
                f"kv_format 'e4m3x16' needs pages of whole groups of {E4M3X16_GROUP_VALUES} "
                f"values; this model's pages are {channels} wide"
            )
        layer_page_bytes = e4m3x16_bytes(layer_page_bytes // spec.dtype.itemsize)
    shape = f"{len(layer_names)}x{spec.num_heads}x{spec.block_size}x{channels}"
    extra = (
        ("cache_dtype", str(vllm_config.cache_config.cache_dtype)),
        ("kv_quant", str(spec.kv_quant_mode.name)),
    )
    tp_size = parallel.tensor_parallel_size
    mla = isinstance(spec, MLAAttentionSpec)
    total_heads = 1 if mla else vllm_config.model_config.get_total_num_kv_heads()
    slices: list[KVSlice] = []
    for rank in range(tp_size):
        first, end = _head_range(rank, tp_size, total_heads)
        shard, num_shards = (first, total_heads) if tp_size > total_heads else (rank, tp_size)
        writer = next(r for r in range(tp_size) if _head_range(r, tp_size, total_heads)[0] == first)
        namespace = EngineKeyNamespace(
            engine="vllm",
            model=model,
            dtype=dtype,
            layout=f"vllm-{'MLA' if mla else 'BHNC'}-v1:{shape}",
            page_tokens=spec.block_size,
            tp_rank=shard,
            tp_size=num_shards,
            extra=(("heads", "latent" if mla else f"{first}:{end}/{total_heads}"), *extra),
        )
        slices.append(KVSlice(namespace, writer))
    return layer_names, layer_page_bytes, slices


def _head_range(rank: int, tp_size: int, total_heads: int) -> tuple[int, int]:
    """KV heads [first, end) a TP rank holds: an equal share, or one replicated head when
    there are more ranks than heads (vLLM's split). MLA's latent: one "head", replicated."""
    if tp_size <= total_heads:
        per_rank = total_heads // tp_size
        return rank * per_rank, (rank + 1) * per_rank
    head = rank * total_heads // tp_size
    return head, head + 1
