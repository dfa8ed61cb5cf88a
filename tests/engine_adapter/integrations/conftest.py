"""Fixtures of the engine-integration tests (vLLM, SGLang, LMCache against their real code).

Each engine's tests run in a process of their own (``make test-integrations``): the engines
keep process-wide state (vLLM's block-hash seed, LMCache's engine singletons and loop
threads), and SGLang needs another torch than the project's venv. When one session collects
more than one engine's module, or these with the rest of the suite, they skip and say how
to run them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deploy.local_cluster import LocalCluster
from kvstore.auth import write_private
from tests.client.secure_cluster import add_tenants

HERE = Path(__file__).resolve().parent
TENANTS = ("acme", "globex")


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
    """A real 12-node local cluster (node processes on 127.0.0.1) for one engine's tests, as
    a production cluster runs: credentials required, TLS on."""
    root = tmp_path_factory.mktemp("engine-cluster")
    # A generous start-up wait: the engines' imports keep a small machine busy meanwhile.
    with LocalCluster.start(root, fsync=False, auth=True, tls=True, startup_timeout_s=300) as c:
        yield c


@pytest.fixture(scope="module")
def token_files(cluster: LocalCluster) -> dict[str, str]:
    """Tenant -> the path of a file holding its token (mode 0600), for tenants acme and globex,
    once every node accepts them. The adapters read tokens only from such files."""
    token_dir = cluster.root / "tokens"
    token_dir.mkdir(exist_ok=True)
    files = {}
    for tenant, token in add_tenants(cluster, TENANTS).items():
        path = token_dir / f"{tenant}.token"
        write_private(path, token + "\n")
        files[tenant] = str(path)
    return files


@pytest.fixture(scope="module")
def store_config(
    cluster: LocalCluster, token_files: dict[str, str]
) -> Callable[..., dict[str, str]]:
    """The kvstore keys of an engine's config for a tenant: the cluster and the tenant's own
    token file (``store_config("globex")``; acme by default)."""

    def config(tenant: str = "acme") -> dict[str, str]:
        return {
            "cluster": str(cluster.cluster_toml),
            "tenant": tenant,
            "token_file": token_files[tenant],
        }

    return config
