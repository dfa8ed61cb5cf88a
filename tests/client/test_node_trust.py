"""Nodes prove which node they are, on a real 12-node cluster with tokens and mutual TLS.

The audit's impostor: a server at n00's address holding n05's (valid, CA-signed) certificate
collected tenants' bearer tokens. Now every channel to a node is made for the node id the map
puts at that address, so the handshake fails before any request or token goes out; the same
fake holding n00's own certificate does receive them (the check that this test can fail). The
node credential is accepted only with a member node's certificate, and tokens rotate.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from client import KVClient
from deploy.local_cluster import LocalCluster
from deploy.local_secrets import NODE_TOKEN_FILE, TLS_DIR
from erasure.codec import make_codec
from kvstore.auth import add_principal, read_token_file
from kvstore.certs import issue_files
from kvstore.errors import KVStoreError, PermissionDenied
from kvstore.node.peers import Peers
from kvstore.placement import Placement
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import channel_credentials, sync_channel
from kvstore.wire.ucx_worker import ucx_available
from tests.client.secure_cluster import random_block

pytestmark = pytest.mark.timeout(300)
KEYS = [bytes([i]) * 16 for i in range(3)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("identity")
    with LocalCluster.start(root, 12, fsync=False, auth=True, mtls=True) as c:
        yield c


@pytest.fixture(scope="module")
def client_cert(cluster: LocalCluster) -> dict[str, str]:
    cert, key = issue_files(cluster.root / TLS_DIR, "acme-client")
    return {"tls_cert_file": str(cert), "tls_key_file": str(key)}


class FakeNode:
    """A gRPC server that answers every method with UNAVAILABLE and keeps the bearer tokens
    it was sent: what an impostor at a node's address would collect."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers((_Recorder(self.tokens),))

    async def start(self, address: str, cert_file: Path, key_file: Path) -> None:
        pair = (key_file.read_bytes(), cert_file.read_bytes())
        bound = self.server.add_secure_port(address, grpc.ssl_server_credentials([pair]))
        assert bound, f"the fake could not bind {address}"
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0)


class _Recorder(grpc.GenericRpcHandler):
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        for name, value in details.invocation_metadata or ():
            if name == "authorization":
                self.tokens.append(str(value))

        async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake node")
            return b""

        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture
async def n00_down(cluster: LocalCluster) -> AsyncIterator[str]:
    """n00's address, its node killed for the test and restarted after it."""
    cluster.kill_node("n00")
    try:
        yield cluster.config.node("n00").address
    finally:
        await asyncio.to_thread(cluster.restart_node, "n00")


async def _talk_to_every_node(cluster: LocalCluster, token: str, cert: dict[str, str]) -> None:
    """What a tenant's client and a peer node send n00: puts, reads, a peer's calls."""
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", token=token, **cert) as kv:
        blocks = [random_block(i, 64 << 10) for i in range(len(KEYS))]
        await kv.put_batch(KEYS, blocks, traffic_class="chat")
        assert await kv.get_batch(KEYS) == blocks, "11 nodes did not serve the blocks"
        await kv.contains(KEYS)
    config = cluster.config
    peers = Peers(config, config.node("n01"), timeout_s=3.0)
    try:
        await peers.health("n00")
        with pytest.raises(KVStoreError):
            await peers.list_shards("n00", 0, b"", 8)
    finally:
        await peers.close()


async def test_no_token_reaches_an_impostor_with_another_nodes_certificate(
    cluster: LocalCluster, client_cert: dict[str, str], n00_down: str
) -> None:
    token = cluster.add_tenant("acme")
    async with KVClient.connect(
        cluster.cluster_toml, tenant="acme", token=token, **client_cert
    ) as kv:
        await asyncio.wait_for(_accepted_by_all_but_n00(kv), 60)
    tls = cluster.root / TLS_DIR
    impostor = FakeNode()
    await impostor.start(n00_down, tls / "n05.pem", tls / "n05.key")
    try:
        await _talk_to_every_node(cluster, token, client_cert)
    finally:
        await impostor.stop()
    assert impostor.tokens == [], (
        f"{len(impostor.tokens)} tokens went to a server holding n05's certificate at n00's "
        "address: channels do not check the node's identity"
    )
    genuine = FakeNode()  # the same fake with n00's own certificate: tokens do reach it
    await genuine.start(n00_down, tls / "n00.pem", tls / "n00.key")
    try:
        await _talk_to_every_node(cluster, token, client_cert)
    finally:
        await genuine.stop()
    node_token = read_token_file(cluster.root / NODE_TOKEN_FILE)
    assert f"Bearer {token}" in genuine.tokens, "the control fake saw no tenant token"
    assert f"Bearer {node_token}" in genuine.tokens, "the control fake saw no node token"


