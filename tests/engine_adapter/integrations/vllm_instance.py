"""One vLLM instance for the connector's tests: vLLM's real scheduler, a worker-side connector
per TP rank and their paged KV, stepped as vLLM's model runner steps them.

test_vllm_connector.py imports it once vLLM is known to be installed (the module imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

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
            made = make_vllm_config(model_dir, {**store, **extra}, kv_role, tp_size)
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
            kv_cache_config=make_kv_cache_config(layout, rank_spec),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
        )
        self.workers, self.kvs = [], []
        for rank in range(tp_size):
            kv_cache_config = make_kv_cache_config(layout, rank_spec)
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


def make_vllm_config(
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


def make_kv_cache_config(layout: KVCacheLayout, spec: AttentionSpec = SPEC) -> KVCacheConfig:
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


def make_request(req_id: str, salt: str | None, prompt: list[int] = PROMPT) -> Request:
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


def seeded(seed: int) -> Callable[[torch.Size], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return lambda shape: torch.randn(shape, generator=generator)


def zeros(shape: torch.Size) -> torch.Tensor:
    return torch.zeros(shape)
