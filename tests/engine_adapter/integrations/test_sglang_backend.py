"""KVStoreHiCache inside real SGLang (0.5.23, CPU) against a real 12-node cluster.

The backend is made the way SGLang's HiCacheController makes it: ``StorageBackendFactory
.create_backend("dynamic", storage_config, host_pool)`` with the launch flag's extra config,
then ``register_mem_pool_host``. Pages move between SGLang's real CPU host pool
(``MHATokenToKVPoolHost`` over an ``MHATokenToKVPool``) and the cluster. SGLang 0.5.23 pins
torch 2.14.1, so these tests run in their own venv (``make test-integrations``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "sglang", reason="needs SGLang: `make test-integrations` runs these in .venv-sglang"
)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetricsCollector  # noqa: E402

from deploy.local_cluster import LocalCluster  # noqa: E402
from engine_adapter.integrations.sglang_backend import KVStoreHiCache  # noqa: E402
from kvstore.errors import PermissionDenied  # noqa: E402

pytestmark = [pytest.mark.integrations, pytest.mark.timeout(600)]

PAGE, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 16
KV_LORA_RANK, ROPE_DIM = 32, 16  # MLA: one latent of 48 values per token and layer


def _host_pool(layout: str = "page_first", dtype: Any = None, page: int = PAGE) -> Any:
    """SGLang's CPU host pool in ``layout``, as its HiCache builds it for a device pool."""
    device = MHATokenToKVPool(
        size=256,
        page_size=page,
        dtype=dtype or torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    capacity = device.size if device.host_capacity_tokens is None else device.host_capacity_tokens
    with host_memory_budget_scope(1 << 30):  # else it books against free RAM minus 10 GiB
        return MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            host_to_device_ratio=2.0,
            host_size=0,
            page_size=page,
            layout=layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=capacity,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            write_back_staging=device.hicache_write_back_staging,
        )


def _mla_host_pool(layout: str = "page_first") -> Any:
    """SGLang's CPU host pool of an MLA model (DeepSeek's latent cache), as HiCache builds it."""
    device = MLATokenToKVPool(
        size=256,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    with host_memory_budget_scope(1 << 30):
        return MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            host_to_device_ratio=2.0,
            host_size=0,
            page_size=PAGE,
            layout=layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            target_layer_num=LAYERS,
        )


def _backend(store: dict[str, str], host: Any, /, *, tp_rank: int = 0, tp_size: int = 1,
             model: str = "tiny-llama", mla: bool = False, metrics: bool = False,
             **extra: Any) -> KVStoreHiCache:  # fmt: skip
    """What HiCacheController.attach_storage_backend does with the launch flag's config."""
    extra_config = {
        "backend_name": "kvstore",
        "module_path": "engine_adapter.integrations.sglang_backend",
        "class_name": "KVStoreHiCache",
        "interface_v1": 1,
        **store,
        **extra,
    }
    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=host.layout.startswith("page_first"),
        model_name=model,
        extra_config=extra_config,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    return backend


@pytest.fixture
def backends(store_config: Callable[..., dict[str, str]]) -> Iterator[Any]:
    made: list[KVStoreHiCache] = []

    def make(host: Any, tenant: str = "acme", **kwargs: Any) -> KVStoreHiCache:
        made.append(_backend(store_config(tenant), host, **kwargs))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def _fill_pages(host: Any, num_pages: int, seed: int) -> torch.Tensor:
    """Allocate ``num_pages`` pages of host slots and write seeded KV into them."""
    generator = torch.Generator().manual_seed(seed)
    indices = host.alloc(num_pages * host.page_size)
    for i in range(num_pages):
        start = int(indices[i * host.page_size])
        page = host.get_data_page(start, flat=True)
        values = torch.randn(page.shape, generator=generator).to(page.dtype)
        host.set_from_flat_data_page(start, values)
    return indices


def _pages(host: Any, indices: torch.Tensor) -> list[torch.Tensor]:
    starts = indices[:: host.page_size].tolist()
    return [host.get_data_page(s, flat=True).clone().view(torch.uint8) for s in starts]


def _keys(name: str, n: int) -> list[str]:
    """SGLang-style page keys: 64 hex digits each."""
    return [f"{name}-{i}".encode().hex().ljust(64, "0")[:64] for i in range(n)]