async def _accepted_by_all_but_n00(kv: KVClient) -> None:
    request = pb.ContainsRequest(tenant="acme", keys=[bytes(16)])
    while True:
        conns = [c for n, c in kv.conns.items() if n != "n00"]
        replies = await asyncio.gather(
            *(c.call("Contains", request, 5.0) for c in conns), return_exceptions=True
        )
        if not any(isinstance(r, PermissionDenied) for r in replies):
            return
        await asyncio.sleep(0.1)


def _list_shards(cluster: LocalCluster, cert: str | None, token: str | None) -> grpc.StatusCode:
    """ListShards on n01 (a node-or-admin call) with ``cert``'s pair from DIR/tls and
    ``token``; its status code."""
    tls = cluster.root / TLS_DIR
    pair = (str(tls / f"{cert}.pem"), str(tls / f"{cert}.key")) if cert else (None, None)
    config = cluster.config
    credentials = channel_credentials(config, *pair) if cert else _no_client_cert(config)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with sync_channel(config.node("n01").address, credentials, node_id="n01") as channel:
        try:
            ShardStoreStub(channel).ListShards(
                pb.ListShardsRequest(group=1, limit=1), timeout=10, metadata=metadata
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _no_client_cert(config) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(Path(config.tls.ca_file).read_bytes())


def test_node_token_needs_the_certificate_of_a_member_node(cluster: LocalCluster) -> None:
    node_token = read_token_file(cluster.root / NODE_TOKEN_FILE)
    issue_files(cluster.root / TLS_DIR, "n99", ["127.0.0.1"], node=True)  # a node of no map
    ok, denied = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED
    cases = {
        ("n05", node_token): ok,
        ("admin", node_token): denied,  # a client certificate the CA signed
        ("n99", node_token): denied,
        ("n05", None): denied,  # a node's certificate alone is no credential
    }
    got = {case: _list_shards(cluster, *case) for case in cases}
    wrong = {
        f"{c[0]} + {'token' if c[1] else 'no token'}": g for c, g in got.items() if g != cases[c]
    }
    assert not wrong, f"the node credential's certificate check is wrong: {wrong}"
    assert _list_shards(cluster, None, node_token) != ok, "mTLS let a call in without a cert"


def _cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.cli", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_rotate_token_for_a_tenant_and_the_nodes(cluster: LocalCluster) -> None:
    old = cluster.add_tenant("rotating")
    new = _cli("rotate-token", "--dir", str(cluster.root), "rotating", "--grace", "0").strip()
    assert new and new != old
    _wait_for_code(
        cluster, "rotating-refused", lambda: _contains(cluster, old), {"PERMISSION_DENIED"}
    )
    _wait_for_code(cluster, "rotating-accepted", lambda: _contains(cluster, new), {"OK"})
    old_node = read_token_file(cluster.root / NODE_TOKEN_FILE)
    _cli("rotate-token", "--dir", str(cluster.root), "nodes", "--grace", "0")
    new_node = read_token_file(cluster.root / NODE_TOKEN_FILE)
    assert new_node != old_node, "rotate-token did not write the local node.token"
    _wait_for_code(
        cluster,
        "old node token",
        lambda: _list_shards(cluster, "n05", old_node).name,
        {"PERMISSION_DENIED"},
    )
    assert _list_shards(cluster, "n05", new_node) == grpc.StatusCode.OK


def _contains(cluster: LocalCluster, token: str) -> str:
    tls = cluster.root / TLS_DIR
    credentials = channel_credentials(
        cluster.config, str(tls / "admin.pem"), str(tls / "admin.key")
    )
    with sync_channel(cluster.config.node("n02").address, credentials, node_id="n02") as channel:
        try:
            ShardStoreStub(channel).Contains(
                pb.ContainsRequest(keys=[bytes(16)]),
                timeout=10,
                metadata=(("authorization", f"Bearer {token}"),),
            )
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def _wait_for_code(cluster: LocalCluster, what: str, call, wanted: set[str]) -> None:
    """Poll ``call`` until it answers one of ``wanted`` (nodes re-read credentials within a
    second, later under load)."""
    deadline_s = time.monotonic() + 60
    while (code := call()) not in wanted:
        assert time.monotonic() < deadline_s, f"{what}: still {code} after 60 s"
        time.sleep(0.2)


async def test_rotate_certs_keeps_the_cluster_serving(
    cluster: LocalCluster, client_cert: dict[str, str]
) -> None:
    before = (cluster.root / TLS_DIR / "n03.pem").read_bytes()
    await asyncio.to_thread(_cli, "rotate-certs", "--dir", str(cluster.root))
    assert (cluster.root / TLS_DIR / "n03.pem").read_bytes() != before
    token = cluster.add_tenant("after-rotation")
    async with KVClient.connect(
        cluster.cluster_toml, tenant="after-rotation", token=token, **client_cert
    ) as kv:
        await kv.wait_until_accepted()
        await kv.put(KEYS[0], b"served with new certificates")
        assert await kv.get(KEYS[0]) == b"served with new certificates"


def _forged_repair_puts(
    cluster: LocalCluster, key: bytes, block: bytes, tenant: str = "acme", cert: str = "n05"
) -> dict[str, str]:
    """The audit's attack: with a node's certificate and the node token, a repair write of a
    made-up block's shard i to member i of the key's group, newer than anything there and
    never expiring. Node id -> the status each member answered."""
    config = cluster.config
    tls = cluster.root / TLS_DIR
    credentials = channel_credentials(config, str(tls / f"{cert}.pem"), str(tls / f"{cert}.key"))
    token = read_token_file(cluster.root / NODE_TOKEN_FILE)
    shards = make_codec(config.codec).encode(block)
    members = Placement(config).nodes_for_key(key)
    codes = {}
    for index, node_id in enumerate(members):
        request = pb.PutShardsRequest(
            tenant=tenant,
            traffic_class="chat",
            shards=[pb.ShardPut(key=key, shard=shards[index], written_at_s=time.time() + 1e6)],
            expires_at_s=time.time() + 1e9,
            repair=True,
        )
        address = config.node(node_id).address
        with sync_channel(address, credentials, node_id=node_id) as channel:
            try:
                reply = ShardStoreStub(channel).PutShards(
                    request, timeout=30, metadata=(("authorization", f"Bearer {token}"),)
                )
                codes[node_id] = f"OK stored={reply.num_stored}"
            except grpc.RpcError as exc:
                codes[node_id] = exc.code().name
    return codes


async def test_the_node_credential_cannot_mint_a_version_or_plant_a_key(
    cluster: LocalCluster, client_cert: dict[str, str]
) -> None:
    token = cluster.add_tenant("acme")
    written, planted = b"w" * 16, b"p" * 16
    genuine = random_block(7, 200_000)
    async with KVClient.connect(
        cluster.cluster_toml, tenant="acme", token=token, **client_cert
    ) as kv:
        await kv.wait_until_accepted()
        await kv.put(written, genuine)
    forged = random_block(8, 200_000)
    for key in (written, planted):
        codes = await asyncio.to_thread(_forged_repair_puts, cluster, key, forged)
        stored = {n: c for n, c in codes.items() if c.startswith("OK")}
        assert not stored, f"a node-token repair write of key {key!r} was stored on {stored}"
        assert set(codes.values()) == {"PERMISSION_DENIED"}, codes
    async with KVClient.connect(
        cluster.cluster_toml, tenant="acme", token=token, **client_cert
    ) as kv:
        assert await kv.get(written) == genuine, "acme did not read its own block back"
        assert await kv.get(planted) is None, "acme read a key it never wrote"


@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
async def test_a_certificate_only_client_reads_over_ucx_with_a_session(
    cluster: LocalCluster,
) -> None:
    """A principal known only by its client certificate (no token) gets UCX sessions as that
    principal: its reads go over UCX, and the node acts for its tenant only."""
    add_principal(cluster.credentials_file, "certonly", cert_identity="certonly-client")
    cert, key = issue_files(cluster.root / TLS_DIR, "certonly-client")
    cert_only = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
    key_, block = b"u" * 16, random_block(21, 200_000)
    async with KVClient.connect(cluster.cluster_toml, tenant="certonly", **cert_only) as kv:
        await kv.wait_until_accepted()  # the nodes re-read the credentials file
        await kv.put(key_, block)
    async with KVClient.connect(
        cluster.cluster_toml, tenant="certonly", transport="ucx", **cert_only
    ) as kv:
        assert await kv.get(key_) == block
        assert kv.ucx is not None and kv.ucx.counters.num_ucx_replies > 0, "read not over UCX"
    async with KVClient.connect(
        cluster.cluster_toml, tenant="acme", transport="ucx", **cert_only
    ) as kv:
        with pytest.raises(PermissionDenied):  # the session is certonly's, whatever it claims
            await kv.get(key_)
