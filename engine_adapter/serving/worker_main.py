"""Prefill and decode worker processes: each runs the engine and serves one gRPC service.

::

    python -m engine_adapter.serving.worker_main prefill|decode --cluster DIR/cluster.toml --id p0
        [--model default] [--port 0] [--ready-file PATH] [--parent-pid PID]
        [--store-transport grpc|auto|ucx] [--metrics-port 0] [--drain-grace-s 60]
        [--calibration-tokens 64,256,512] [--prefill-step-budget-ms 0]
        [--served-model-name NAME] [--tls-ca-file F --tls-cert-file F --tls-key-file F]

Both roles run :class:`engine_adapter.engine.Engine` (model, paged KV, store connector): the
prefill worker (``prefill_worker.py``) computes and writes back, the decode worker
(``decode_worker.py``) continues from the handoff (``handoff.py``). A prefill worker first
times a few cold prefills (``--calibration-tokens``), which its Health reply carries to the
router's cost model. A worker writes ``--ready-file`` (JSON: id, role, address, pid, model
fingerprint, seconds per start-up stage) once it serves (over TLS when given the serving
certificate, ``worker_tls.py``), serves Prometheus metrics on ``--metrics-port``, and exits when
its parent dies (so a killed ``kvstore serve`` leaves no workers behind), on SIGINT, or after
a drain (SIGTERM or the RPC) has moved or finished every request; it exits 0 then, which
``kvstore serve`` takes as "do not restart".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path

import grpc
import torch
from prometheus_client import start_http_server

from engine_adapter.config import EngineConfig
from engine_adapter.engine import Engine, freeze_startup_heap
from engine_adapter.loader import model_name
from engine_adapter.serving import serving_pb2_grpc as pb_grpc
from engine_adapter.serving.admission import DEFAULT_TIMEOUT_S
from engine_adapter.serving.balancer import PrefillCostModel, PrefillSample
from engine_adapter.serving.decode_worker import DecodeWorker
from engine_adapter.serving.metrics import WorkerMetrics
from engine_adapter.serving.prefill_worker import PrefillWorker
from engine_adapter.serving.worker_base import WorkerBase
from engine_adapter.serving.worker_endpoint import CHANNEL_OPTIONS
from engine_adapter.serving.worker_flags import add_worker_tuning_arguments
from engine_adapter.serving.worker_tls import WorkerTLS
from kvstore.cli.args import duration_arg

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
PARENT_POLL_S = 0.5
STOP_GRACE_S = 2.0
DECODE_MIN_FETCH_DEADLINE_S = 1.0


def engine_config(
    role: str,
    block_tokens: int,
    max_model_len: int,
    seed: int,
    fetch_policy: str = "always",
    store_transport: str = "grpc",
    kv_format: str = "dtype",
) -> EngineConfig:
    """One sequence at a time; prefill fetches by ``fetch_policy`` and writes back, decode
    always fetches (its KV must come from the store) and never writes.

    A decode worker never prefills, so its cost model never learns the compute rate that
    sets fetch deadlines; a floor of DECODE_MIN_FETCH_DEADLINE_S keeps a busy machine from
    turning its swap-in into a recompute.
    """
    is_prefill = role == "prefill"
    defaults = EngineConfig()
    return EngineConfig(
        block_tokens=block_tokens,
        prefill_chunk_tokens=block_tokens,
        max_num_seqs=1,
        max_model_len=max_model_len,
        fetch_policy=fetch_policy if is_prefill else "always",
        fetch_min_deadline_s=(
            defaults.fetch_min_deadline_s if is_prefill else DECODE_MIN_FETCH_DEADLINE_S
        ),
        write_back=is_prefill,
        store_transport=store_transport,
        kv_format=kv_format,
        seed=seed,
    )


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of one worker process."""
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--cluster", required=True, type=Path, help="the store's cluster.toml")
    parser.add_argument("--id", required=True, help="worker id, e.g. p0 or d0")
    parser.add_argument("--model", default="default", help="default, random:<size>, a .gguf or dir")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    parser.add_argument(
        "--ready-file", type=Path, help="write id/address/pid JSON here once serving"
    )
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 suits shared CPUs)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random-init seed (random:<size>)")
    parser.add_argument(
        "--inject-delay-ms", type=float, default=0.0, help="tests: slow requests and tokens"
    )
    add_worker_tuning_arguments(parser)
    parser.add_argument(
        "--stall-timeout-s",
        type=duration_arg,
        default=DEFAULT_TIMEOUT_S,
        help="an engine held this long with no progress is wedged: Health then answers "
        "not-serving (kvstore serve passes its --request-timeout-s)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: any free port)"
    )
    parser.add_argument(
        "--served-model-name", default="", help="the metrics' model_name (default: the model's)"
    )
    for name, what in (("ca", "the CA"), ("cert", "the serving certificate"), ("key", "its key")):
        parser.add_argument(f"--tls-{name}-file", help=f"TLS to the router: {what} (PEM)")


async def calibrate(engine: Engine, lengths: Sequence[int], seed: int = 0) -> list[PrefillSample]:
    """Time a cold prefill of each length (after one untimed warm-up); no store involved."""
    lengths = [n for n in lengths if 0 < n < engine.max_model_len]
    rng = torch.Generator().manual_seed(seed)
    vocab_size = engine.model.config.vocab_size

    async def timed(num_tokens: int) -> float:
        prompt = torch.randint(vocab_size, (num_tokens,), generator=rng).tolist()
        result = await engine.prefill(prompt, use_cache=False)
        engine.release(result.sequence)
        return result.ttft_s

    if lengths:
        await timed(min(lengths))
    return [PrefillSample(n, 0, await timed(n)) for n in lengths]


