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

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_events import MEDIUM_STORAGE, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from deploy.local_cluster import LocalCluster  # noqa: E402
from engine_adapter.integrations.vllm_connector import KVStoreConnector  # noqa: E402
from kvstore.errors import PermissionDenied  # noqa: E402

pytestmark = [pytest.mark.integrations, pytest.mark.timeout(600)]

BLOCK, NUM_BLOCKS, EOS = 16, 64, 2
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float32)
# DeepSeek-style MLA: one latent per token (kv_lora_rank 32 + RoPE key 16), replicated over TP
MLA_SPEC = MLAAttentionSpec(
    block_size=BLOCK,
    num_kv_heads=1,
    max_tp_shards=1,
    head_size=48,
    dtype=torch.float32,
    cache_dtype_str="auto",
)
PROMPT = list(range(100, 100 + 4 * BLOCK + 5))  # 69 tokens: 4 full blocks and a tail
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": EOS,
}

init_none_hash(sha256)  # sha256 block hashes agree across processes (vLLM's default)
TINY_DEEPSEEK = {  # MLA: vLLM reads the shape (latent 32 + RoPE 16 = MLA_SPEC's 48)
    **TINY_LLAMA,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


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


class Instance:
    """One vLLM instance: its real scheduler, one worker-side connector per TP rank (vLLM's
    WorkerBase sets each worker's ``parallel_config.rank``), each rank's paged KV."""

    def __init__(
        self,
        model_dir: Path,
        store: dict[str, Any],
        layout: KVCacheLayout = KVCacheLayout.LBNHC,
        kernel_block: int = BLOCK,
        kv_role: str = "kv_both",
        spec: AttentionSpec = SPEC,
        tp_size: int = 1,
        kv_events_endpoint: str | None = None,
        kv_events_replay: str | None = None,
        **extra: Any,
    ) -> None:
        def config(rank: int = 0) -> VllmConfig:
            made = _vllm_config(model_dir, {**store, **extra}, kv_role, tp_size)
            if kv_events_endpoint:
                made.kv_events_config = KVEventsConfig(
                    enable_kv_cache_events=True,
                    publisher="zmq",
                    endpoint=kv_events_endpoint,
                    replay_endpoint=kv_events_replay,
                )
            made.cache_config.num_gpu_blocks = NUM_BLOCKS
            made.parallel_config.rank = rank
            return made

        # A TP rank holds its share of the KV heads (all of MLA's one latent "head"); the
        # scheduler's KV cache config is the ranks' (vLLM builds it from the workers' specs).
        rank_spec = _rank_spec(spec, tp_size)
        self.config = config()
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=_kv_cache_config(layout, rank_spec),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
        )
        self.workers, self.kvs = [], []
        for rank in range(tp_size):
            kv_cache_config = _kv_cache_config(layout, rank_spec)
            worker = KVConnectorFactory.create_connector(
                config(rank), KVConnectorRole.WORKER, kv_cache_config
            )
            kv = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, [kernel_block])
            worker.register_kv_caches(kv)
            self.workers.append(worker)
            self.kvs.append(kv)
        self.worker, self.kv = self.workers[0], self.kvs[0]
        self.load_errors: set[int] = set()
        self._recv_remaining: dict[str, int] = {}  # async loads: ranks yet to report each
        self.stats: list[dict[str, Any]] = []  # the kv_connector_stats vLLM hands its loggers

    def step(self, fill: Callable[[torch.Size], torch.Tensor]) -> Any:
        """One engine step; ``fill`` makes the KV the forward pass writes (each rank its own).
        As vLLM's model runner: loads the step's forward pass needs start before it, others
        (``load_kv_async``) after it."""
        out = self.scheduler.schedule()
        for rank, worker in enumerate(self.workers):
            worker.bind_connector_metadata(out.kv_connector_metadata)
            if out.has_sync_kv_loads:
                worker.start_load_kv(None)
            for name in LAYERS:  # the forward pass, layer by layer, as vLLM's attention runs
                worker.wait_for_layer_load(name)
                for new in out.scheduled_new_reqs:  # it writes the KV it computes
                    for block_id in self._computed_blocks(out, new):
                        view = self._block(name, block_id, rank)
                        view.copy_(fill(view.shape))
                worker.save_kv_layer(name, self.kvs[rank][name], None)
            if not out.has_sync_kv_loads:
                worker.start_load_kv(None)
            worker.wait_for_save()
        return self._finish(out)

    @staticmethod
    def _computed_blocks(out: Any, new: Any) -> list[int]:
        first = new.num_computed_tokens // BLOCK
        end = -(-(new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]) // BLOCK)
        return new.block_ids[0][first:end]

    def _finish(self, out: Any) -> Any:
        """The workers' outputs, aggregated as vLLM's KVOutputAggregator does, to the scheduler."""
        errors: set[int] = set()
        recving: set[str] = set()
        events = stats = None
        for worker in self.workers:
            _, worker_recving = worker.get_finished(out.finished_req_ids)
            for req_id in worker_recving or ():  # done once every rank reported it
                remaining = self._recv_remaining.get(req_id, len(self.workers)) - 1
                self._recv_remaining[req_id] = remaining
                if remaining == 0:
                    del self._recv_remaining[req_id]
                    recving.add(req_id)
            errors |= worker.get_block_ids_with_load_errors()
            worker_stats = worker.get_kv_connector_stats()
            if worker_stats is not None:
                stats = worker_stats if stats is None else stats.aggregate(worker_stats)
            worker_events = worker.get_kv_connector_kv_cache_events()
            if events is None:
                events = worker_events
            elif worker_events is not None:
                events.add_events(worker_events.get_all_events())
                events.increment_workers(1)
            worker.clear_connector_metadata()
        self.load_errors |= errors
        req_ids = [r.req_id for r in out.scheduled_new_reqs] + list(
            out.scheduled_cached_reqs.req_ids
        )
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[EOS] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=recving,
                invalid_block_ids=errors,
                kv_connector_stats=stats,
                kv_cache_events=events,
            ),
        )
        for engine_output in self.scheduler.update_from_output(out, output).values():
            scheduler_stats = engine_output.scheduler_stats
            if scheduler_stats is not None and scheduler_stats.kv_connector_stats:
                self.stats.append(scheduler_stats.kv_connector_stats)
        return out

    def idle_step(self) -> Any:
        """A step with nothing scheduled: what vLLM's loop does while transfers finish."""
        out = self.scheduler.schedule()
        for worker in self.workers:  # vLLM's kv_connector_no_forward
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)
            worker.wait_for_save()
        return self._finish(out)

    def _block(self, name: str, block_id: int, rank: int = 0) -> torch.Tensor:
        """Block ``block_id`` of a layer as [H, N, C] (kernel blocks joined)."""
        view = self.kvs[rank][name]
        ratio = view.shape[0] // NUM_BLOCKS
        pages = view[block_id * ratio : (block_id + 1) * ratio]  # [ratio, H, n, C]
        return pages.transpose(0, 1).reshape(view.shape[1], BLOCK, view.shape[3])

    def block_bytes(self, block_id: int, rank: int = 0) -> list[torch.Tensor]:
        return [self._block(name, block_id, rank).clone() for name in LAYERS]

    def write_block(self, block_id: int, values: list[torch.Tensor]) -> None:
        for name, value in zip(LAYERS, values, strict=True):
            view = self.kv[name]
            ratio = view.shape[0] // NUM_BLOCKS
            pages = view[block_id * ratio : (block_id + 1) * ratio]
            shaped = value.view(view.shape[1], ratio, -1, view.shape[3]).transpose(0, 1)
            pages.copy_(shaped)

    def flush(self) -> None:
        """Let the workers' background saves land (a real engine needs no such wait)."""
        for worker in self.workers:
            worker._worker.drain()

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()  # the KV event publisher and the scheduler-side connector


