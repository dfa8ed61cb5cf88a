"""Fixtures of the serving tests: one real 12-node cluster and one pool of worker processes
(two prefill, one decode) running a small seeded random-init model, shared by the session.

Tests that kill or restart a worker or a node put it back before they return, so every
test starts from two healthy prefill workers, one healthy decode worker and 12 nodes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from deploy.local_cluster import LocalCluster
from engine_adapter import serving_pb2 as pb
from engine_adapter.kv_layout import KVBlockLayout
from engine_adapter.loader import LoadedModel, load_model
from engine_adapter.paged_kv import BlockTable, PagedKVCache
from engine_adapter.serve import WorkerPool
from engine_adapter.workers import Sampler

MODEL = "random:small"  # 4 layers, vocab 1024: fast, and KV blocks of 64 KiB
BLOCK_TOKENS = 64


@pytest.fixture(scope="session")
def serving_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("serving-cluster")
    with LocalCluster.start(root, num_nodes=12, fsync=False) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def worker_pool(
    serving_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerPool]:
    run_dir = tmp_path_factory.mktemp("serving-workers")
    with WorkerPool.start(
        serving_cluster.cluster_toml,
        run_dir,
        num_prefill=2,
        num_decode=1,
        model=MODEL,
        worker_args=["--max-model-len", "1024"],
        startup_timeout_s=120,
    ) as pool:
        yield pool


@pytest.fixture(scope="session")
def reference_model() -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(MODEL, "cpu", "float32", seed=0)


def reference_generate(
    loaded: LoadedModel,
    token_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[int]:
    """Tokens of one request from a single in-process model with no store: the prompt is
    computed block by block, then one token per step (stops at max_new_tokens only)."""
    model = loaded.model
    layout = KVBlockLayout.for_model(model.config, BLOCK_TOKENS, "float32")
    num_tokens = len(token_ids) + max_new_tokens
    cache = PagedKVCache(layout, -(-num_tokens // BLOCK_TOKENS), torch.device("cpu"))
    table = BlockTable(BLOCK_TOKENS, cache.pool.allocate(-(-num_tokens // BLOCK_TOKENS)))
    ids = torch.tensor(list(token_ids))
    for start in range(0, len(ids), BLOCK_TOKENS):
        hidden = model(ids[start : start + BLOCK_TOKENS], start, cache, table)
    sampler = Sampler(pb.SamplingParams(temperature=temperature, seed=seed))
    generated = [sampler(model.logits(hidden[-1]))]
    while len(generated) < max_new_tokens:
        position = len(ids) + len(generated) - 1
        hidden = model(torch.tensor(generated[-1:]), position, cache, table)
        generated.append(sampler(model.logits(hidden[-1])))
    return generated


def is_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (absent, or a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"