async def serve_worker(args: argparse.Namespace) -> None:
    """Load the model, serve until SIGTERM/SIGINT, a finished drain or the parent's death."""
    torch.set_num_threads(args.threads)
    stages_s: dict[str, float] = {}  # start-up stage -> seconds, for kvstore serve's log
    engine, calibration = await _load_engine(args, stages_s)
    with _timed(stages_s, "store"):
        engine.open_store(args.cluster)
    freeze_startup_heap()
    worker_type = PrefillWorker if args.role == "prefill" else DecodeWorker
    metrics = WorkerMetrics(model_name=args.served_model_name or model_name(args.model))
    tls = _tls(args)
    worker = worker_type(
        args.id, engine, args.cluster, args.inject_delay_ms / 1000, metrics, args.stall_timeout_s
    )
    worker.calibration = calibration
    worker.peer_identity = tls.identity() if tls is not None else None
    metrics_server, _ = start_http_server(
        args.metrics_port, addr="127.0.0.1", registry=worker.metrics.registry
    )
    worker.metrics_address = f"127.0.0.1:{metrics_server.server_port}"
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add = (
        pb_grpc.add_PrefillWorkerServicer_to_server
        if args.role == "prefill"
        else pb_grpc.add_DecodeWorkerServicer_to_server
    )
    add(worker, server)
    address = f"127.0.0.1:{args.port}"
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.server_credentials())
    await server.start()
    wedge_watch = asyncio.create_task(worker.watch())
    await _serve_until_stopped(args, worker, port, stages_s)
    wedge_watch.cancel()
    await server.stop(STOP_GRACE_S)
    metrics_server.shutdown()
    await engine.close()


def _tls(args: argparse.Namespace) -> WorkerTLS | None:
    files = (args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    return WorkerTLS(*files) if all(files) else None


@contextlib.contextmanager
def _timed(stages_s: dict[str, float], stage: str) -> Iterator[None]:
    start_s = time.perf_counter()
    yield
    stages_s[stage] = round(time.perf_counter() - start_s, 2)


async def _load_engine(
    args: argparse.Namespace, stages_s: dict[str, float]
) -> tuple[Engine, list[PrefillSample]]:
    """The worker's engine and, for a prefill worker, its calibration (which may also size
    the prefill chunk to ``--prefill-step-budget-ms``)."""
    config = engine_config(
        args.role,
        args.block_tokens,
        args.max_model_len,
        args.seed,
        args.fetch_policy,
        args.store_transport,
        args.kv_format,
    )
    with _timed(stages_s, "load"):
        engine = await asyncio.to_thread(Engine.load, args.model, config)
    if args.role != "prefill":
        return engine, []
    with _timed(stages_s, "calibrate"):
        calibration = await calibrate(engine, args.calibration_tokens)
    if args.prefill_step_budget_ms > 0 and calibration:
        model = PrefillCostModel(calibration)
        chunk = model.chunk_tokens_for(
            args.prefill_step_budget_ms / 1000, config.block_tokens, engine.max_model_len
        )
        engine.config = dataclasses.replace(engine.config, prefill_chunk_tokens=chunk)
        log.info(
            "prefill chunk of %d tokens fits the %.0f ms step budget",
            chunk,
            args.prefill_step_budget_ms,
        )
    return engine, calibration


async def _serve_until_stopped(
    args: argparse.Namespace, worker: WorkerBase, port: int, stages_s: dict[str, float]
) -> None:
    """Say the worker is ready, then wait for SIGTERM/SIGINT, a Drain RPC or the parent's
    death; after a signal or a drain, until every request here has finished or moved."""
    signalled = _event_on_signals()
    parent_gone = asyncio.Event()
    watcher = (
        asyncio.create_task(_watch_parent(args.parent_pid, parent_gone))
        if args.parent_pid
        else None
    )
    if args.ready_file:
        _write_ready(args.ready_file, worker, f"127.0.0.1:{port}", stages_s)
    log.info("%s worker %s serving on 127.0.0.1:%d", args.role, args.id, port)
    await _first_of(signalled, parent_gone, worker.drain_requested)
    if not parent_gone.is_set():  # SIGTERM or a Drain RPC: let what runs here finish or move
        if signalled.is_set():
            worker.start_drain(args.drain_grace_s)
        await _first_of_tasks(worker.drained(), parent_gone.wait())
    if watcher is not None:
        watcher.cancel()


async def _first_of(*events: asyncio.Event) -> None:
    await _first_of_tasks(*(event.wait() for event in events))


async def _first_of_tasks(*awaitables: Awaitable[object]) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``parent_pid`` is no longer our parent (it died: we were re-parented)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("parent process %d is gone; stopping", parent_pid)
    stop.set()


def _write_ready(path: Path, worker: WorkerBase, address: str, stages_s: dict[str, float]):
    info = {
        "stages_s": stages_s,
        "worker_id": worker.worker_id,
        "role": worker.role,
        "address": address,
        "pid": os.getpid(),
        "model_fingerprint": worker.engine.loaded.fingerprint,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_adapter.serving.worker_main", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--log-level", default="INFO")
    configure(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.id} %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve_worker(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
