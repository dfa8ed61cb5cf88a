"""SyncKVClient against a real 12-node local cluster with credentials: the blocking calls give
KVClient's results and raise KVClient's errors, from many threads at once, and close cleanly."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterator

import pytest

from client import SyncKVClient
from deploy.local_cluster import LocalCluster
from kvstore.errors import InvalidArgument, PermissionDenied, UnknownTrafficClass
from tests.client.secure_cluster import add_tenants

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("sync-cluster")
    with LocalCluster.start(root, num_nodes=12, fsync=False, auth=True) as c:
        yield c


@pytest.fixture(scope="module")
def acme_token(cluster: LocalCluster) -> str:
    return add_tenants(cluster, ["acme"])["acme"]


@pytest.fixture
def kv(cluster: LocalCluster, acme_token: str) -> Iterator[SyncKVClient]:
    with SyncKVClient.connect(cluster.cluster_toml, "acme", acme_token) as client:
        yield client


def _client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvstore-client"]


def test_blocking_calls_round_trip_bytes(kv: SyncKVClient) -> None:
    keys = [os.urandom(16) for _ in range(6)]
    blocks = [os.urandom(1000 + 4096 * i) for i in range(6)]
    kv.put_batch(keys[:5], blocks[:5], traffic_class="chat")
    kv.put(keys[5], blocks[5], "agent")
    missing = os.urandom(16)

    assert kv.get_batch([*keys, missing]) == [*blocks, None], "get_batch lost or changed bytes"
    buffers = [bytearray(len(b)) for b in blocks]
    assert kv.get_batch_into(keys, buffers) == [True] * 6
    assert [bytes(b) for b in buffers] == blocks, "get_batch_into landed wrong bytes"
    assert kv.get(keys[0]) == blocks[0] and kv.get(missing) is None
    out = bytearray(len(blocks[1]))
    assert kv.get_into(keys[1], out) and out == blocks[1]
    assert kv.contains([keys[0], missing, keys[2]]) == [True, False, True]
    assert kv.match_prefix([*keys[:3], missing, keys[4]]) == 3
    kv.delete(keys[:2])
    assert kv.get_batch(keys[:3]) == [None, None, blocks[2]], "delete did not reach the bytes"
    assert kv.counters()["num_hits"] >= 14, "counters() is not the KVClient's"


def test_many_threads_share_one_client(kv: SyncKVClient) -> None:
    """Engines call from their worker threads: 8 threads, each its own keys, all at once."""

    def worker(seed: int) -> bool:
        keys = [seed.to_bytes(2, "little") + os.urandom(14) for _ in range(8)]
        blocks = [os.urandom(20_000 + seed * 100 + i) for i in range(8)]
        kv.put_batch(keys, blocks, traffic_class="chat")
        buffers = [bytearray(len(b)) for b in blocks]
        landed = kv.get_batch_into(keys, buffers)
        return all(landed) and [bytes(b) for b in buffers] == blocks

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(worker, range(8)))
    assert results == [True] * 8, "concurrent calls from several threads mixed up bytes"


def test_errors_are_the_async_clients(
    kv: SyncKVClient, cluster: LocalCluster, acme_token: str
) -> None:
    with pytest.raises(InvalidArgument, match="16"):
        kv.get(b"short")
    with pytest.raises(UnknownTrafficClass):
        kv.put(os.urandom(16), b"x", "nonsense")
    with pytest.raises(InvalidArgument, match="read-only"):
        kv.get_batch_into([os.urandom(16)], [b"read-only"])
    # A tenant token used for another tenant: the nodes refuse, as they do for KVClient.
    with (
        SyncKVClient.connect(cluster.cluster_toml, "globex", acme_token) as other,
        pytest.raises(PermissionDenied),
    ):
        other.put(os.urandom(16), b"x")


def test_submit_returns_a_future(kv: SyncKVClient) -> None:
    key, block = os.urandom(16), os.urandom(5000)
    future = kv.submit("put_batch", [key], [block], traffic_class="chat")
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(60) is None
    assert kv.submit("get_batch", [key]).result(60) == [block]
    with pytest.raises(InvalidArgument, match="not a KVClient data call"):
        kv.submit("close")
    failing = kv.submit("get", b"short")
    with pytest.raises(InvalidArgument):
        failing.result(60)


def test_calling_from_its_own_loop_thread_is_refused(kv: SyncKVClient) -> None:
    """A call on the loop thread would wait on itself forever: it raises instead."""
    outcome: concurrent.futures.Future[BaseException | None] = concurrent.futures.Future()

    def on_loop() -> None:
        try:
            kv.get(os.urandom(16))
            outcome.set_result(None)
        except BaseException as exc:
            outcome.set_result(exc)

    kv.loop.call_soon_threadsafe(on_loop)
    error = outcome.result(30)
    assert isinstance(error, InvalidArgument) and "own loop thread" in str(error)


def test_close_stops_the_thread_and_refuses_later_calls(
    cluster: LocalCluster, acme_token: str
) -> None:
    before = len(_client_threads())
    kv = SyncKVClient.connect(cluster.cluster_toml, "acme", acme_token)
    assert len(_client_threads()) == before + 1
    key = os.urandom(16)
    kv.put(key, b"kept")
    kv.close()
    kv.close()  # idempotent
    assert len(_client_threads()) == before, "close() left the loop thread running"
    with pytest.raises(InvalidArgument, match="closed"):
        kv.get(key)
    with SyncKVClient.connect(cluster.cluster_toml, "acme", acme_token) as again:
        assert again.get(key) == b"kept", "close() lost a write that had returned"


def test_failed_connect_raises_and_stops_its_thread(
    cluster: LocalCluster, tmp_path: os.PathLike[str]
) -> None:
    before = len(_client_threads())
    with pytest.raises(ValueError, match="no cluster config"):
        SyncKVClient.connect(os.path.join(tmp_path, "missing.toml"), "acme")
    with pytest.raises(InvalidArgument, match="tenant"):
        SyncKVClient.connect(cluster.cluster_toml, "")
    assert len(_client_threads()) == before, "a failed connect left its loop thread running"


def test_two_clients_in_one_process(cluster: LocalCluster, acme_token: str) -> None:
    """Each SyncKVClient has its own loop; two of them (two engines' adapters) coexist."""
    with (
        SyncKVClient.connect(cluster.cluster_toml, "acme", acme_token) as a,
        SyncKVClient.connect(cluster.cluster_toml, "acme", acme_token) as b,
    ):
        a.wait_until_accepted()  # KVClient's, blocking: returns at once for a known token
        key, block = os.urandom(16), os.urandom(70_000)
        a.put(key, block)
        assert b.get(key) == block