@pytest.mark.parametrize(
    ("layout", "zero_copy"),
    [("page_first", True), ("page_first_direct", True), ("layer_first", False)],
)
def test_pages_round_trip_between_two_host_pools(
    backends: Any, layout: str, zero_copy: bool
) -> None:
    """Server A backs pages up (batch_set_v1); server B, another pool, prefetches them."""
    host_a, host_b = _host_pool(layout), _host_pool(layout)
    a, b = backends(host_a), backends(host_b)
    assert a.parts == (("0", "1") if zero_copy else ("flat",)), "wrong page format for layout"
    keys = _keys(layout, 3)
    written = _fill_pages(host_a, 3, seed=1)
    assert a.batch_set_v1(keys, written) == [True] * 3
    assert b.batch_exists([*keys, "f" * 64]) == 3, "batch_exists must count leading hits"
    assert b.batch_exists(["f" * 64, *keys]) == 0
    target = host_b.alloc(3 * PAGE)
    assert b.batch_get_v1(keys, target) == [True] * 3
    for i, (want, got) in enumerate(
        zip(_pages(host_a, written), _pages(host_b, target), strict=True)
    ):
        assert torch.equal(want, got), f"page {i} came back with other bytes ({layout})"
    assert b.batch_get_v1(["e" * 64], host_b.alloc(PAGE)) == [False], "a miss must be False"


@pytest.mark.parametrize(
    ("layout", "interface_v1"), [("page_first", 1), ("layer_first", 1), ("page_first", 0)]
)
def test_e4m3x16_pages_load_as_the_codec_decodes_them(
    backends: Any, layout: str, interface_v1: int
) -> None:
    """``kv_format: e4m3x16`` on a bf16 host pool: every run (or flat page) is stored as
    per-16 FP8, 1.125 bytes a value, and read back as the codec decodes it, in a namespace a
    bf16 backend never hits."""
    from engine_adapter import kv_format

    host_a, host_b = _host_pool(layout), _host_pool(layout)
    options = {"kv_format": "e4m3x16", "interface_v1": interface_v1}
    a, b = backends(host_a, **options), backends(host_b, **options)
    keys = _keys(f"e4m3-{layout}-{interface_v1}", 3)
    written = _fill_pages(host_a, 3, seed=7)
    if interface_v1:
        assert a.batch_set_v1(keys, written) == [True] * 3
    else:
        starts = written[::PAGE].tolist()
        assert a.batch_set(keys, [host_a.get_data_page(s, flat=True) for s in starts])
    assert backends(_host_pool(layout), interface_v1=interface_v1).batch_exists(keys) == 0, (
        "a bf16 backend saw e4m3x16 pages"
    )
    target = host_b.alloc(3 * PAGE)
    if interface_v1:
        assert b.batch_get_v1(keys, target) == [True] * 3
        got_pages = _pages(host_b, target)
    else:
        got = b.batch_get(keys, [host_b.get_dummy_flat_data_page() for _ in keys])
        got_pages = [page.view(torch.uint8) for page in got]
    for i, (want, got_page) in enumerate(zip(_pages(host_a, written), got_pages, strict=True)):
        values = want.view(torch.bfloat16).view(-1, 16)
        decoded = kv_format.dequantize(*kv_format.quantize(values), torch.empty_like(values))
        assert torch.equal(got_page.view(torch.bfloat16).view(-1, 16), decoded), f"page {i}"
        assert not torch.equal(got_page, want), "the page was not quantised"


def test_an_e4m3x16_page_holding_inf_is_a_miss_never_kv(backends: Any) -> None:
    """KV holding inf quantises to a NaN scale (the codec's mark): the page reads as a miss
    and the pool's page keeps what it held."""
    host_a, host_b = _host_pool(), _host_pool()
    a, b = backends(host_a, kv_format="e4m3x16"), backends(host_b, kv_format="e4m3x16")
    keys = _keys("e4m3-inf", 1)
    written = host_a.alloc(PAGE)
    start = int(written[0])
    page = host_a.get_data_page(start, flat=True)
    host_a.set_from_flat_data_page(start, torch.full(page.shape, float("inf"), dtype=page.dtype))
    assert a.batch_set_v1(keys, written) == [True]
    assert b.batch_exists(keys) == 1, "the page was not stored"
    target = host_b.alloc(PAGE)
    before = _pages(host_b, target)[0]
    assert b.batch_get_v1(keys, target) == [False], "a NaN-scale page was reported loaded"
    after = _pages(host_b, target)[0].view(torch.bfloat16)
    assert torch.isfinite(after).all(), "inf or NaN reached the pool"
    assert torch.equal(after.view(torch.uint8), before), "a page that is a miss was changed"


