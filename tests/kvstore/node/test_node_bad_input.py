"""The last bad inputs a real node refuses (issue 42): tenant names outside the documented
character set or length (on a plain node too), zero-length shards, error messages that would
echo a huge client string, /metrics that named made-up tenants without a credential."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from erasure.shard import ShardHeader, block_checksum, pack_header
from kvstore.auth import Role, add_principal
from kvstore.config import load_cluster
from kvstore.errors import MAX_QUOTED_CHARS, InvalidArgument, quoted
from kvstore.node.metrics import MAX_TENANT_LABELS, OTHER_TENANT
from kvstore.store.request_checks import MAX_TENANT_CHARS, check_tenant
from tests.kvstore.node_harness import NodeClient, free_port, make_shard, write_config

pytestmark = pytest.mark.timeout(300)
KEY = b"k" * 16


def _empty_shard() -> bytes:
    """A well-formed shard (valid header and checksum) of a zero-length block."""
    header = ShardHeader("zfec", 1, 0, 0, 0, block_checksum(b""), 0)
    return pack_header(header, b"")


def _address(config: Path) -> str:
    return load_cluster(config).nodes[0].address


def _metrics(port: int, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


@pytest.mark.parametrize(
    "tenant", ["", "x" * (MAX_TENANT_CHARS + 1), "acme\x00", "a b", "ten\nant", "tenant-é", "*"]
)
def test_tenant_names_outside_the_documented_set_are_refused(tenant: str):
    with pytest.raises(InvalidArgument, match="tenant"):
        check_tenant(tenant)


@pytest.mark.parametrize("tenant", ["acme", "org:team-1", "user@example.com", "a.b_c", "x" * 256])
def test_documented_tenant_names_pass(tenant: str):
    check_tenant(tenant)


def test_a_quoted_client_string_is_bounded():
    assert quoted("acme") == "'acme'"
    long = quoted("y" * 100_000)
    assert len(long) < MAX_QUOTED_CHARS + 40 and "100000 characters" in long, long


async def test_a_plain_node_refuses_bad_tenants_and_empty_shards(tmp_path: Path, start_node):
    config = write_config(tmp_path)
    start_node(config)
    address = _address(config)
    for tenant in ("acme\x00", "x" * 100_000, "a/b"):
        async with NodeClient(address, tenant=tenant) as client:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await client.put([(KEY, make_shard(b"data"))])
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
            assert len(caught.value.details()) < 400, "the error echoed the whole tenant"
    async with NodeClient(address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.put([(KEY, _empty_shard())])
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert "empty" in caught.value.details()
        assert not (await client.contains([KEY]))[0], "the node stored a zero-length shard"
        assert await client.put([(KEY, make_shard(b"data"))]) == 1, "the node stopped serving"


async def test_permission_denied_quotes_a_bounded_prefix_of_the_tenant(tmp_path: Path, start_node):
    credentials = tmp_path / "credentials.toml"
    token = add_principal(credentials, "svc", Role.SERVICE, frozenset({"acme"}))
    config = write_config(tmp_path, credentials_file=str(credentials))
    start_node(config)
    async with NodeClient(_address(config), tenant="q" * 100_000, token=token) as client:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await client.contains([KEY])
    # A default client sees the reason, not RESOURCE_EXHAUSTED for an oversized status.
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
    assert "may not act for tenant" in caught.value.details()
    assert len(caught.value.details()) < 400, "the error echoed the whole tenant"


async def test_metrics_need_a_token_with_auth_and_name_only_known_tenants(
    tmp_path: Path, start_node
):
    credentials = tmp_path / "credentials.toml"
    admin = add_principal(credentials, "admin", Role.ADMIN)
    service = add_principal(credentials, "svc", Role.SERVICE, frozenset({"*"}))
    add_principal(credentials, "acme", Role.TENANT)
    port = free_port()
    # metrics_auth is not set: auth alone must close /metrics.
    config = write_config(tmp_path, metrics_port=port, credentials_file=str(credentials))
    start_node(config)
    address = _address(config)
    for tenant in ["acme", *(f"made-up-{i}" for i in range(20))]:
        async with NodeClient(address, tenant=tenant, token=service) as client:
            await client.get([KEY])
    status, _ = await asyncio.to_thread(_metrics, port)
    assert status == 401, "/metrics named tenants to a caller without a credential"
    status, text = await asyncio.to_thread(_metrics, port, admin)
    assert status == 200
    assert 'tenant="acme"' in text, "a known tenant lost its label"
    assert "made-up-" not in text, "a tenant the credentials file does not name became a label"
    assert f'tenant="{OTHER_TENANT}"' in text


async def test_a_plain_node_labels_a_bounded_number_of_tenants(tmp_path: Path, start_node):
    port = free_port()
    config = write_config(tmp_path, metrics_port=port)
    start_node(config)
    address = _address(config)
    for i in range(MAX_TENANT_LABELS + 30):
        async with NodeClient(address, tenant=f"t{i}") as client:
            await client.get([KEY])
    status, text = await asyncio.to_thread(_metrics, port)
    assert status == 200
    labels = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("kvstore_tenant_reads_total{")}  # fmt: skip
    assert len(labels) == MAX_TENANT_LABELS + 1, f"{len(labels)} tenant labels: unbounded"
    assert OTHER_TENANT in labels
