"""The handoff codec: what a prefill worker hands a decode worker besides the store.

::

    prefill worker                                      decode worker
    Engine.prefill: lookup, swap in the cached
    blocks, compute the rest, write back the new ones
    sample the first token --PrefillFirst--> router
    wait for the write-back (Engine.flush)
    tail KV, token ids, sampler state
                           --Handoff------->  router --Decode(Handoff)--> fetch every full
                                                                          block ("always"), compute
                                                                          any the store lost, load
                                                                          the tail KV, then decode
                                                                          one token at a time

The full blocks travel through the store; a ``pb.Handoff`` carries the rest as bytes: the KV
of the positions after the last full block (:func:`tail_kv`, :func:`load_tail_kv`) and the
sampler's RNG state (:func:`sampler_state`, :func:`make_sampler`), so decoding goes on
exactly where the prefill stopped. A draining decode worker hands a request on the same way
(``decode_worker.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from engine_adapter.config import BYTES_PER_DTYPE
from engine_adapter.engine import Engine, Sampler
from engine_adapter.paged_kv import BlockTable, PagedKVCache
from engine_adapter.serving import serving_pb2 as pb
from kvstore.errors import InvalidArgument


def make_sampler(sampling: pb.SamplingParams, state: bytes = b"") -> Sampler:
    """The engine's sampler for ``sampling``, resumed from a handoff's RNG ``state``."""
    sampler = Sampler(sampling.temperature, sampling.top_k, sampling.seed, sampling.top_p or 1.0)
    if state:
        sampler.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return sampler


def sampler_state(sampler: Sampler) -> bytes:
    return _tensor_bytes(sampler.generator.get_state())


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def tail_kv(cache: PagedKVCache, table: BlockTable, num_tokens: int) -> bytes:
    """KV of the positions after the last full block, ``[L, 2, Hkv, tail, D]`` as bytes."""
    block_tokens, tail = cache.layout.block_tokens, num_tokens % cache.layout.block_tokens
    if tail == 0:
        return b""
    block_id = table.block_ids[num_tokens // block_tokens]
    layers = [cache.block(layer, block_id)[:, :, :tail] for layer in range(cache.layout.num_layers)]
    return _tensor_bytes(torch.stack(layers))  # [L, 2, Hkv, tail, D]


def handoff_layout(engine: Engine) -> dict[str, Any]:
    """The fields of a ``pb.Handoff`` that say what its KV means: the model, the block size,
    the compute dtype (of the tail KV) and the stored blocks' format."""
    return {
        "model_fingerprint": engine.loaded.fingerprint,
        "block_tokens": engine.config.block_tokens,
        "kv_dtype": engine.layout.dtype,
        "kv_format": engine.layout.kv_format,
    }


def check_handoff(handoff: pb.Handoff, engine: Engine) -> None:
    """Refuse (``InvalidArgument``) a handoff that ``engine`` would misread: another model,
    block size, dtype or stored format (an e4m3x16 prefill's blocks live under other keys
    than a dtype decode worker's, and the reverse), or a malformed block count."""
    mine = handoff_layout(engine)
    theirs = {name: getattr(handoff, name) for name in mine}
    theirs["kv_format"] = theirs["kv_format"] or "dtype"  # from a worker before the field
    if mine != theirs:
        raise InvalidArgument(
            f"handoff from a prefill worker running {theirs}; this decode worker runs {mine}: "
            "start both roles with the same --model, --kv-format and dtype"
        )
    if handoff.num_stored_blocks != len(handoff.token_ids) // handoff.block_tokens:
        raise InvalidArgument(
            f"handoff names {handoff.num_stored_blocks} stored blocks for "
            f"{len(handoff.token_ids)} tokens of {handoff.block_tokens}: a malformed handoff"
        )


def load_tail_kv(cache: PagedKVCache, table: BlockTable, num_tokens: int, data: bytes) -> None:
    """Inverse of :func:`tail_kv`: place the tail's KV into the table's last block."""
    lay = cache.layout
    tail = num_tokens % lay.block_tokens
    # the tail travels in the compute dtype whatever the stored blocks' format
    expected_bytes = lay.num_elements // lay.block_tokens * tail * BYTES_PER_DTYPE[lay.dtype]
    if len(data) != expected_bytes:
        raise InvalidArgument(
            f"handoff tail KV is {len(data)} bytes, expected {expected_bytes} for {tail} tokens "
            "of this model's layout; run prefill and decode workers with the same --model"
        )
    if tail == 0:
        return
    kv = torch.frombuffer(bytearray(data), dtype=getattr(torch, lay.dtype))
    kv = kv.view(lay.num_layers, 2, lay.num_kv_heads, tail, lay.head_dim)  # [L, 2, Hkv, tail, D]
    block_id = table.block_ids[num_tokens // lay.block_tokens]
    for layer in range(lay.num_layers):
        cache.block(layer, block_id)[:, :, :tail].copy_(kv[layer].to(cache.kv.device))