def test_zero_copy_reads_land_in_the_pool_pages(backends: Any) -> None:
    """With interface_v1 the store writes the host pool's own memory: no staging copy."""
    host = _host_pool()
    backend = backends(host)
    keys = _keys("zero-copy", 2)
    backend.batch_set_v1(keys, _fill_pages(host, 2, seed=2))
    target = host.alloc(2 * PAGE)
    views = backend._run_views(target, 2)
    pointers, _ = host.get_page_buffer_meta(target)
    addresses = [torch.frombuffer(v, dtype=torch.uint8).data_ptr() for v in views]
    assert addresses == pointers, "the read buffers are not the pool's pages"


def test_legacy_calls_round_trip_flat_pages(backends: Any) -> None:
    """Without interface_v1 SGLang calls batch_set(keys, flat pages) and batch_get(keys,
    dummy flat pages), then copies them into its pool."""
    host_a, host_b = _host_pool(), _host_pool()
    a, b = backends(host_a, interface_v1=0), backends(host_b, interface_v1=0)
    keys = _keys("legacy", 3)
    written = _fill_pages(host_a, 3, seed=3)
    values = [host_a.get_data_page(s, flat=True) for s in written[::PAGE].tolist()]
    assert a.batch_set(keys, values) is True
    assert a.set(_keys("legacy-one", 1)[0], values[0]) is True
    assert b.exists(keys[0]) and not b.exists("d" * 64)
    got = b.batch_get(keys, [host_b.get_dummy_flat_data_page() for _ in keys])
    for want, page in zip(values, got, strict=True):
        assert page is not None and torch.equal(want.view(torch.uint8), page.view(torch.uint8))
    assert b.get("d" * 64, host_b.get_dummy_flat_data_page()) is None


@pytest.mark.parametrize(
    ("what", "host_kwargs", "backend_kwargs"),
    [
        ("another KV dtype", {"dtype": "float16"}, {}),
        ("another page size", {"page": 32}, {}),
        ("another layout", {"layout": "layer_first"}, {}),
        ("another TP rank", {}, {"tp_rank": 1, "tp_size": 2}),
        ("another model", {}, {"model": "other-model"}),
        ("another tenant", {}, {"tenant": "globex"}),
    ],
)
def test_pages_of_another_format_or_tenant_never_hit(
    backends: Any, what: str, host_kwargs: dict[str, Any], backend_kwargs: dict[str, Any]
) -> None:
    """sglang #33268: keys that omit the format reuse wrong-format bytes. Ours never do."""
    host = _host_pool()
    keys = _keys(f"format-{what}", 2)
    assert backends(host).batch_set_v1(keys, _fill_pages(host, 2, seed=4)) == [True, True]
    if "dtype" in host_kwargs:
        host_kwargs = {**host_kwargs, "dtype": getattr(torch, host_kwargs["dtype"])}
    other = backends(_host_pool(**host_kwargs), **backend_kwargs)
    assert other.batch_exists(keys) == 0, f"{what} saw pages it cannot read"


def test_store_outage_is_a_miss_not_an_error(backends: Any, cluster: LocalCluster) -> None:
    host = _host_pool()
    backend = backends(host)
    keys = _keys("outage", 2)
    written = _fill_pages(host, 2, seed=5)
    assert backend.batch_set_v1(keys, written) == [True, True]
    victims = cluster.config.groups[0][:3]  # more than the 2 parities
    for node_id in victims:
        cluster.kill_node(node_id)
    try:
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, host.alloc(2 * PAGE)) == [False, False]
        assert backend.batch_set_v1(_keys("outage-new", 2), written) == [False, False], (
            "a write below the quorum must report the pages as not stored"
        )
    finally:
        for node_id in victims:
            cluster.restart_node(node_id)
    # The same backend finds the pages again once its channels to the restarted nodes have
    # reconnected (gRPC retries a dead peer with backoff): wait for that, generously.
    deadline = time.monotonic() + 120
    while backend.batch_exists(keys) != 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert backend.batch_exists(keys) == 2, "the pages stored before the outage were lost"


