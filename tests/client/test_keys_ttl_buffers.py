"""What users reach for first, against a real 12-node cluster with auth on (a minute a second):
``str`` keys hashed as ``kvstore get|put|del|ttl|inspect`` hash them, a put's own TTL, CPU
tensors and other buffers as blocks, and the key commands themselves as a user runs them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from client import SyncKVClient
from client.key_commands import block_life, inspect_nodes
from client.keys import string_key
from deploy.local_cluster import LocalCluster
from kvstore.auth import write_private
from kvstore.errors import InvalidArgument
from tests.client.secure_cluster import add_tenants

pytestmark = pytest.mark.timeout(600)
MINUTE_S = 60.0
HOUR_S = 60 * MINUTE_S
DAY_S = 24 * HOUR_S


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("keys-cluster")
    with LocalCluster.start(root, 12, time_scale=MINUTE_S, auth=True, fsync=False) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def tokens(cluster: LocalCluster) -> dict[str, str]:
    return add_tenants(cluster, ["acme", "globex"])


@pytest.fixture
def kv(cluster: LocalCluster, tokens: dict[str, str]) -> Iterator[SyncKVClient]:
    with SyncKVClient.connect(cluster.cluster_toml, "acme", tokens["acme"]) as client:
        yield client


def _own_ttl_s(kv: SyncKVClient, key: str) -> float | None:
    """The TTL the nodes keep the block by (its expiry less its last access)."""
    reading = inspect_nodes(kv.client, string_key(key), 10.0)  # on the client's own loop
    nodes = asyncio.run_coroutine_threadsafe(reading, kv.loop).result()
    life = block_life(nodes, kv.client.config.codec.k)
    return None if life is None else life["block_ttl_s"]


def test_str_keys_hash_as_documented() -> None:
    assert string_key("greeting").hex() == "3eaccfa393609d821160e7aa2faf5e2a", "the hash moved"
    assert string_key("greeting") != string_key("greeting ")
    with pytest.raises(InvalidArgument, match="non-empty str"):
        string_key("")


def test_str_keys_in_every_call(kv: SyncKVClient) -> None:
    kv.put("greeting", b"hello")
    assert kv.get("greeting") == kv.get(string_key("greeting")) == b"hello"
    kv.put_batch(["a", string_key("b")], [b"A", b"B"], traffic_class="agent")
    assert kv.get_batch(["b", "a", "nobody"]) == [b"B", b"A", None]
    assert kv.contains(["a", "b", "nobody"]) == [True, True, False]
    assert kv.match_prefix(["a", "b", "nobody", "a"]) == 2
    out = bytearray(5)
    assert kv.get_into("greeting", out) and out == b"hello"
    kv.delete(["a", "greeting"])
    assert kv.get_batch(["a", "greeting", "b"]) == [None, None, b"B"]
    with pytest.raises(InvalidArgument, match="a key is a str or 16 bytes"):
        kv.get(b"short")


def test_a_put_ttl_expires_the_block_and_is_capped(kv: SyncKVClient) -> None:
    kv.put("brief", b"gone in two minutes", ttl_s=2 * MINUTE_S)  # two real seconds
    brief_stored_s = time.monotonic()  # its TTL runs from no later than this
    kv.put("daily", b"a day from each read", ttl_s=DAY_S)
    kv.put("chatty", b"kept a week")
    kv.put("capped", b"agent: 3 days at most", "agent", ttl_s=30 * DAY_S)
    assert _own_ttl_s(kv, "daily") == pytest.approx(DAY_S, abs=1.0)
    assert _own_ttl_s(kv, "chatty") == pytest.approx(7 * DAY_S, abs=1.0)
    assert _own_ttl_s(kv, "capped") == pytest.approx(3 * DAY_S, abs=1.0), "beyond the class"
    assert kv.get("daily") == b"a day from each read"  # a hit: refreshed, with its own TTL
    assert _own_ttl_s(kv, "daily") == pytest.approx(DAY_S, abs=1.0), "a read lengthened it"
    # Untouched since its put (a get is an access and would start its TTL again): past its
    # two real seconds it reads as a miss, however late this runs.
    time.sleep(max(0.0, brief_stored_s + 3.0 - time.monotonic()))
    assert kv.get("brief") is None, "a block outlived its own TTL"
    assert kv.get("chatty") == b"kept a week" and kv.get("daily") is not None
    with pytest.raises(InvalidArgument, match="ttl_s"):
        kv.put("bad", b"x", ttl_s=0)


def test_buffers_and_cpu_tensors(kv: SyncKVClient) -> None:
    torch = pytest.importorskip("torch")
    source = torch.arange(64, dtype=torch.float32)
    kv.put("tensor", source)
    landed = torch.zeros(64, dtype=torch.float32)
    assert kv.get_into("tensor", landed) and torch.equal(landed, source)
    half = torch.arange(32, dtype=torch.bfloat16)  # a dtype numpy lacks
    kv.put("bf16", half)
    back = torch.empty(32, dtype=torch.bfloat16)
    assert kv.get_batch_into(["bf16"], [back]) == [True] and torch.equal(back, half)
    weights = torch.ones(16, requires_grad=True)  # exported detached, as the bytes it holds
    kv.put("grad", weights)
    assert kv.get("grad") == weights.detach().numpy().tobytes()
    array = np.zeros(64, dtype=np.float32)
    assert kv.get_into("tensor", array) and array.tobytes() == source.numpy().tobytes()
    assert kv.get_into("tensor", memoryview(bytearray(256)))
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        kv.get_into("tensor", torch.zeros(64, 2)[:, 0])
    with pytest.raises(InvalidArgument, match="read-only"):
        kv.get_into("tensor", bytes(256))
    with pytest.raises(InvalidArgument, match="host memory"):
        kv.put("gpu", _DeviceTensor())


class _DeviceTensor:
    """What a CUDA tensor shows the client: a DLPack export on device type 2 (kDLCUDA)."""

    def __dlpack__(self, stream: object = None) -> object:
        raise AssertionError("the client must refuse before exporting")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


def _kvstore(cluster: LocalCluster, token_file: Path, *args: str, **run: object):
    env = {**os.environ, "KVSTORE_CLUSTER": str(cluster.root)}
    command = [sys.executable, "-m", "kvstore.cli", *args, "--tenant", "acme"]
    command += ["--token-file", str(token_file)]
    return subprocess.run(command, capture_output=True, env=env, timeout=300, **run)


def test_key_commands_as_a_user_runs_them(
    cluster: LocalCluster, tokens: dict[str, str], kv: SyncKVClient, tmp_path: Path
) -> None:
    token_file = tmp_path / "acme.token"
    write_private(token_file, tokens["acme"] + "\n")
    put = _kvstore(cluster, token_file, "put", "motd", "--ttl", "5h", "hello from the cli")
    assert put.returncode == 0, put.stderr.decode()
    assert kv.get("motd") == b"hello from the cli", "the CLI and the client hash keys apart"
    got = _kvstore(cluster, token_file, "get", "motd")
    assert got.returncode == 0 and got.stdout == b"hello from the cli", got.stderr.decode()
    by_hex = _kvstore(cluster, token_file, "get", "--hex", string_key("motd").hex())
    assert by_hex.stdout == b"hello from the cli"
    ttl = _kvstore(cluster, token_file, "ttl", "motd", "--json", "-")
    document = json.loads(ttl.stdout)
    assert document["block_ttl_s"] == pytest.approx(5 * HOUR_S, abs=1.0), document
    assert 0 < document["ttl_s"] <= 5 * HOUR_S and "left" in ttl.stderr.decode()
    inspect = _kvstore(cluster, token_file, "inspect", "motd", "--json", str(tmp_path / "i.json"))
    assert inspect.returncode == 0, inspect.stderr.decode()
    record = json.loads((tmp_path / "i.json").read_text())
    assert record["reads_back"] and record["block_bytes"] == len(b"hello from the cli")
    assert [n["position"] for n in record["nodes"]] == list(range(12))
    shards = [s for n in record["nodes"] for s in n["shards"]]
    assert len(shards) == 12 and {s["checksum"] for s in shards} == {"ok"}
    assert sorted(s["shard_index"] for s in shards) == list(range(12))
    assert "reads back: yes" in inspect.stdout.decode()
    payload = tmp_path / "payload.bin"
    payload.write_bytes(bytes(range(256)) * 8)
    assert _kvstore(cluster, token_file, "put", "blob", "--file", str(payload)).returncode == 0
    out = tmp_path / "copy.bin"
    assert _kvstore(cluster, token_file, "get", "blob", "--out", str(out)).returncode == 0
    assert out.read_bytes() == payload.read_bytes()
    assert _kvstore(cluster, token_file, "del", "motd", "blob").returncode == 0
    miss = _kvstore(cluster, token_file, "get", "motd")
    assert miss.returncode == 1 and b"(miss)" in miss.stderr
    assert kv.get("blob") is None


def test_key_commands_keep_tenants_apart_and_let_an_admin_look(
    cluster: LocalCluster, tokens: dict[str, str], kv: SyncKVClient, tmp_path: Path
) -> None:
    kv.put("secret", b"acme only")
    globex = tmp_path / "globex.token"
    write_private(globex, tokens["globex"])
    as_acme = _kvstore(cluster, globex, "get", "secret")  # --tenant acme, globex's token
    assert as_acme.returncode == 1 and b"tenant" in as_acme.stderr, as_acme.stderr
    assert b"Traceback" not in as_acme.stderr
    admin = tmp_path / "admin.token"
    write_private(admin, cluster.admin_token or "")
    looked = _kvstore(cluster, admin, "inspect", "secret", "--json", "-")
    assert looked.returncode == 0, looked.stderr.decode()
    record = json.loads(looked.stdout)
    assert record["block"]["shards"] == 12 and record["read_back_refused"], record
