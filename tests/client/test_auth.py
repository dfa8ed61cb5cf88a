"""A cluster with an auth token: the client's token travels with every RPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from client import KVClient
from deploy.local_cluster import LocalCluster
from kvstore.errors import PermissionDenied
from kvstore.ucx_worker import ucx_available

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(16))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("auth")
    with LocalCluster.start(root, 12, fsync=False, auth_token="s3cret") as c:
        yield c


async def test_right_token_works_wrong_or_missing_token_is_refused(cluster: LocalCluster) -> None:
    toml: Path = cluster.cluster_toml
    async with KVClient.connect(toml, tenant="acme", token="s3cret") as kv:
        await kv.put(KEY, b"secret block")
        assert await kv.get(KEY) == b"secret block"
        assert await kv.contains([KEY]) == [True]
    for token in (None, "wrong"):
        async with KVClient.connect(toml, tenant="acme", token=token) as kv:
            with pytest.raises(PermissionDenied):
                await kv.put(KEY, b"overwrite")
            with pytest.raises(PermissionDenied):
                await kv.get(KEY)
            with pytest.raises(PermissionDenied):
                await kv.contains([KEY])
            with pytest.raises(PermissionDenied):
                await kv.delete([KEY])
    async with KVClient.connect(toml, tenant="acme", token="s3cret") as kv:
        assert await kv.get(KEY) == b"secret block", "a refused client changed stored data"


@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
async def test_reads_over_ucx_check_the_token_too(cluster: LocalCluster) -> None:
    toml: Path = cluster.cluster_toml
    async with KVClient.connect(toml, tenant="acme", token="s3cret") as kv:
        await kv.put(KEY, b"secret block over ucx")
    async with KVClient.connect(toml, tenant="acme", token="s3cret", transport="ucx") as kv:
        assert await kv.get(KEY) == b"secret block over ucx"
        assert kv.ucx is not None and kv.ucx.counters.num_ucx_replies > 0, "read not over UCX"
    for token in (None, "wrong"):
        async with KVClient.connect(toml, tenant="acme", token=token, transport="ucx") as kv:
            with pytest.raises(PermissionDenied):
                await kv.get(KEY)
