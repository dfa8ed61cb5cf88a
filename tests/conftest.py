"""Fixtures that tests of several packages share."""

from __future__ import annotations

import pytest

from erasure import fastsum


@pytest.fixture(params=["native", "python"])
def checksum_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs with the native checksum helper (where `make native` built it) and with
    its python-xxhash fallback (erasure/fastsum.py)."""
    if request.param == "native":
        if not fastsum.NATIVE:
            pytest.skip("erasure/_fastsum.so is not built (make native)")
    else:
        monkeypatch.setattr(fastsum, "_lib", None)
        monkeypatch.setattr(fastsum, "NATIVE", False)
    return request.param