def test_config_errors_name_the_fix(
    cluster: LocalCluster,
    store_config: Callable[..., dict[str, str]],
    token_files: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    host = _host_pool()
    acme = store_config()
    with pytest.raises(ValueError, match="needs 'cluster'"):
        _backend(acme, host, cluster="")
    with pytest.raises(ValueError, match="token_file"):
        _backend(acme, host, token="secret")
    with pytest.raises(ValueError, match="bulk"):
        _backend(acme, host, traffic_class="bulk")
    with pytest.raises(ValueError, match="no token file"):
        _backend(acme, host, token_file=os.path.join(cluster.root, "missing.token"))
    # A credential the nodes refuse stops the server at start-up, with the fix.
    with pytest.raises(PermissionDenied, match="'token_file'"):
        _backend(acme, host, token_file=token_files["globex"])
    no_token = {"cluster": acme["cluster"], "tenant": "acme"}
    with pytest.raises(PermissionDenied, match="KVSTORE_TOKEN"):
        _backend(no_token, host)


def test_mla_latent_pages_rank0_writes_every_rank_reads(backends: Any) -> None:
    """An MLA pool's page is one latent run (no head split): TP rank 0 stores it, rank 1 of
    the same TP-2 server stores nothing and reads rank 0's bytes, as does a TP-1 server."""
    host_0, host_1, host_single = _mla_host_pool(), _mla_host_pool(), _mla_host_pool()
    rank_0 = backends(host_0, mla=True, tp_rank=0, tp_size=2)
    rank_1 = backends(host_1, mla=True, tp_rank=1, tp_size=2)
    assert rank_0.parts == ("0",), "an MLA page is one run: one store block"
    assert "kv_lora_rank=32" in rank_0.namespace.text and "mla=1" in rank_0.namespace.text
    keys = _keys("mla", 3)
    assert rank_1.batch_set_v1(keys, _fill_pages(host_1, 3, seed=8)) == [True] * 3
    assert rank_0.batch_exists(keys) == 0, "a non-writer rank stored the replicated latent"
    written = _fill_pages(host_0, 3, seed=9)
    assert rank_0.batch_set_v1(keys, written) == [True] * 3
    for backend, host in ((rank_1, host_1), (backends(host_single, mla=True), host_single)):
        target = host.alloc(3 * PAGE)
        assert backend.batch_get_v1(keys, target) == [True] * 3
        for want, got in zip(_pages(host_0, written), _pages(host, target), strict=True):
            assert torch.equal(want, got), "a rank read other bytes than rank 0's latent"
    assert backends(_host_pool()).batch_exists(keys) == 0, "an MHA pool saw MLA latents"


def test_tp_ranks_store_their_own_head_slices(backends: Any) -> None:
    """Two TP ranks of an MHA model each store their own heads; neither they nor a TP-1
    server of the model read another slice as their own."""
    hosts = [_host_pool() for _ in range(3)]
    ranks = [backends(hosts[r], tp_rank=r, tp_size=2) for r in (0, 1)]
    single = backends(hosts[2])
    keys = _keys("tp-slices", 2)
    written = [_fill_pages(hosts[r], 2, seed=10 + r) for r in (0, 1)]
    for rank, backend in enumerate(ranks):
        assert backend.batch_set_v1(keys, written[rank]) == [True, True]
    assert single.batch_exists(keys) == 0, "a TP-1 server read a TP-2 server's slices"
    for rank, backend in enumerate(ranks):
        target = hosts[rank].alloc(2 * PAGE)
        assert backend.batch_get_v1(keys, target) == [True, True]
        for want, got in zip(_pages(hosts[rank], written[rank]), _pages(hosts[rank], target),
                             strict=True):  # fmt: skip
            assert torch.equal(want, got), f"TP rank {rank} read another rank's slice"


def test_storage_metrics_reach_sglangs_collector(backends: Any) -> None:
    """With --enable-storage-metrics SGLang's collector exports our reads and writes as its
    own sglang:prefetch_pgs / backup_pgs / *_bandwidth histograms."""
    from prometheus_client import REGISTRY

    host = _host_pool()
    backend = backends(host, metrics=True)
    keys = _keys("metrics", 3)
    backend.batch_set_v1(keys, _fill_pages(host, 3, seed=12))
    backend.batch_get_v1(keys[:2], host.alloc(2 * PAGE))
    collector = StorageMetricsCollector(labels={"storage_backend": "kvstore"})
    collector.log_storage_metrics(backend.get_stats())
    labels = {"storage_backend": "kvstore"}

    def sample(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    assert sample("sglang:backup_pgs_sum") == 3 and sample("sglang:prefetch_pgs_sum") == 2
    assert sample("sglang:prefetch_bandwidth_count") == 1
    assert sample("sglang:backup_bandwidth_sum") > 0
    assert backend.get_stats().prefetch_pgs == [], "get_stats must hand each interval once"
    assert backends(host).get_stats() is None, "no metrics without --enable-storage-metrics"
