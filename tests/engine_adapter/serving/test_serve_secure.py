"""``kvstore serve`` on a cluster with auth and TLS on, as production runs it.

- The router's channels to its workers are TLS: a worker refuses plaintext, and over TLS it
  takes calls only from the serving certificate (another certificate of the cluster's CA,
  here the admin's or a node's, is refused), while the router serves requests through it.
- An API key mapped to a tenant the serving principal may not act for (not on its
  allow-list) is refused with 403 and the fix, instead of being served without the cache.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from deploy.local_cluster import LocalCluster  # noqa: E402
from engine_adapter.serving import serving_pb2 as pb  # noqa: E402
from engine_adapter.serving import serving_pb2_grpc as pb_grpc  # noqa: E402
from kvstore.auth import Role  # noqa: E402
from tests.engine_adapter.serving.conftest import (  # noqa: E402
    MODEL,
    STARTUP_TIMEOUT_S,
    start_serve,
    stop_serve,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900)]

KEYS = {"sk-acme": "acme", "sk-globex": "globex"}  # the serving principal may act for acme only


@pytest.fixture(scope="module")
def secure_serve(tmp_path_factory) -> Iterator[tuple[str, Path, LocalCluster]]:
    """A TLS + auth cluster and ``kvstore serve`` on it: (base URL, run dir, cluster)."""
    root = tmp_path_factory.mktemp("secure-serving")
    with LocalCluster.start(
        root / "cluster", fsync=False, auth=True, tls=True, startup_timeout_s=STARTUP_TIMEOUT_S
    ) as cluster:
        token = cluster.add_tenant("serving", Role.SERVICE, ["acme"])
        keys = root / "keys.toml"
        keys.write_text("[keys]\n" + "".join(f'"{k}" = "{t}"\n' for k, t in KEYS.items()))
        run_dir = root / "serve"
        proc, ports, pids = start_serve(
            cluster.cluster_toml, run_dir, "--api-keys", str(keys), "--model", MODEL,
            "--max-model-len", "512", env={**os.environ, "KVSTORE_TOKEN": token},
        )  # fmt: skip
        try:
            yield f"http://127.0.0.1:{ports['http']}", run_dir, cluster
        finally:
            stop_serve(proc, pids, 60)


def _complete(server: str, key: str) -> object:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=300)
    return client.completions.create(model=MODEL, prompt=list(range(1, 100)), max_tokens=2)


def test_a_tenant_the_serving_principal_may_not_act_for_is_refused(secure_serve):
    server, _, _ = secure_serve
    reply = _complete(server, "sk-acme")
    assert reply.usage.completion_tokens == 2
    with pytest.raises(openai.PermissionDeniedError) as refused:
        _complete(server, "sk-globex")
    error = refused.value.body
    assert refused.value.status_code == 403 and error["code"] == "tenant_not_allowed"
    assert "'globex'" in error["message"] and "allow-list" in error["message"]


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> pb.HealthReply:
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        return pb_grpc.PrefillWorkerStub(channel).Health(pb.HealthRequest(), timeout=30)


def test_worker_channels_are_tls_and_take_only_the_serving_certificate(secure_serve):
    server, run_dir, cluster = secure_serve
    address = json.loads((run_dir / "p0.ready.json").read_text())["address"]
    tls_dir = cluster.root / "tls"
    ca = (tls_dir / "ca.pem").read_bytes()

    def credentials(name: str, directory: Path) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            ca, (directory / f"{name}.key").read_bytes(), (directory / f"{name}.pem").read_bytes()
        )

    with pytest.raises(grpc.RpcError) as plaintext:
        _health(address, None)
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE, "a worker spoke plaintext"
    for other in ("admin", cluster.config.nodes[0].id):  # a client's and a node's certificate
        with pytest.raises(grpc.RpcError) as other_cert:
            _health(address, credentials(other, tls_dir))
        assert other_cert.value.code() == grpc.StatusCode.PERMISSION_DENIED, other
    reply = _health(address, credentials("serving", run_dir / "tls"))
    assert reply.worker_id == "p0" and reply.role == "prefill"
    assert _complete(server, "sk-acme").usage.completion_tokens == 2, "the router lost its way"
