"""The kvstore remote backend inside real LMCache (0.5.6, CPU) against a real 12-node cluster.

LMCache's own ``LMCacheEngine`` stores and retrieves KV of CPU paged tensors through a
``GPUConnectorInterface`` subclass (LMCache's only device-specific part; its CUDA kernels are
not needed for the CPU copies below). Our backend is loaded the way a user's config loads
it: ``remote_storage_plugins`` + ``extra_config``, or the legacy ``remote_url``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "lmcache", reason="needs LMCache: `make test-integrations` runs it in .venv-vllm"
)

from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn  # noqa: E402
from lmcache.v1.cache_engine import LMCacheEngineBuilder  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402

from deploy.local_cluster import LocalCluster  # noqa: E402
from engine_adapter.integrations.lmcache_backend import KVStoreRemoteConnector, _InertConnector  # noqa: E402

pytestmark = [pytest.mark.integrations, pytest.mark.timeout(600)]

LAYERS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, CHUNK = 2, 2, 16, 16, 32, 16
_names = itertools.count()


class CPUPagedConnector(GPUConnectorInterface):
    """LMCache <-> vLLM-style paged KV on the CPU: ``kvcaches`` is one [2, B, N, H, D]
    tensor per layer; a chunk (MemoryObj, format KV_2LTD) is [2, L, T, H * D]."""

    def _flat(self, kvcaches: list[torch.Tensor], layer: int) -> torch.Tensor:
        return kvcaches[layer].view(2, -1, HEADS * HEAD_DIM)  # [2, B * N, H * D]

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        for layer in range(LAYERS):
            memory_obj.tensor[:, layer, : end - start].copy_(
                self._flat(kwargs["kvcaches"], layer)[:, slots]
            )

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = kwargs["slot_mapping"][start:end]
        for layer in range(LAYERS):
            self._flat(kwargs["kvcaches"], layer)[:, slots] = memory_obj.tensor[
                :, layer, : end - start
            ]

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(
        self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any
    ) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * HEAD_DIM])


def _plugin_config(
    cluster: LocalCluster, legacy_url: bool = False, **settings: Any
) -> dict[str, Any]:
    url = f"kvstore://{cluster.cluster_toml}"
    extra = {
        "remote_storage_plugin.kvstore.module_path": "engine_adapter.integrations.lmcache_backend",
        "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter",
        **({} if legacy_url else {"remote_storage_plugin.kvstore.url": url}),
        **{f"remote_storage_plugin.kvstore.{k}": v for k, v in settings.items()},
    }
    return {
        "remote_url": url if legacy_url else None,
        "remote_storage_plugins": ["kvstore"],
        "extra_config": extra,
    }


@pytest.fixture
def engines(cluster: LocalCluster, token_files: dict[str, str]) -> Iterator[Any]:
    names: list[str] = []

    def make(legacy_url: bool = False, tenant: str = "acme", **settings: Any) -> Any:
        """An LMCache engine whose kvstore plugin acts for ``tenant`` (its own token file,
        unless ``settings`` say otherwise)."""
        settings = {"tenant": tenant, "token_file": token_files[tenant], **settings}
        name = f"engine-{next(_names)}"
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK,
            local_cpu=True,
            max_local_cpu_size=0.05,
            remote_serde="naive",
            lmcache_instance_id=name,
            **_plugin_config(cluster, legacy_url, **settings),
        )
        metadata = LMCacheMetadata(
            model_name="tiny-llama",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
            chunk_size=CHUNK,
        )
        engine = LMCacheEngineBuilder.get_or_create(
            name,
            config,
            metadata,
            CPUPagedConnector(),
            mock_up_broadcast_fn,
            mock_up_broadcast_object_fn,
        )
        engine.post_init()
        names.append(name)
        return engine

    yield make
    for name in names:
        LMCacheEngineBuilder.destroy(name)


def _paged(seed: int | None) -> list[torch.Tensor]:
    """One [2, B, N, H, D] bf16 tensor per layer: seeded random, or zeros."""
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)]


def _tokens(first: int) -> torch.Tensor:
    return torch.arange(first, first + 3 * CHUNK, dtype=torch.long)  # 3 chunks


def _slots(seed: int, num_tokens: int) -> torch.Tensor:
    return torch.randperm(NUM_BLOCKS * BLOCK, generator=torch.Generator().manual_seed(seed))[
        :num_tokens
    ]


def _remote(engine: Any) -> list[Any]:
    """The engine's remote backends' connectors (InstrumentedRemoteConnector unwrapped)."""
    backends = engine.storage_manager.storage_backends
    found = [b.connection for n, b in backends.items() if n.startswith("RemoteBackend")]
    return [getattr(c, "_connector", c) for c in found]


def _wait_until_found(engine: Any, tokens: torch.Tensor) -> int:
    """LMCache puts chunks in the background: poll until all are found (or 120 s passed: a
    loaded 2-core machine)."""
    deadline = time.monotonic() + 120
    while (found := engine.lookup(tokens)) < len(tokens) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _kv_of(kvcaches: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [kv.view(2, -1, HEADS * HEAD_DIM)[:, slots].view(torch.int16) for kv in kvcaches]


@pytest.mark.parametrize("legacy_url", [False, True], ids=["plugin", "remote_url"])
def test_chunks_stored_by_one_engine_are_retrieved_by_another(
    engines: Any, legacy_url: bool
) -> None:
    tokens = _tokens(1000 if legacy_url else 2000)
    a = engines(legacy_url)
    kv_a, slots_a = _paged(seed=1), _slots(1, len(tokens))
    a.store(tokens, kvcaches=kv_a, slot_mapping=slots_a)
    b = engines(legacy_url)  # another LMCache instance: empty CPU cache, the same cluster
    assert _wait_until_found(b, tokens) == len(tokens), "the other engine did not find the chunks"
    kv_b, slots_b = _paged(seed=None), _slots(2, len(tokens))
    retrieved = b.retrieve(tokens, kvcaches=kv_b, slot_mapping=slots_b)
    assert int(retrieved.sum()) == len(tokens)
    for layer, (want, got) in enumerate(
        zip(_kv_of(kv_a, slots_a), _kv_of(kv_b, slots_b), strict=True)
    ):
        assert torch.equal(want, got), f"layer {layer}: retrieved KV differs from the stored KV"
    connectors = _remote(b)
    real = [c for c in connectors if isinstance(c, KVStoreRemoteConnector)]
    assert len(real) == 1, f"expected one kvstore connector, got {connectors}"
    if legacy_url:  # LMCache's duplicate plugin backend is inert: nothing is written twice
        assert any(isinstance(c, _InertConnector) for c in connectors)
        writer = next(c for c in _remote(a) if isinstance(c, KVStoreRemoteConnector))
        assert writer.kv.counters()["num_puts"] == 3, "each chunk must be stored once"


def test_another_tenant_or_model_never_hits(engines: Any) -> None:
    tokens = _tokens(3000)
    a = engines()
    a.store(tokens, kvcaches=_paged(seed=3), slot_mapping=_slots(3, len(tokens)))
    assert _wait_until_found(engines(), tokens) == len(tokens)
    assert engines(tenant="globex").lookup(tokens) == 0, "another tenant hit acme's chunks"
    assert engines(model_id="other-model").lookup(tokens) == 0, "another model hit the chunks"


def test_store_outage_is_a_miss(engines: Any, cluster: LocalCluster) -> None:
    """Three nodes down: lookups find nothing, retrieve loads nothing, nothing raises; the
    engine computes the KV instead."""
    tokens = _tokens(4000)
    a = engines()
    a.store(tokens, kvcaches=_paged(seed=4), slot_mapping=_slots(4, len(tokens)))
    assert _wait_until_found(engines(), tokens) == len(tokens)
    victims = cluster.config.groups[0][:3]
    for node_id in victims:
        cluster.kill_node(node_id)
    try:
        c = engines()
        assert c.lookup(tokens) == 0
        kv_c = _paged(seed=None)
        retrieved = c.retrieve(tokens, kvcaches=kv_c, slot_mapping=_slots(5, len(tokens)))
        assert int(retrieved.sum()) == 0
        assert all(not kv.any() for kv in kv_c), "a failed retrieve wrote into the KV cache"
    finally:
        for node_id in victims:
            cluster.restart_node(node_id)


def test_config_errors_name_the_fix(
    engines: Any, token_files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache logs a remote backend it cannot create and runs without it: the log says why."""
    engine = engines(token="secret")
    assert not any(isinstance(c, KVStoreRemoteConnector) for c in _remote(engine))
    assert "token_file" in caplog.text, "the log does not say how to pass a token"
    caplog.clear()
    impostor = engines(token_file=token_files["globex"])  # globex's token, claiming acme
    assert not any(isinstance(c, KVStoreRemoteConnector) for c in _remote(impostor))
    assert "refused the credential for tenant 'acme'" in caplog.text, (
        "a refused credential was not reported at start-up"
    )
    caplog.clear()
    quantised = engines(kv_format="e4m3x16")  # chunks are LMCache's bytes: never re-encoded
    assert not any(isinstance(c, KVStoreRemoteConnector) for c in _remote(quantised))
    assert "remote_serde" in caplog.text, "an unsupported kv_format was not reported"


