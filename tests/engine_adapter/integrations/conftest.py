"""Fixtures of the engine-integration tests (vLLM, SGLang, LMCache against their real code).

Each engine's tests run in a process of their own (``make test-integrations``): the engines
keep process-wide state (vLLM's block-hash seed, LMCache's engine singletons and loop
threads), and SGLang needs another torch than the project's venv. When one session collects
more than one engine's module, or these with the rest of the suite, they skip and say how
to run them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local_cluster import LocalCluster

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules = {Path(str(item.fspath)) for item in items}
    ours = {m for m in modules if m.parent == HERE}
    if not ours or (modules == ours and len(ours) == 1):
        return
    skip = pytest.mark.skip(
        reason="engine integration tests run one engine per process: `make test-integrations` "
        "or `pytest tests/engine_adapter/integrations/test_<engine>_*.py` alone"
    )
    for item in items:
        if Path(str(item.fspath)) in ours:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A real 12-node local cluster (node processes on 127.0.0.1) for one engine's tests."""
    with LocalCluster.start(tmp_path_factory.mktemp("engine-cluster"), fsync=False) as c:
        yield c
