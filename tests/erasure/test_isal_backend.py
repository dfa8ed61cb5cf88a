"""The ctypes ISA-L backend against pyeclib's own isa_l_rs_vand, and its (k, m) guard."""

from __future__ import annotations

import ctypes
import itertools
import random

import pytest
from pyeclib.ec_iface import ECDriver

from erasure.codec import make_codec
from erasure.config import CodecConfig
from erasure.isal_backend import check_vand_k_m, isal_version, load_isal
from erasure.shard import HEADER_BYTES

PYECLIB_HEADER_BYTES = 80  # liberasurecode's fragment header


@pytest.mark.parametrize(("k", "m"), [(10, 2), (3, 2), (6, 3), (20, 4)])
@pytest.mark.parametrize("num_bytes", [1, 10, 99, 4096, 65_537])
def test_payloads_match_pyeclib_isa_l_rs_vand(k: int, m: int, num_bytes: int) -> None:
    block = random.Random(num_bytes).randbytes(num_bytes)
    ours = [s[HEADER_BYTES:] for s in make_codec(CodecConfig(k=k, m=m)).encode(block)]
    driver = ECDriver(k=k, m=m, ec_type="isa_l_rs_vand")
    theirs = [f[PYECLIB_HEADER_BYTES:] for f in driver.encode(block)]
    assert ours == theirs, "our ISA-L matrix or padding differs from liberasurecode's isa_l_rs_vand"


def test_pyeclib_payloads_decode_with_our_codec() -> None:
    block = random.Random(7).randbytes(50_000)
    codec = make_codec(CodecConfig())
    fragments = ECDriver(k=10, m=2, ec_type="isa_l_rs_vand").encode(block)
    ours = codec.encode(block)
    # Rebuild our shards around pyeclib's payloads: byte-identical, so they must verify.
    rebuilt = [
        s[:HEADER_BYTES] + f[PYECLIB_HEADER_BYTES:] for s, f in zip(ours, fragments, strict=True)
    ]
    assert rebuilt == ours
    assert codec.decode(rebuilt[2:]) == block


def _has_singular_subset(k: int, m: int) -> bool:
    lib = load_isal()
    matrix = (ctypes.c_ubyte * ((k + m) * k))()
    lib.gf_gen_rs_matrix(matrix, k + m, k)
    for rows in itertools.combinations(range(k + m), k):
        square = (ctypes.c_ubyte * (k * k))(*[matrix[r * k + c] for r in rows for c in range(k)])
        if lib.gf_invert_matrix(square, (ctypes.c_ubyte * (k * k))(), k) != 0:
            return True
    return False


@pytest.mark.parametrize(("k", "m"), [(5, 6), (6, 5), (8, 5)])
def test_rejected_k_m_really_have_undecodable_subsets(k: int, m: int) -> None:
    assert _has_singular_subset(k, m), f"{k}+{m} is decodable: the guard is too strict"
    with pytest.raises(ValueError, match="backend 'zfec'"):
        check_vand_k_m(k, m)


@pytest.mark.parametrize(("k", "m"), [(10, 2), (10, 4), (5, 5), (4, 8), (3, 9), (12, 3)])
def test_accepted_k_m_decode_from_every_subset(k: int, m: int) -> None:
    check_vand_k_m(k, m)
    assert not _has_singular_subset(k, m), f"{k}+{m} passed the guard but has a singular subset"


def test_library_is_found_and_reports_a_version() -> None:
    assert isal_version().count(".") >= 1
