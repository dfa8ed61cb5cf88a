"""Principals on a real 12-node cluster with auth and TLS: a tenant is who its credential says.

The impostor scenario of issue 19: a client holding tenant evil's token that claims
``tenant="acme"`` must fail on every call, and acme's blocks must stay acme's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import struct
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from client import KVClient, block_keys
from client.ucx.reader import UcxReader
from deploy.local_cluster import LocalCluster
from deploy.local_secrets import NODE_TOKEN_FILE
from kvstore.auth import Role, read_token_file
from kvstore.errors import InvalidArgument, PermissionDenied, Unavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire.ucx_worker import batch_tag, ucx_available
from tests.client.secure_cluster import wait_for_token

pytestmark = pytest.mark.timeout(180)
KEY = bytes(range(16))
BLOCK = b"acme's secret KV block " * 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("auth")
    with LocalCluster.start(root, 12, fsync=False, auth=True, tls=True) as c:
        yield c


@pytest.fixture(scope="module")
def tokens(cluster: LocalCluster) -> dict[str, str]:
    made = {
        "acme": cluster.add_tenant("acme"),
        "evil": cluster.add_tenant("evil"),
        "serving": cluster.add_tenant("serving", Role.SERVICE, ["acme"]),
    }
    made["admin"] = cluster.admin_token or ""
    return made


async def _wait_for_reload(cluster: LocalCluster, token: str) -> None:
    await wait_for_token(cluster, "acme", token)


def _record_loop_errors() -> list[dict[str, Any]]:
    """Collect what asyncio reports as lost (e.g. 'Task exception was never retrieved')."""
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    return errors


async def _every_call_refused(kv: KVClient) -> None:
    out = bytearray(len(BLOCK))
    calls = {
        "get": lambda: kv.get(KEY),
        "get_into": lambda: kv.get_into(KEY, out),
        "contains": lambda: kv.contains([KEY]),
        "match_prefix": lambda: kv.match_prefix([KEY, bytes(16)]),
        "put": lambda: kv.put(KEY, b"attacker-chosen KV"),
        "delete": lambda: kv.delete([KEY]),
    }
    for name, call in calls.items():
        with pytest.raises(PermissionDenied):
            await call()
            pytest.fail(f"{name} with another tenant's or no credential was not refused")


async def test_impostor_fails_for_every_call(cluster: LocalCluster, tokens: dict) -> None:
    errors = _record_loop_errors()
    toml = cluster.cluster_toml
    await _wait_for_reload(cluster, tokens["serving"])
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"]) as kv:
        await kv.put(KEY, BLOCK)
        assert await kv.get(KEY) == BLOCK
    impostors = {
        "evil's token claiming acme": tokens["evil"],
        "no token": None,
        "a made-up token": "kvst_not-a-real-token",
        "the admin token (no data access)": tokens["admin"],
    }
    for token in impostors.values():
        async with KVClient.connect(toml, tenant="acme", token=token) as kv:
            await _every_call_refused(kv)
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"]) as kv:
        assert await kv.get(KEY) == BLOCK, "a refused client changed acme's block"
        assert await kv.match_prefix([KEY]) == 1, "a refused delete removed acme's block"
    async with KVClient.connect(toml, tenant="evil", token=tokens["evil"]) as kv:
        assert await kv.get(KEY) is None, "evil reads acme's key under its own tenant"
    gc.collect()
    await asyncio.sleep(0.05)
    assert not errors, f"refused calls left asyncio errors behind: {errors[:3]}"


async def test_waiting_for_a_token_no_node_knows_fails_and_names_the_nodes(
    cluster: LocalCluster,
) -> None:
    async with KVClient.connect(cluster.cluster_toml, "acme", "kvst_never-added") as kv:
        with pytest.raises(Unavailable, match=r"n00.*still refuse this client's token"):
            await kv.wait_until_accepted(timeout_s=0.5)


async def test_service_acts_only_for_its_allow_list(cluster: LocalCluster, tokens: dict) -> None:
    toml = cluster.cluster_toml
    await _wait_for_reload(cluster, tokens["serving"])
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"]) as kv:
        await kv.put(KEY, BLOCK)
    async with KVClient.connect(toml, tenant="acme", token=tokens["serving"]) as kv:
        out = np.zeros(len(BLOCK), dtype=np.uint8)
        assert await kv.get_into(KEY, out), "the service cannot read a tenant it serves"
        assert out.tobytes() == BLOCK
    async with KVClient.connect(toml, tenant="evil", token=tokens["serving"]) as kv:
        await _every_call_refused(kv)


async def test_token_comes_from_env_or_file_never_cluster_toml(
    cluster: LocalCluster, tokens: dict, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    assert tokens["acme"] not in cluster.cluster_toml.read_text(), "a token is in cluster.toml"
    assert "token_sha256" in cluster.credentials_file.read_text()
    assert tokens["acme"] not in cluster.credentials_file.read_text(), "a token stored in clear"
    assert cluster.credentials_file.stat().st_mode & 0o077 == 0, "credentials readable by others"
    await _wait_for_reload(cluster, tokens["acme"])
    monkeypatch.setenv("KVSTORE_TOKEN", tokens["acme"])
    async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
        assert await kv.contains([KEY]) is not None
    monkeypatch.delenv("KVSTORE_TOKEN")
    token_file = tmp_path / "acme.token"
    token_file.write_text(tokens["acme"] + "\n")
    token_file.chmod(0o644)
    monkeypatch.setenv("KVSTORE_TOKEN_FILE", str(token_file))
    with pytest.raises(InvalidArgument, match="chmod 600"):
        await KVClient.connect(cluster.cluster_toml, tenant="acme")
    token_file.chmod(0o600)
    async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
        assert await kv.contains([KEY]) is not None


async def test_local_reads_derive_the_tenant_too(cluster: LocalCluster, tokens: dict) -> None:
    """The local channel authenticates its HELLO and every READ like a gRPC call: a token
    that may not act for the tenant gets no link, so no arena of its ever holds acme's bytes."""
    toml = cluster.cluster_toml
    await _wait_for_reload(cluster, tokens["serving"])
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"]) as kv:
        await kv.put(KEY, BLOCK)
    for token in (tokens["acme"], tokens["serving"]):
        async with KVClient.connect(toml, tenant="acme", token=token, transport="local") as kv:
            assert await kv.get_batch([KEY]) == [BLOCK]
            assert kv.local is not None and kv.local.counters.num_local_replies > 0, (
                "read not over the local channel"
            )
    for token in (None, "wrong", tokens["evil"]):
        with pytest.raises(PermissionDenied):
            async with KVClient.connect(toml, tenant="acme", token=token, transport="local") as kv:
                await kv.get(KEY)
        async with KVClient.connect(toml, tenant="acme", token=token, transport="auto") as kv:
            with pytest.raises(PermissionDenied):
                await kv.get_batch([KEY])
            assert kv.local is not None and kv.local.counters.num_local_replies == 0, (
                "an impostor's read was answered over the local channel"
            )
    # Data roles only, as over UCX: a node credential (which may read any tenant over gRPC,
    # for repair) and an admin credential get no local session.
    node_token = read_token_file(cluster.root / NODE_TOKEN_FILE)
    for token in (node_token, tokens["admin"]):
        with pytest.raises(PermissionDenied):
            async with KVClient.connect(toml, tenant="acme", token=token, transport="local") as kv:
                await kv.get(KEY)


