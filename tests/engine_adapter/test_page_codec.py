"""engine_adapter/integrations/page_codec.py: runs of a pool's memory to e4m3x16 blocks and
back, as the SGLang backend stores them (its integration tests run it inside SGLang)."""

from __future__ import annotations

import pytest
import torch

from engine_adapter import kv_format
from engine_adapter.integrations.page_codec import decode_runs, encode_runs, staging_for


def _view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_runs_come_back_as_the_codec_decodes_them(dtype: torch.dtype) -> None:
    runs = [
        torch.randn(4, 32, generator=torch.Generator().manual_seed(i)).to(dtype) for i in (1, 2)
    ]
    blocks = encode_runs([_view(r) for r in runs], dtype)
    assert [len(b) for b in blocks] == [4 * 32 * 9 // 8] * 2, "not 1.125 bytes a value"
    out = [torch.zeros_like(r) for r in runs]
    staging = staging_for([_view(o) for o in out], dtype)
    for target, block in zip(staging, blocks, strict=True):
        target[:] = block
    assert decode_runs(staging, [_view(o) for o in out], dtype, [True, False]) == [True, False]
    values = runs[0].view(-1, 16)
    want = kv_format.dequantize(*kv_format.quantize(values), torch.empty_like(values))
    assert torch.equal(out[0].view(-1, 16), want), "not the codec's decode"
    assert not out[1].any(), "a block that did not land was decoded"


def test_a_block_holding_inf_is_a_miss_and_leaves_the_run_alone() -> None:
    inf = torch.full((64,), float("inf"), dtype=torch.bfloat16)
    blocks = encode_runs([_view(inf)], torch.bfloat16)
    out = torch.ones(64, dtype=torch.bfloat16)
    assert decode_runs(blocks, [_view(out)], torch.bfloat16, [True]) == [False]
    assert torch.equal(out, torch.ones(64, dtype=torch.bfloat16)), "a miss changed the run"


def test_a_partial_group_is_refused() -> None:
    with pytest.raises(ValueError, match="whole groups of 16"):
        encode_runs([_view(torch.zeros(24, dtype=torch.bfloat16))], torch.bfloat16)
