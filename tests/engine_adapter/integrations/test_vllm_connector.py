"""KVStoreConnector inside real vLLM (0.32, CPU) against a real 12-node cluster.

vLLM's own ``Scheduler`` builds the scheduler-side connector through
``kv_connector_module_path`` (the launch flag's path), ``KVConnectorFactory`` the worker side,
and ``allocate_kv_cache`` the paged KV tensors a worker registers. A step is what vLLM's
model runner does: bind the metadata, ``start_load_kv``, the forward pass (here: writing
seeded KV into the blocks it computes), ``wait_for_save``, report load errors, and
``update_from_output``.
"""

from __future__ import annotations

import json
import os
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
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local config.json of a tiny Llama: vLLM reads the shape, no weights are needed."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


class Instance:
    """One vLLM instance: its real scheduler, one worker-side connector, its paged KV."""

    def __init__(
        self,
        model_dir: Path,
        store: dict[str, Any],
        layout: KVCacheLayout = KVCacheLayout.LBNHC,
        kernel_block: int = BLOCK,
        kv_role: str = "kv_both",
        **extra: Any,
    ) -> None:
        config = _vllm_config(model_dir, {**store, **extra}, kv_role)
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        kv_cache_config = _kv_cache_config(layout)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        self.worker = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )
        device = torch.device("cpu")
        self.kv = allocate_kv_cache(kv_cache_config, device, layout, [kernel_block])
        self.worker.register_kv_caches(self.kv)
        self.load_errors: set[int] = set()

    def step(self, fill: Callable[[torch.Size], torch.Tensor]) -> Any:
        """One engine step; ``fill`` makes the KV the forward pass writes."""
        out = self.scheduler.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        for new in out.scheduled_new_reqs:  # the forward pass writes the KV it computes
            first = new.num_computed_tokens // BLOCK
            end = -(-(new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]) // BLOCK)
            for block_id in new.block_ids[0][first:end]:
                for name in LAYERS:
                    view = self._block(name, block_id)
                    view.copy_(fill(view.shape))
        self.worker.wait_for_save()
        errors = self.worker.get_block_ids_with_load_errors()
        self.load_errors |= errors
        self.worker.clear_connector_metadata()
        req_ids = [r.req_id for r in out.scheduled_new_reqs] + list(
            out.scheduled_cached_reqs.req_ids
        )
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[EOS] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(invalid_block_ids=errors),
        )
        self.scheduler.update_from_output(out, output)
        return out

    def _block(self, name: str, block_id: int) -> torch.Tensor:
        """Block ``block_id`` of a layer as [H, N, C] (kernel blocks joined)."""
        view = self.kv[name]
        ratio = view.shape[0] // NUM_BLOCKS
        pages = view[block_id * ratio : (block_id + 1) * ratio]  # [ratio, H, n, C]
        return pages.transpose(0, 1).reshape(view.shape[1], BLOCK, view.shape[3])

    def block_bytes(self, block_id: int) -> list[torch.Tensor]:
        return [self._block(name, block_id).clone() for name in LAYERS]

    def write_block(self, block_id: int, values: list[torch.Tensor]) -> None:
        for name, value in zip(LAYERS, values, strict=True):
            view = self.kv[name]
            ratio = view.shape[0] // NUM_BLOCKS
            pages = view[block_id * ratio : (block_id + 1) * ratio]
            shaped = value.view(view.shape[1], ratio, -1, view.shape[3]).transpose(0, 1)
            pages.copy_(shaped)

    def flush(self) -> None:
        """Let the worker's background saves land (a real engine needs no such wait)."""
        self.worker._worker.drain()

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()


def _vllm_config(model_dir: Path, extra: dict[str, Any], kv_role: str = "kv_both") -> VllmConfig:
    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
    return VllmConfig(
        model_config=model,
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


def _kv_cache_config(layout: KVCacheLayout) -> KVCacheConfig:
    page = SPEC.page_size_bytes
    if layout.is_layer_compact:  # each layer's blocks together
        strides = {"layer_stride": page * NUM_BLOCKS, "block_stride": page}
    else:  # each block's layers together
        strides = {"layer_stride": page, "block_stride": page * len(LAYERS)}
    tensor = KVCacheTensor(size=page * NUM_BLOCKS * len(LAYERS), layers=LAYERS, **strides)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)],
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
    model_dir: Path, store_config: Callable[..., dict[str, str]]
) -> Iterator[Callable[..., Instance]]:
    made: list[Instance] = []

    def make(tenant: str = "acme", **kwargs: Any) -> Instance:
        made.append(Instance(model_dir, store_config(tenant), **kwargs))
        return made[-1]

    yield make
    for instance in made:
        instance.close()


def _seed_store(make: Callable[..., Instance], salt: str) -> list[list[Any]]:
    """Instance A computes PROMPT (cache_salt ``salt``, a test's own) and saves its 4 full
    blocks; their KV values."""
    a = make()
    a.scheduler.add_request(_request("A", salt))
    out = a.step(_seeded(sum(map(ord, salt))))
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0, "the store was not empty"
    a.flush()
    return [a.block_bytes(b) for b in out.scheduled_new_reqs[0].block_ids[0][:4]]


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
    real_load = d.worker._worker.load

    def load_after_outage(transfers: Any) -> None:
        for node_id in victims:
            cluster.kill_node(node_id)
        real_load(transfers)

    d.worker._worker.load = load_after_outage
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