async def test_stream_reads_are_tls_and_derive_the_tenant_too(
    cluster: LocalCluster, tokens: dict
) -> None:
    """The stream channel on a TLS cluster: its connections verify the node's certificate,
    and HELLO and every READ are authenticated like a gRPC call; a token that may not act
    for the tenant gets no link, and no node or admin credential reads over it."""
    toml = cluster.cluster_toml
    await _wait_for_reload(cluster, tokens["serving"])
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"]) as kv:
        await kv.put(KEY, BLOCK)
    for token in (tokens["acme"], tokens["serving"]):
        async with KVClient.connect(toml, tenant="acme", token=token, transport="stream") as kv:
            assert await kv.get_batch([KEY]) == [BLOCK]
            assert kv.stream is not None and kv.stream.counters.num_local_replies > 0, (
                "read not over the stream channel"
            )
            assert kv.stream.tls is not None, "a TLS cluster's stream connection is plaintext"
            link = next(r.link for r in kv.stream.readers if r.link is not None)
            assert link._sock.tls, "the link's socket is not TLS"
    node_token = read_token_file(cluster.root / NODE_TOKEN_FILE)
    for token in (None, "wrong", tokens["evil"], node_token, tokens["admin"]):
        with pytest.raises(PermissionDenied):
            async with KVClient.connect(toml, tenant="acme", token=token, transport="stream") as kv:
                await kv.get(KEY)


