"""KVStoreConnector inside real vLLM (0.32, CPU) against a real 12-node cluster.

vLLM's own ``Scheduler`` builds the scheduler-side connector through
``kv_connector_module_path`` (the launch flag's path), ``KVConnectorFactory`` the worker side,
and ``allocate_kv_cache`` the paged KV tensors a worker registers. A step is what vLLM's
model runner and attention layers do: bind the metadata, ``start_load_kv``, the forward pass
layer by layer (``wait_for_layer_load``, here writing seeded KV into the blocks it computes,
``save_kv_layer``), ``wait_for_save``, report load errors, and ``update_from_output``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the PyPI wheel is the CUDA build
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="needs vLLM: `make test-integrations` runs these in .venv-vllm")

from vllm.distributed.kv_events import MEDIUM_STORAGE, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from deploy.local_cluster import LocalCluster  # noqa: E402
from engine_adapter.integrations.vllm_connector import KVStoreConnector  # noqa: E402
from kvstore.errors import PermissionDenied  # noqa: E402
from tests.engine_adapter.integrations.vllm_instance import (  # noqa: E402
    BLOCK,
    LAYERS,
    MLA_SPEC,
    PROMPT,
    SPEC,
    TINY_DEEPSEEK,
    TINY_LLAMA,
    Instance,
    make_kv_cache_config,
    make_request,
    make_vllm_config,
    seeded,
    zeros,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local config.json of a tiny Llama: vLLM reads the shape, no weights are needed."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


@pytest.fixture(scope="module")
def mla_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-deepseek")
    (path / "config.json").write_text(json.dumps(TINY_DEEPSEEK))
    return path


@pytest.fixture
def instances(
    model_dir: Path, mla_model_dir: Path, store_config: Callable[..., dict[str, str]]
) -> Iterator[Callable[..., Instance]]:
    made: list[Instance] = []

    def make(tenant: str = "acme", **kwargs: Any) -> Instance:
        directory = mla_model_dir if kwargs.get("spec") is MLA_SPEC else model_dir
        made.append(Instance(directory, store_config(tenant), **kwargs))
        return made[-1]

    yield make
    for instance in made:
        instance.close()


def _seed_store(make: Callable[..., Instance], salt: str, **kwargs: Any) -> list[list[Any]]:
    """Instance A computes PROMPT (cache_salt ``salt``, a test's own) and saves its 4 full
    blocks; their KV values (rank 0's)."""
    a = make(**kwargs)
    a.scheduler.add_request(make_request("A", salt))
    out = a.step(seeded(sum(map(ord, salt))))
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0, "the store was not empty"
    a.flush()
    return [a.block_bytes(b) for b in out.scheduled_new_reqs[0].block_ids[0][:4]]


def _hits(make: Callable[..., Instance], salt: str, **kwargs: Any) -> tuple[Instance, Any]:
    """A fresh instance prefills PROMPT with ``salt``; (instance, its new request's state)."""
    b = make(**kwargs)
    b.scheduler.add_request(make_request("B", salt))
    return b, b.step(zeros).scheduled_new_reqs[0]


def test_blocks_saved_by_one_instance_load_in_another(
    instances: Callable[..., Instance],
) -> None:
    saved = _seed_store(instances, "round-trip")
    b = instances()  # a fresh scheduler and zeroed KV: another vLLM instance
    b.scheduler.add_request(make_request("B", "round-trip"))
    out = b.step(zeros)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 4 * BLOCK, "the scheduler did not load the 4 stored blocks"
    assert out.num_scheduled_tokens["B"] == len(PROMPT) - 4 * BLOCK
    assert not b.load_errors
    for index, block_id in enumerate(new.block_ids[0][:4]):
        for layer, (want, got) in enumerate(
            zip(saved[index], b.block_bytes(block_id), strict=True)
        ):
            assert torch.equal(want, got), f"block {index} layer {layer}: loaded wrong KV bytes"


@pytest.mark.parametrize(
    ("layout", "kernel_block"), [(KVCacheLayout.BLNHC, BLOCK), (KVCacheLayout.LBHNC, 8)]
)
def test_other_physical_layouts_share_blocks(
    instances: Callable[..., Instance], layout: KVCacheLayout, kernel_block: int
) -> None:
    """Blocks are stored as vLLM's logical [H, N, C] pages: a block-major layout, or heads
    before tokens with 8-token kernel blocks, loads what LBNHC saved, value for value."""
    salt = f"layouts-{layout.name}"
    saved = _seed_store(instances, salt)
    b = instances(layout=layout, kernel_block=kernel_block)
    b.scheduler.add_request(make_request("B", salt))
    new = b.step(zeros).scheduled_new_reqs[0]
    assert new.num_computed_tokens == 4 * BLOCK
    for index, block_id in enumerate(new.block_ids[0][:4]):
        for want, got in zip(saved[index], b.block_bytes(block_id), strict=True):
            assert torch.equal(want, got), "a layout change corrupted the loaded KV"


@pytest.mark.parametrize(
    ("what", "request_salt", "extra"),
    [
        ("another cache_salt", "other-salt", {}),
        ("no cache_salt", None, {}),
        ("another tenant", "seed", {"tenant": "globex"}),
        ("another model id", "seed", {"model_id": "other-model"}),
    ],
)
def test_other_salt_tenant_or_model_never_hits(
    instances: Callable[..., Instance], what: str, request_salt: str | None, extra: dict[str, str]
) -> None:
    seed_salt = f"seed-{what}"
    _seed_store(instances, seed_salt)
    same = instances()
    same.scheduler.add_request(make_request("same", seed_salt))
    assert same.step(zeros).scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
    other = instances(**extra)
    salt = seed_salt if request_salt == "seed" else request_salt
    other.scheduler.add_request(make_request("other", salt))
    assert other.step(zeros).scheduled_new_reqs[0].num_computed_tokens == 0, (
        f"{what} hit blocks stored for another salt, tenant or model"
    )


def test_kv_roles_only_save_or_only_load(instances: Callable[..., Instance]) -> None:
    """A kv_consumer loads but never saves; a kv_producer saves but never loads."""
    consumer = instances(kv_role="kv_consumer")
    consumer.scheduler.add_request(make_request("C", "roles"))
    consumer.step(seeded(11))
    consumer.flush()
    probe = instances()
    probe.scheduler.add_request(make_request("P", "roles"))
    assert probe.step(zeros).scheduled_new_reqs[0].num_computed_tokens == 0, (
        "a kv_consumer saved blocks"
    )
    probe.flush()  # the probe (kv_both) saved them: a loading instance would hit now
    again = instances()
    again.scheduler.add_request(make_request("A", "roles"))
    assert again.step(zeros).scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
    producer = instances(kv_role="kv_producer")
    producer.scheduler.add_request(make_request("R", "roles"))
    assert producer.step(zeros).scheduled_new_reqs[0].num_computed_tokens == 0, (
        "a kv_producer loaded blocks"
    )


def test_store_outage_after_lookup_ends_in_recompute(
    instances: Callable[..., Instance], cluster: LocalCluster
) -> None:
    """The lookup finds the blocks; three nodes die before the worker loads them; the
    load fails, vLLM is told the block ids, and it recomputes the prompt (policy
    "recompute"): the request is not failed."""
    _seed_store(instances, "outage")
    d = instances()
    request = make_request("D", "outage")
    d.scheduler.add_request(request)
    victims = cluster.config.groups[0][:3]  # one more than the code's 2 parities
    real_start = d.worker._worker.start_loads

    def start_after_outage(transfers: Any) -> None:
        for node_id in victims:
            cluster.kill_node(node_id)
        real_start(transfers)

    d.worker._worker.start_loads = start_after_outage
    try:
        out = d.step(seeded(7))
    finally:
        for node_id in victims:
            cluster.restart_node(node_id)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK, "the lookup missed"
    assert d.load_errors == set(out.scheduled_new_reqs[0].block_ids[0][:4]), (
        "the blocks that did not load were not reported to vLLM"
    )
    assert request.status != RequestStatus.FINISHED_ERROR, "a failed load failed the request"
    assert request.num_computed_tokens == 0, "vLLM kept the KV of blocks that never loaded"
    again = d.scheduler.schedule()
    assert again.num_scheduled_tokens == {"D": len(PROMPT)}, "the prompt was not recomputed"


def test_lookup_during_an_outage_is_a_miss(
    instances: Callable[..., Instance], cluster: LocalCluster
) -> None:
    _seed_store(instances, "down")
    e = instances()
    e.scheduler.add_request(make_request("E", "down"))
    cluster.stop()
    try:
        started = time.monotonic()
        out = e.step(seeded(8))
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        assert time.monotonic() - started < 60
    finally:
        for node_id in [n.id for n in cluster.config.nodes]:
            cluster.restart_node(node_id)


def test_e4m3x16_blocks_of_a_float_cache_load_as_the_codec_decodes_them(
    instances: Callable[..., Instance],
) -> None:
    """``kv_format: e4m3x16`` on a float cache: pages go out quantised (1.125 bytes a value)
    and come back as the codec decodes them, in the codec's own namespace: an instance
    storing the cache's dtype never hits them."""
    from engine_adapter import kv_format

    saved = _seed_store(instances, "e4m3", kv_format="e4m3x16")
    plain, plain_new = _hits(instances, "e4m3")
    assert plain_new.num_computed_tokens == 0, "a dtype-format instance hit e4m3x16 blocks"
    b, new = _hits(instances, "e4m3", kv_format="e4m3x16")
    values_per_block = plain.worker.block_bytes // SPEC.dtype.itemsize
    assert b.worker.block_bytes == values_per_block * 9 // 8, "not 1.125 bytes a value"
    assert new.num_computed_tokens == 4 * BLOCK, "the e4m3x16 blocks did not load"
    assert not b.load_errors
    for index, block_id in enumerate(new.block_ids[0][:4]):
        for layer, (want, got) in enumerate(
            zip(saved[index], b.block_bytes(block_id), strict=True)
        ):
            decoded = kv_format.dequantize(*kv_format.quantize(want), torch.empty_like(want))
            assert torch.equal(got, decoded), f"block {index} layer {layer}: not the codec's KV"
            assert not torch.equal(got, want), "the block was not quantised"


def test_an_e4m3x16_page_with_a_non_finite_scale_is_a_failed_load_never_kv(
    instances: Callable[..., Instance],
) -> None:
    """KV holding inf quantises to a NaN scale (the codec's mark): the block is found, its
    load is reported failed and vLLM recomputes it; no NaN reaches the paged KV."""
    a = instances(kv_format="e4m3x16")
    a.scheduler.add_request(make_request("A", "inf"))
    a.step(lambda shape: torch.full(shape, float("inf")))
    a.flush()
    b = instances(kv_format="e4m3x16")
    b.scheduler.add_request(make_request("B", "inf"))
    new = b.step(zeros).scheduled_new_reqs[0]
    assert new.num_computed_tokens == 4 * BLOCK, "the lookup missed"
    assert b.load_errors == set(new.block_ids[0][:4]), "a NaN-scale page was not a failed load"
    for block_id in new.block_ids[0][:4]:
        assert all(torch.isfinite(page).all() for page in b.block_bytes(block_id)), "NaN in KV"


def test_config_errors_name_the_fix(
    model_dir: Path,
    store_config: Callable[..., dict[str, str]],
    token_files: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    acme = store_config()
    for extra, error, message in [
        ({}, ValueError, "needs 'cluster'"),
        ({**acme, "token": "x"}, ValueError, "token_file"),
        ({**acme, "tenat": "acme"}, ValueError, "unknown keys"),
        ({**acme, "traffic_class": "bulk"}, ValueError, "bulk"),
        # A credential the nodes refuse stops the engine at start-up, with the fix.
        ({**acme, "token_file": token_files["globex"]}, PermissionDenied, "'token_file'"),
        ({"cluster": acme["cluster"], "tenant": "acme"}, PermissionDenied, "KVSTORE_TOKEN"),
    ]:
        config = make_vllm_config(model_dir, extra)
        with pytest.raises(error, match=message):
            KVStoreConnector(
                config, KVConnectorRole.SCHEDULER, make_kv_cache_config(KVCacheLayout.LBNHC)
            )


def test_mla_latent_blocks_round_trip(instances: Callable[..., Instance]) -> None:
    """An MLA model's latent pages (one [1, N, latent] page per layer) load byte for byte."""
    saved = _seed_store(instances, "mla", spec=MLA_SPEC)
    b, new = _hits(instances, "mla", spec=MLA_SPEC)
    assert new.num_computed_tokens == 4 * BLOCK, "the MLA instance did not hit its latents"
    for index, block_id in enumerate(new.block_ids[0][:4]):
        for want, got in zip(saved[index], b.block_bytes(block_id), strict=True):
            assert want.shape == (1, BLOCK, 48) and torch.equal(want, got), "latent corrupted"
    _, new = _hits(instances, "mla")
    assert new.num_computed_tokens == 0, "a Llama-style instance hit MLA latent blocks"


def test_mla_tp2_rank0_writes_every_rank_loads_the_latent(
    instances: Callable[..., Instance],
) -> None:
    """The latent is not split by heads: TP rank 0 stores it, every rank loads the same key,
    and a TP-1 instance of the model shares it (the bytes are the same)."""
    saved = _seed_store(instances, "mla-tp", spec=MLA_SPEC, tp_size=2)
    b, new = _hits(instances, "mla-tp", spec=MLA_SPEC, tp_size=2)
    assert new.num_computed_tokens == 4 * BLOCK
    for rank in (0, 1):
        got = [b.block_bytes(block_id, rank) for block_id in new.block_ids[0][:4]]
        assert all(
            torch.equal(w, g)
            for want, have in zip(saved, got, strict=True)
            for w, g in zip(want, have, strict=True)
        ), f"TP rank {rank} did not load rank 0's latent"
    assert b.workers[1]._worker.writes is False, "a second rank would store the latent again"
    _, new = _hits(instances, "mla-tp", spec=MLA_SPEC)
    assert new.num_computed_tokens == 4 * BLOCK, "TP-1 should share the replicated latent"


def test_tp2_and_tp1_engines_hit_only_their_own_slices(
    instances: Callable[..., Instance],
) -> None:
    """TP-2 ranks each store their KV head (keys name the slice: heads 0:1/2, 1:2/2); a TP-1
    engine of the same model holds both heads in one slice: neither reads the other's."""
    tp2 = instances(tp_size=2)
    tp2.scheduler.add_request(make_request("A", "tp"))
    out = tp2.step(seeded(21))
    tp2.flush()
    blocks = out.scheduled_new_reqs[0].block_ids[0][:4]
    saved = {rank: [tp2.block_bytes(b, rank) for b in blocks] for rank in (0, 1)}
    assert not torch.equal(saved[0][0][0], saved[1][0][0]), "ranks must hold different heads"
    tp1, new = _hits(instances, "tp")
    assert new.num_computed_tokens == 0, "a TP-1 engine read a TP-2 engine's head slices"
    tp1.flush()  # it computed and stored its own two-head blocks
    again, new = _hits(instances, "tp", tp_size=2)
    assert new.num_computed_tokens == 4 * BLOCK, "a TP-2 engine missed its own slices"
    for rank in (0, 1):
        for index, block_id in enumerate(new.block_ids[0][:4]):
            got = again.block_bytes(block_id, rank)
            assert all(torch.equal(w, g) for w, g in zip(saved[rank][index], got, strict=True)), (
                f"TP rank {rank} loaded another slice's bytes"
            )
    _, new = _hits(instances, "tp")
    assert new.num_computed_tokens == 4 * BLOCK, "a TP-1 engine missed its own blocks"


def test_stats_and_kv_events_reach_vllms_own_loggers_and_publisher(
    instances: Callable[..., Instance], caplog: pytest.LogCaptureFixture
) -> None:
    """Hits, misses, bytes and load time arrive in the SchedulerStats vLLM gives its loggers
    (its "KV Transfer metrics" log line, its Prometheus counters), and BlockStored events
    (medium STORAGE) on vLLM's ZMQ KV event publisher, as a subscriber sees them."""
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    endpoint, replay = (f"tcp://127.0.0.1:{_free_port()}" for _ in range(2))
    a = instances(kv_events_endpoint=endpoint, kv_events_replay=replay)
    a.scheduler.add_request(make_request("A", "stats"))
    a.step(seeded(5))
    a.flush()
    a.idle_step()  # the saves' completion is reported with the next step's output
    stored = _storage_events(zmq, msgspec, replay, num_blocks=4)
    assert [e.token_ids for e in stored] == [PROMPT[i * BLOCK : (i + 1) * BLOCK] for i in range(4)]
    assert all(e.block_size == BLOCK for e in stored)
    assert stored[1].parent_block_hash == stored[0].block_hashes[0], "events must chain"
    b, new = _hits(instances, "stats")
    assert new.num_computed_tokens == 4 * BLOCK
    written, read = _summed(a.stats), _summed(b.stats)
    page_bytes = SPEC.page_size_bytes * len(LAYERS)
    assert (written["miss_blocks"], written["saved_blocks"]) == (4, 4)
    assert written["saved_bytes"] == 4 * page_bytes
    assert (read["num_lookups"], read["hit_blocks"], read["miss_blocks"]) == (1, 4, 0)
    assert read["loaded_blocks"] == 4 and read["loaded_bytes"] == 4 * page_bytes
    assert read["load_s"] > 0 and read["load_failed_blocks"] == 0
    logging_ = KVConnectorLogging(b.config.kv_transfer_config)
    for data in b.stats:
        logging_.observe(data)
    with caplog.at_level(logging.INFO):
        logging_.log(logging.getLogger("vllm-test").info)
    assert "hit_blocks=4" in caplog.text and "loaded_bytes=" in caplog.text, caplog.text
    prom = KVConnectorProm(b.config, ["model_name", "engine"], {0: ["tiny", "0"]})
    for data in b.stats:
        prom.observe(data, 0)
    from prometheus_client import REGISTRY

    labels = {"model_name": "tiny", "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:kvstore_hit_blocks_total", labels) == 4
    assert REGISTRY.get_sample_value("vllm:kvstore_loaded_bytes_total", labels) == 4 * page_bytes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _storage_events(zmq: Any, msgspec: Any, replay: str, num_blocks: int) -> list[Any]:
    """BlockStored events of medium STORAGE that vLLM's ZMQ publisher sent, read back through
    its replay endpoint (every batch from sequence 0, so none is missed), until there are
    ``num_blocks`` (the publisher sends from a thread of its own)."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    deadline = time.monotonic() + 60
    while True:
        stored: list[Any] = []
        client = zmq.Context.instance().socket(zmq.DEALER)
        client.connect(replay)
        try:
            client.send_multipart((b"", (0).to_bytes(8, "big")))
            while client.poll(timeout=10_000):
                _, _, _, payload = client.recv_multipart()
                if not payload:  # the end-of-replay marker
                    break
                events = decoder.decode(payload).events
                stored += [e for e in events if getattr(e, "medium", None) == MEDIUM_STORAGE]
        finally:
            client.close(linger=0)
        if len(stored) >= num_blocks or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(stored) == num_blocks, f"{len(stored)} STORAGE events, expected {num_blocks}"
    return stored


def _summed(stats: list[dict[str, Any]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for data in stats:
        for name, value in data.items():
            total[name] = total.get(name, 0) + value
    return total


SLOW_NODE_DELAY_MS = 2000  # below the client's 5 s read timeout


def test_layerwise_load_hands_over_layer0_before_the_last_layer_lands(
    instances: Callable[..., Instance], cluster: LocalCluster
) -> None:
    """Layer-wise loads overlap the forward pass: the nodes holding the data shards of the
    block's last layer (and the parities) answer 2 s late; ``wait_for_layer_load`` of layer 0
    returns with layer 0 in the paged KV while the last layer has not landed, and the step
    ends with every layer loaded and verified."""
    prompt = list(range(300, 300 + BLOCK + 5))  # one full block
    a = instances()
    a.scheduler.add_request(make_request("A", "layerwise", prompt))
    out = a.step(seeded(31))
    a.flush()
    saved = a.block_bytes(out.scheduled_new_reqs[0].block_ids[0][0])
    request = make_request("B", "layerwise", prompt)
    key = a.worker._worker.namespace.keys(
        [bytes(request.block_hashes[0])], a.worker.salt_of(request)
    )[0]
    nodes = a.worker.kv.client.placement.nodes_for_key(key)
    block_bytes = a.worker.block_bytes
    shard_bytes = -(-block_bytes // a.worker.kv.client.codec.k)
    layer0_shards = -(-(block_bytes // len(LAYERS)) // shard_bytes)
    slowed = nodes[layer0_shards:]  # every shard but those of layer 0
    try:
        for node_id in slowed:
            cluster.restart_node(node_id, ["--inject-delay-ms", str(SLOW_NODE_DELAY_MS)])
        b = instances(transport="auto")  # nodes write into its landing pool
        b.scheduler.add_request(request)
        out = b.scheduler.schedule()
        assert out.scheduled_new_reqs[0].num_computed_tokens == BLOCK, "the lookup missed"
        assert out.has_sync_kv_loads, "layer-wise loads run in the request's own step"
        block_id = out.scheduled_new_reqs[0].block_ids[0][0]
        worker = b.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        started_s = time.monotonic()
        worker.start_load_kv(None)
        worker.wait_for_layer_load(LAYERS[0])
        layer0_s = time.monotonic() - started_s
        (load,) = worker._worker._loads.in_flight
        assert not load.has_layer(len(LAYERS) - 1), (
            f"layer 0 was handed over only once the last layer had landed ({layer0_s:.2f} s)"
        )
        assert torch.equal(b.block_bytes(block_id)[0], saved[0]), "layer 0 is not in place"
        for name in LAYERS[1:]:
            worker.wait_for_layer_load(name)
        all_s = time.monotonic() - started_s
        worker.wait_for_save()
        b._finish(out)
    finally:
        for node_id in slowed:
            cluster.restart_node(node_id)
    print(f"layer 0 handed over after {layer0_s:.2f} s, every layer after {all_s:.2f} s")
    assert not b.load_errors, "the slowed nodes' shards did not verify"
    for layer, (want, got) in enumerate(zip(saved, b.block_bytes(block_id), strict=True)):
        assert torch.equal(want, got), f"layer {layer}: loaded wrong KV bytes"
    assert all_s >= SLOW_NODE_DELAY_MS / 1000, "the last layer did not wait for the slow nodes"


def test_async_loads_run_between_steps_and_start_the_request_loaded(
    instances: Callable[..., Instance],
) -> None:
    """``load_mode`` "async": the request waits (WAITING_FOR_REMOTE_KVS) while its blocks
    load; get_finished reports it once they are in the paged KV, and it then runs with the
    4 blocks computed."""
    saved = _seed_store(instances, "async")
    b = instances(load_mode="async")
    request = make_request("B", "async")
    b.scheduler.add_request(request)
    out = b.step(zeros)
    assert not out.scheduled_new_reqs, "the request ran before its blocks loaded"
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    deadline_s = time.monotonic() + 60  # the loads' own timeout is 5 s
    while not out.scheduled_new_reqs:  # each step hands over the loads that finished
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, request.status
        assert time.monotonic() < deadline_s, "get_finished never reported the loaded request"
        time.sleep(0.01)
        out = b.step(zeros)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 4 * BLOCK, "the loaded blocks were not used"
    assert not b.load_errors
    for index, block_id in enumerate(new.block_ids[0][:4]):
        for want, got in zip(saved[index], b.block_bytes(block_id), strict=True):
            assert torch.equal(want, got), f"block {index}: loaded wrong KV bytes"


def test_load_mode_is_checked(instances: Callable[..., Instance]) -> None:
    with pytest.raises(ValueError, match="load_mode 'eager' is not one of"):
        instances(load_mode="eager")
