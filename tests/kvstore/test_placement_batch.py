"""groups_of_keys: the rendezvous placement hash over a numpy batch equals group_of_key."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.placement import group_of_key, groups_of_keys


@pytest.mark.parametrize("num_groups", [1, 2, 3, 12, 97])
def test_batch_placement_equals_the_per_key_hash(num_groups: int) -> None:
    rng = np.random.default_rng(num_groups)
    keys = rng.integers(0, 256, size=(5000, 16), dtype=np.uint8)
    keys[:4] = [[0] * 16, [255] * 16, list(range(16)), [1] + [0] * 15]  # edge bit patterns
    want = [group_of_key(bytes(key), num_groups) for key in keys]
    assert groups_of_keys(keys, num_groups).tolist() == want, (
        "the numpy xxh3_64 of group id || key disagrees with xxhash: wrong secret, length "
        "term or 128-bit multiply"
    )
    words = keys.view("<u8")
    assert groups_of_keys(words, num_groups).tolist() == want, "the uint64 [n, 2] view too"


def test_batch_placement_refuses_other_shapes() -> None:
    with pytest.raises(InvalidArgument, match=r"uint8 \[n, 16\]"):
        groups_of_keys(np.zeros((3, 8), np.uint8), 4)