@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
async def test_reads_over_ucx_derive_the_tenant_too(cluster: LocalCluster, tokens: dict) -> None:
    toml = cluster.cluster_toml
    await _wait_for_reload(cluster, tokens["serving"])
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"]) as kv:
        await kv.put(KEY, BLOCK)
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"], transport="ucx") as kv:
        assert await kv.get(KEY) == BLOCK
        assert kv.ucx is not None and kv.ucx.counters.num_ucx_replies > 0, "read not over UCX"
    for token in (None, "wrong", tokens["evil"]):
        with pytest.raises(PermissionDenied):  # at connect (no session) or at the read
            async with KVClient.connect(toml, tenant="acme", token=token, transport="ucx") as kv:
                await kv.get(KEY)


@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
async def test_a_ucx_reply_its_session_did_not_sign_is_not_taken(
    cluster: LocalCluster, tokens: dict
) -> None:
    """Every reader's session key is swapped for one the nodes never handed out, as if each
    node had restarted (forgetting its sessions) or another process answered on its UCX
    address: no reply is taken, the read falls back to gRPC with the right bytes, and each
    reader opens a new session over gRPC."""
    rng = random.Random(13)
    keys = block_keys(list(range(40)), 4, "sessions", "salt")
    blocks = {key: rng.randbytes(rng.randint(1 << 10, 300 << 10)) for key in keys}
    toml, token = cluster.cluster_toml, tokens["acme"]
    async with KVClient.connect(toml, tenant="acme", token=token, transport="ucx") as kv:
        await kv.put_batch(list(blocks), list(blocks.values()), traffic_class="chat")
        assert kv.ucx is not None
        deadline_s = time.monotonic() + 60
        while kv.ucx.counters.num_ucx_replies == 0:  # sessions open in the background
            assert time.monotonic() < deadline_s, "no read was ever answered over UCX"
            assert await kv.get_batch(keys) == list(blocks.values())
            await asyncio.sleep(0.05)
        forged = b"f" * 32
        readers = [r for r in kv.readers if isinstance(r, UcxReader) and r.session is not None]
        for reader in readers:
            reader.session = dataclasses.replace(reader.session, key=forged)
        fallbacks = kv.ucx.counters.num_fallbacks
        assert await kv.get_batch(keys) == list(blocks.values()), "wrong bytes after a refusal"
        assert kv.ucx.counters.num_fallbacks > fallbacks, "a reply to a forged session was taken"
        while any(r.session is None or r.session.key == forged for r in readers):
            assert time.monotonic() < deadline_s, "a reader never opened a new session"
            await asyncio.sleep(0.05)


@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
async def test_an_old_clients_token_frame_is_refused_at_once(
    cluster: LocalCluster, tokens: dict
) -> None:
    """A client of the release before UCX sessions sends its token in the frame: the node
    refuses it at once, in that release's format, so the client reads over gRPC without
    waiting out its UCX timeout during a rolling upgrade."""
    toml = cluster.cluster_toml
    async with KVClient.connect(toml, tenant="acme", token=tokens["acme"], transport="ucx") as kv:
        assert kv.ucx is not None
        transport = kv.ucx.transport
        node_id = next(r.node_id for r in kv.readers if isinstance(r, UcxReader) and r.usable())
        tag_base = transport.next_tag_base()
        box: list[memoryview] = []

        def allocate(num_bytes: int) -> memoryview:
            box.append(memoryview(bytearray(num_bytes)))
            return box[0]

        reply = transport.worker.receive(batch_tag(tag_base, 0), allocate, 1 << 20)
        delivery = pb.UcxDelivery(worker_address=transport.address, tag_base=tag_base)
        request = pb.GetShardsRequest(tenant="acme", keys=[KEY], ucx=delivery)
        token = tokens["acme"].encode()
        old_frame = b"KVRQ" + struct.pack("<H", len(token)) + token + request.SerializeToString()
        await transport.send_request(node_id, old_frame)
        num_bytes = await asyncio.wait_for(reply, 30)
        frame = bytes(box[0][:num_bytes])
    assert frame[:2] == bytes((1, grpc.StatusCode.UNAVAILABLE.value[0])), frame
    assert b"upgrade the client" in frame
