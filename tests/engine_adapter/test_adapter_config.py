"""What the engine adapters read from an engine's config, and their key namespaces (pure); how
``AdapterConfig.connect`` treats credentials, on a real 12-node cluster with auth."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from deploy.local_cluster import LocalCluster
from engine_adapter.engine_keys import EngineKeyNamespace
from engine_adapter.integrations.adapter_config import AdapterConfig
from kvstore.auth import write_private
from kvstore.errors import PermissionDenied
from tests.client.secure_cluster import add_tenants

WHERE = "the test's config"


def test_keys_map_to_fields_with_defaults() -> None:
    config = AdapterConfig.from_mapping(
        {"cluster": "/c/cluster.toml", "tenant": "acme", "token_file": "/t"}, where=WHERE
    )
    assert (config.cluster_toml, config.tenant, config.token_file) == (
        "/c/cluster.toml",
        "acme",
        "/t",
    )
    assert (config.traffic_class, config.transport, config.model_id) == ("chat", "auto", None)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({}, "needs 'cluster'"),
        ({"cluster": "/c", "token": "secret"}, "token_file"),
        ({"cluster": "/c", "tenat": "acme"}, "unknown keys"),
        ({"cluster": "/c", "tenant": ""}, "'tenant' must be a non-empty string"),
        ({"cluster": "/c", "transport": "rdma"}, "transport 'rdma'"),
    ],
)
def test_misconfiguration_names_the_fix(mapping: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdapterConfig.from_mapping(mapping, where=WHERE)


def test_a_shared_mapping_warns_about_unknown_keys(caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's extra config holds its own keys too: ours are read, the rest only warned."""
    mapping = {"cluster": "/c", "backend_name": "kvstore", "tenat": "acme"}
    with caplog.at_level(logging.WARNING):
        config = AdapterConfig.from_mapping(
            mapping, where=WHERE, known_elsewhere=("backend_name",), strict=False
        )
    assert (
        config.tenant == "default" and "tenat" in caplog.text and "backend_name" not in caplog.text
    )


NAMESPACE = EngineKeyNamespace(
    engine="vllm", model="m", dtype="bfloat16", layout="vllm-BHNC-v1:2x2x16x32", page_tokens=16
)


def test_namespace_text_names_every_field() -> None:
    ns = dataclasses.replace(NAMESPACE, tp_rank=1, tp_size=2, extra=(("mla", "0"),))
    assert ns.text == (
        "kvstore-vllm;model=m;dtype=bfloat16;layout=vllm-BHNC-v1:2x2x16x32;page_tokens=16;"
        "tp=1/2;pp=0/1;mla=0"
    )


@pytest.mark.parametrize(
    "change",
    [
        {"engine": "sglang"},
        {"model": "m2"},
        {"dtype": "float16"},
        {"layout": "vllm-BHNC-v1:2x2x16x64"},
        {"page_tokens": 32},
        {"tp_rank": 1, "tp_size": 2},
        {"pp_rank": 1, "pp_size": 2},
        {"extra": (("cache_dtype", "fp8"),)},
    ],
)
def test_every_namespace_field_changes_the_keys(change: dict[str, object]) -> None:
    engine_keys = [b"\x01" * 32, b"\x02" * 32]
    other = dataclasses.replace(NAMESPACE, **change)  # type: ignore[arg-type]
    assert not set(other.keys(engine_keys, "acme")) & set(NAMESPACE.keys(engine_keys, "acme")), (
        f"{change} left the store keys unchanged: pages of another format would hit"
    )


@pytest.mark.parametrize(
    "bad",
    [{"model": ""}, {"dtype": "a;b"}, {"page_tokens": 0}, {"tp_rank": 2, "tp_size": 2}],
)
def test_namespace_rejects_bad_fields(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(NAMESPACE, **bad)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_connect_checks_the_credential_at_once(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused credential stops the adapter at connect, with the fix; a cluster that does
    not answer does not (the engine starts and misses until it does)."""
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    root = tmp_path_factory.mktemp("adapter-auth")
    with LocalCluster.start(root, fsync=False, auth=True) as cluster:
        token_files = {}
        for tenant, token in add_tenants(cluster, ["acme", "globex"]).items():
            token_files[tenant] = root / f"{tenant}.token"
            write_private(token_files[tenant], token)
        acme = AdapterConfig(
            str(cluster.cluster_toml), "acme", token_file=str(token_files["acme"]), where=WHERE
        )
        with acme.connect() as kv:
            assert kv.tenant == "acme"
        impostor = dataclasses.replace(acme, token_file=str(token_files["globex"]))
        with pytest.raises(PermissionDenied, match=r"refused the credential.*'token_file'"):
            impostor.connect()
        with pytest.raises(PermissionDenied, match="KVSTORE_TOKEN"):
            dataclasses.replace(acme, token_file=None).connect()
    with acme.connect() as kv:  # every node stopped: connects, looks up nothing
        assert kv.contains([bytes(16)]) == [False]


def test_kv_format_stores_fp8_caches_as_they_are_and_refuses_what_is_not_wired():
    config = AdapterConfig.from_mapping(
        {"cluster": "/c/cluster.toml", "kv_format": "e4m3x16"}, where="test"
    )
    assert config.stored_kv_format("float8_e4m3fn") == "float8_e4m3fn", "fp8 bytes go as is"
    assert AdapterConfig(cluster_toml="/c").stored_kv_format("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="fp8_e4m3"):
        config.stored_kv_format("bfloat16")
    # an adapter whose copy path quantises (the vLLM connector's) stores the codec's format
    assert config.stored_kv_format("bfloat16", quantizes=True) == "e4m3x16:bf16-scales"
    assert config.stored_kv_format("float8_e4m3fn", quantizes=True) == "float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_format"):
        AdapterConfig(cluster_toml="/c", kv_format="nvfp4")