def _vllm_config(
    model_dir: Path, extra: dict[str, Any], kv_role: str = "kv_both", tp_size: int = 1
) -> VllmConfig:
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
    return VllmConfig(
        model_config=model,
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_role=kv_role,
            kv_connector_module_path="engine_adapter.integrations.vllm_connector",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
    )


def _rank_spec(spec: AttentionSpec, tp_size: int) -> AttentionSpec:
    if isinstance(spec, MLAAttentionSpec) or tp_size == 1:
        return spec
    return FullAttentionSpec(
        block_size=spec.block_size,
        num_kv_heads=spec.num_kv_heads // tp_size,
        head_size=spec.head_size,
        dtype=spec.dtype,
    )


def _kv_cache_config(layout: KVCacheLayout, spec: AttentionSpec = SPEC) -> KVCacheConfig:
    page = spec.page_size_bytes
    if layout.is_layer_compact:  # each layer's blocks together
        strides = {"layer_stride": page * NUM_BLOCKS, "block_stride": page}
    else:  # each block's layers together
        strides = {"layer_stride": page, "block_stride": page * len(LAYERS)}
    tensor = KVCacheTensor(size=page * NUM_BLOCKS * len(LAYERS), layers=LAYERS, **strides)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )


def _request(req_id: str, salt: str | None, prompt: list[int] = PROMPT) -> Request:
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _seeded(seed: int) -> Callable[[torch.Size], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return lambda shape: torch.randn(shape, generator=generator)


def _zeros(shape: torch.Size) -> torch.Tensor:
    return torch.zeros(shape)


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
    a.scheduler.add_request(_request("A", salt))
    out = a.step(_seeded(sum(map(ord, salt))))
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0, "the store was not empty"
    a.flush()
    return [a.block_bytes(b) for b in out.scheduled_new_reqs[0].block_ids[0][:4]]


def _hits(make: Callable[..., Instance], salt: str, **kwargs: Any) -> tuple[Instance, Any]:
    """A fresh instance prefills PROMPT with ``salt``; (instance, its new request's state)."""
    b = make(**kwargs)
    b.scheduler.add_request(_request("B", salt))
    return b, b.step(_zeros).scheduled_new_reqs[0]


def test_blocks_saved_by_one_instance_load_in_another(
    instances: Callable[..., Instance],
) -> None:
    saved = _seed_store(instances, "round-trip")
    b = instances()  # a fresh scheduler and zeroed KV: another vLLM instance
    b.scheduler.add_request(_request("B", "round-trip"))
    out = b.step(_zeros)
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
    b.scheduler.add_request(_request("B", salt))
    new = b.step(_zeros).scheduled_new_reqs[0]
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
    same.scheduler.add_request(_request("same", seed_salt))
    assert same.step(_zeros).scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
    other = instances(**extra)
    salt = seed_salt if request_salt == "seed" else request_salt
    other.scheduler.add_request(_request("other", salt))
    assert other.step(_zeros).scheduled_new_reqs[0].num_computed_tokens == 0, (
        f"{what} hit blocks stored for another salt, tenant or model"
    )


def test_kv_roles_only_save_or_only_load(instances: Callable[..., Instance]) -> None:
    """A kv_consumer loads but never saves; a kv_producer saves but never loads."""
    consumer = instances(kv_role="kv_consumer")
    consumer.scheduler.add_request(_request("C", "roles"))
    consumer.step(_seeded(11))
    consumer.flush()
    probe = instances()
    probe.scheduler.add_request(_request("P", "roles"))
    assert probe.step(_zeros).scheduled_new_reqs[0].num_computed_tokens == 0, (
        "a kv_consumer saved blocks"
    )
    probe.flush()  # the probe (kv_both) saved them: a loading instance would hit now
    again = instances()
    again.scheduler.add_request(_request("A", "roles"))
    assert again.step(_zeros).scheduled_new_reqs[0].num_computed_tokens == 4 * BLOCK
    producer = instances(kv_role="kv_producer")
    producer.scheduler.add_request(_request("R", "roles"))
    assert producer.step(_zeros).scheduled_new_reqs[0].num_computed_tokens == 0, (
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
    request = _request("D", "outage")
    d.scheduler.add_request(request)
    victims = cluster.config.groups[0][:3]  # one more than the code's 2 parities
    real_start = d.worker._worker.start_loads

    def start_after_outage(transfers: Any) -> None:
        for node_id in victims:
            cluster.kill_node(node_id)
        real_start(transfers)

    d.worker._worker.start_loads = start_after_outage
    try:
        out = d.step(_seeded(7))
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
    e.scheduler.add_request(_request("E", "down"))
    cluster.stop()
    try:
        started = time.monotonic()
        out = e.step(_seeded(8))
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        assert time.monotonic() - started < 60
    finally:
        for node_id in [n.id for n in cluster.config.nodes]:
            cluster.restart_node(node_id)


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
        config = _vllm_config(model_dir, extra)
        with pytest.raises(error, match=message):
            KVStoreConnector(
                config, KVConnectorRole.SCHEDULER, _kv_cache_config(KVCacheLayout.LBNHC)
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
    tp2.scheduler.add_request(_request("A", "tp"))
    out = tp2.step(_seeded(21))
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
    a.scheduler.add_request(_request("A", "stats"))
    a.step(_seeded(5))
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
    a.scheduler.add_request(_request("A", "layerwise", prompt))
    out = a.step(_seeded(31))
    a.flush()
    saved = a.block_bytes(out.scheduled_new_reqs[0].block_ids[0][0])
    request = _request("B", "layerwise", prompt)
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
    request = _request("B", "async")
    b.scheduler.add_request(request)
    out = b.step(_zeros)
    assert not out.scheduled_new_reqs, "the request ran before its blocks loaded"
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    deadline_s = time.monotonic() + 60  # the loads' own timeout is 5 s
    while not out.scheduled_new_reqs:  # each step hands over the loads that finished
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS, request.status
        assert time.monotonic() < deadline_s, "get_finished never reported the loaded request"
        time.sleep(0.01)
        out = b.step(_zeros)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 4 * BLOCK, "the loaded blocks were not used"
    assert not b.load_errors
    for index, block_id in enumerate(new.block_ids[0][:4]):
        for want, got in zip(saved[index], b.block_bytes(block_id), strict=True):
            assert torch.equal(want, got), f"block {index}: loaded wrong KV bytes"


def test_load_mode_is_checked(instances: Callable[..., Instance]) -> None:
    with pytest.raises(ValueError, match="load_mode 'eager' is not one of"):
        instances(load_mode="eager")
