"""The handoff between a prefill and a decode worker says what its KV means, and the decode
worker refuses one it would misread: another stored format (e4m3x16 or the compute dtype),
dtype, model or block size. The tail KV travels in the compute dtype whatever the format."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from engine_adapter.config import EngineConfig  # noqa: E402
from engine_adapter.engine import Engine  # noqa: E402
from engine_adapter.paged_kv import BlockTable  # noqa: E402
from engine_adapter.serving import serving_pb2 as pb  # noqa: E402
from engine_adapter.serving.handoff import (  # noqa: E402
    check_handoff,
    handoff_layout,
    load_tail_kv,
    tail_kv,
)
from kvstore.errors import InvalidArgument  # noqa: E402

CONFIG = EngineConfig(block_tokens=16, max_num_seqs=1, max_model_len=64)
TOKENS = list(range(40))  # 2 stored blocks and a tail of 8


def handoff_from(engine: Engine) -> pb.Handoff:
    """What a prefill worker running ``engine`` sends (prefill_worker._handoff_message)."""
    return pb.Handoff(token_ids=TOKENS, num_stored_blocks=2, **handoff_layout(engine))


@pytest.mark.parametrize(("prefill", "decode"), [("e4m3x16", "dtype"), ("dtype", "e4m3x16")])
def test_a_handoff_in_another_kv_format_is_refused(small_model, prefill, decode):
    sender = Engine(small_model, dataclasses.replace(CONFIG, kv_format=prefill))
    receiver = Engine(small_model, dataclasses.replace(CONFIG, kv_format=decode))
    with pytest.raises(InvalidArgument, match="--kv-format"):
        check_handoff(handoff_from(sender), receiver)


def test_a_handoff_of_the_same_layout_passes_and_a_formatless_one_means_dtype(small_model):
    for kv_format in ("dtype", "e4m3x16"):
        engine = Engine(small_model, dataclasses.replace(CONFIG, kv_format=kv_format))
        check_handoff(handoff_from(engine), engine)
    engine = Engine(small_model, CONFIG)
    old = handoff_from(engine)
    old.ClearField("kv_format")  # a prefill worker from before the field stored dtype blocks
    check_handoff(old, engine)
    quantised = Engine(small_model, dataclasses.replace(CONFIG, kv_format="e4m3x16"))
    with pytest.raises(InvalidArgument, match="e4m3x16"):
        check_handoff(old, quantised)


def test_a_handoff_in_another_dtype_is_refused(small_model):
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16", kv_format="e4m3x16")
    with pytest.raises(InvalidArgument, match="dtype"):
        check_handoff(handoff_from(Engine(small_model, bf16)), Engine(small_model, CONFIG))


@pytest.mark.parametrize("kv_format", ["dtype", "e4m3x16"])
def test_the_tail_kv_comes_back_in_the_compute_dtype(small_model, kv_format):
    engine = Engine(small_model, dataclasses.replace(CONFIG, kv_format=kv_format))
    table = BlockTable(16, engine.cache.pool.allocate(3))
    generator = torch.Generator().manual_seed(0)
    engine.cache.kv.copy_(torch.randn(engine.cache.kv.shape, generator=generator))
    data = tail_kv(engine.cache, table, len(TOKENS))
    want = engine.cache.kv[:, :, :, 32:40].clone()  # block 2's first 8 tokens, every layer
    engine.cache.kv.zero_()
    load_tail_kv(engine.cache, table, len(TOKENS), data)
    assert torch.equal(engine.cache.kv[:, :, :, 32:40], want), "the tail KV did not come back"