def test_backend_traffic_and_ping_reach_lmcache_stats(
    engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMCache's own stats monitor (what its Prometheus logger exports) counts this backend's
    writes and reads, requests and bytes; its health check's ping gets 0 from the cluster."""
    from lmcache.observability import LMCStatsMonitor

    monitor = LMCStatsMonitor.GetOrCreate()
    monitor.get_stats_and_clear()  # this test's interval only
    # Every engine's stats logger thread takes (and clears) the monitor's interval as it
    # starts and every 10 s after: keep each interval taken, so none of ours is lost to them
    # (CI: engine b's logger cleared a's writes before the test read them).
    intervals = []
    take_and_clear = monitor.get_stats_and_clear

    def take_and_keep() -> Any:
        stats = take_and_clear()
        intervals.append(stats)
        return stats

    monkeypatch.setattr(monitor, "get_stats_and_clear", take_and_keep)
    tokens = _tokens(5000)
    a = engines()
    a.store(tokens, kvcaches=_paged(seed=6), slot_mapping=_slots(6, len(tokens)))
    b = engines()
    assert _wait_until_found(b, tokens) == len(tokens)
    retrieved = b.retrieve(tokens, kvcaches=_paged(seed=None), slot_mapping=_slots(7, len(tokens)))
    assert int(retrieved.sum()) == len(tokens)
    monitor.get_stats_and_clear()

    def total(field: str) -> Any:
        return sum(getattr(stats, field) for stats in intervals)

    chunk_bytes = 2 * LAYERS * CHUNK * HEADS * HEAD_DIM * 2  # K and V, bf16
    assert total("interval_remote_write_bytes") == 3 * chunk_bytes, "writes missing from stats"
    assert total("interval_remote_read_bytes") >= 3 * chunk_bytes, "reads missing from stats"
    assert total("interval_remote_read_requests") >= 1
    assert any(stats.interval_remote_time_to_put for stats in intervals)
    connector = next(c for c in _remote(b) if isinstance(c, KVStoreRemoteConnector))
    assert connector.support_ping()
    assert asyncio.run(connector.ping()) == 0, "a healthy cluster must ping 0"
