"""block_keys: chained xxh3-128 over full blocks, identical in every process."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from client.keys import block_keys, namespaced_keys
from kvstore.errors import InvalidArgument

TOKENS = list(range(1000, 1300))


def test_only_full_blocks_get_keys() -> None:
    assert len(block_keys(TOKENS, 64, "m", "s")) == 4
    assert block_keys(TOKENS[:63], 64, "m", "s") == []
    assert block_keys([], 64, "m", "s") == []


def test_keys_are_a_chain_over_prefixes() -> None:
    keys = block_keys(TOKENS, 64, "model-a", "salt")
    assert keys[:2] == block_keys(TOKENS[:150], 64, "model-a", "salt"), "prefix keys changed"
    changed = [*TOKENS[:10], 7, *TOKENS[11:]]
    other = block_keys(changed, 64, "model-a", "salt")
    assert all(a != b for a, b in zip(keys, other, strict=True)), (
        "a change in block 0 must change every later key (the chain is broken)"
    )
    assert all(len(k) == 16 for k in keys)


def test_documented_chain_formula() -> None:
    root = xxhash.xxh3_128_digest(
        b"kvstore.block_keys.v1" + b"\x01\x00\x00\x00m" + b"\x01\x00\x00\x00s" + b"\x04\x00\x00\x00"
    )
    first = xxhash.xxh3_128_digest(root + np.array([1, 2, 3, 4], dtype="<u4").tobytes())
    assert block_keys([1, 2, 3, 4, 5], 4, "m", "s") == [first]


def test_namespace_salt_and_block_size_separate_keys() -> None:
    base = block_keys(TOKENS, 32, "ab", "c")
    assert base != block_keys(TOKENS, 32, "a", "bc"), "fields run together: add length prefixes"
    assert base[0] != block_keys(TOKENS, 32, "ab", "other-tenant")[0]
    assert base[0] != block_keys(TOKENS, 64, "ab", "c")[0]
    assert base == block_keys(np.array(TOKENS, dtype=np.int64), 32, b"ab", b"c")


def test_same_keys_in_another_process() -> None:
    code = (
        "import json; from client.keys import block_keys; "
        f"print(json.dumps([k.hex() for k in block_keys({TOKENS!r}, 16, 'ns', 'salt')]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, text=True)
    assert json.loads(out.stdout) == [k.hex() for k in block_keys(TOKENS, 16, "ns", "salt")], (
        "keys differ across processes: something seeds the hash per process"
    )


@pytest.mark.parametrize(
    ("tokens", "block_tokens"),
    [([-1, 2], 1), ([2**32], 1), ([[1, 2]], 1), ([1.5], 1), ([1, 2], 0)],
)
def test_bad_input_is_rejected(tokens: object, block_tokens: int) -> None:
    with pytest.raises(InvalidArgument):
        block_keys(tokens, block_tokens, "m", "s")  # type: ignore[arg-type]


def test_namespaced_keys_follow_the_documented_formula() -> None:
    root = xxhash.xxh3_128_digest(
        b"kvstore.namespaced_keys.v1" + b"\x02\x00\x00\x00ns" + b"\x04\x00\x00\x00acme"
    )
    expected = xxhash.xxh3_128_digest(root + b"\x01\x00\x00\x00k" + b"engine-key")
    assert namespaced_keys([b"engine-key"], "ns", "acme", "k") == [expected], (
        "namespaced_keys changed its format: every stored engine block would miss"
    )
    assert namespaced_keys(["engine-key"], b"ns", b"acme", b"k") == [expected]


def test_namespaced_keys_separate_namespace_salt_and_part() -> None:
    engine_keys = [b"\x01" * 32, b"\x02" * 32]
    base = namespaced_keys(engine_keys, "model=a;dtype=bfloat16", "acme", "k")
    variants = [
        namespaced_keys(engine_keys, "model=a;dtype=float16", "acme", "k"),
        namespaced_keys(engine_keys, "model=a;dtype=bfloat16", "globex", "k"),
        namespaced_keys(engine_keys, "model=a;dtype=bfloat16", "acme", "v"),
    ]
    assert all(len(k) == 16 for k in base) and base[0] != base[1]
    for other in variants:
        assert not set(other) & set(base), "another namespace, salt or part shared a store key"
    with pytest.raises(InvalidArgument, match="str or bytes"):
        namespaced_keys([7], "ns")  # type: ignore[list-item]
