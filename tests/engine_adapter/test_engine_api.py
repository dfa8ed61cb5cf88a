"""The Engine API without a store: prefill, extend/truncate, sampling, misuse."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engine_adapter.config import EngineConfig  # noqa: E402
from engine_adapter.engine import Engine  # noqa: E402
from engine_adapter.loader import load_model  # noqa: E402
from kvstore.errors import CapacityExhausted, InvalidArgument  # noqa: E402

pytestmark = pytest.mark.engine
PROMPT = [(i * 29 + 3) % 1000 for i in range(100)]


@pytest.fixture(scope="module")
def engine():
    loaded = load_model("random:small", "cpu", "float32", seed=0)
    return Engine(loaded, EngineConfig(block_tokens=16, prefill_chunk_tokens=32, max_model_len=256))


async def test_extend_continues_a_prefill_and_truncate_rewinds_it(engine):
    whole = await engine.prefill(PROMPT)
    engine.release(whole.sequence)
    head = await engine.prefill(PROMPT[:64], reserve_tokens=36)
    assert len(head.sequence.table.block_ids) == 7, "reserve_tokens must allocate ahead"
    logits, first = await engine.extend(head.sequence, PROMPT[64:])
    assert first == whole.first_token_id
    torch.testing.assert_close(logits, whole.logits, msg="extend() must continue the same KV")
    engine.truncate(head.sequence, 64)
    assert len(head.sequence.token_ids) == 64
    again, _ = await engine.extend(head.sequence, PROMPT[64:])
    assert torch.equal(again, logits), "extending after truncate must redo the same work"
    engine.release(head.sequence)
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks, "a block leaked"


async def test_an_engine_still_computes_after_close():
    # close() ends the store's clients, not the engine: a prefill without the store still runs
    loaded = load_model("random:tiny", "cpu", "float32", seed=0)
    config = EngineConfig(block_tokens=16, prefill_chunk_tokens=32, max_model_len=64)
    engine = Engine(loaded, config)
    prompt = [t % loaded.model.config.vocab_size for t in PROMPT[:40]]
    before = await engine.prefill(prompt, use_cache=False)
    engine.release(before.sequence)
    await engine.close()
    after = await engine.prefill(prompt, use_cache=False)
    engine.release(after.sequence)
    assert torch.equal(after.logits, before.logits)


async def test_seeded_sampling_is_reproducible_and_greedy_is_argmax(engine):
    first = await engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3)
    again = await engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3)
    other = await engine.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=4)
    greedy = await engine.generate(PROMPT, max_new_tokens=1)
    assert first.token_ids == again.token_ids != other.token_ids, "sampling is not seeded"
    assert greedy.token_ids == [greedy.prefill.first_token_id]
    assert first.finish_reason == "length" and len(first.token_ids) == 8


async def test_misuse_gets_clear_errors(engine):
    with pytest.raises(InvalidArgument, match="max_model_len"):
        await engine.generate(PROMPT * 3, max_new_tokens=1)
    with pytest.raises(InvalidArgument, match="prompt ids"):
        await engine.generate([5, 99_999])
    with pytest.raises(InvalidArgument, match="no tokenizer"):
        await engine.generate("text needs a tokenizer")
    longest = (PROMPT * 3)[:250]
    held = [(await engine.prefill(longest)).sequence for _ in range(2)]  # max_num_seqs=2
    with pytest.raises(CapacityExhausted, match="free blocks"):
        await engine.prefill(PROMPT)
    for seq in held:
        engine.release(seq)
