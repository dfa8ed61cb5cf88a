"""``kvstore serve``: the OpenAI-compatible HTTP front, the router, and its prefill and
decode worker processes.

::

    kvstore serve --cluster DIR/cluster.toml [--host 127.0.0.1] [--port 8000]
                  [--api-keys keys.toml] [--api-key KEY] [--admin-key-file F]
                  [--grpc-port P] [--prefill-workers 2] [--decode-workers 1]
                  [--model default] [--policy balanced] [--run-dir DIR]
                  [--store-transport grpc|auto|ucx] [--request-timeout-s 120]
                  [--max-running-requests N] [--max-waiting-requests 64]
                  [--max-queue-wait-s 30] [--max-connections 1024] [--max-body-bytes 2MiB]
                  [--header-timeout-s 10] [--body-timeout-s 30]
                  [--tls-cert-file F --tls-key-file F] [--stats-interval-s 10]
                  [--disable-log-requests] [--disable-log-stats]

Layout (every box is a process; the store's nodes are started separately)::

  OpenAI client       +--> prefill worker p0 --+   put full blocks    +-------------+
  curl --HTTP--> router                        +--------------------> | kvstore     |
  (ServingClient      +--> prefill worker p1 --+                      | 12 nodes    |
   over gRPC)         |                                               | (10+2 EC)   |
                      +--> decode worker d0  <------------------------+-------------+
                           (handoff: token ids,  get_into full blocks
                            tail KV, first token)

The HTTP front (uvicorn) and the router's gRPC face run in one event loop with the router.
Start-up logs each stage with its time (every worker's model load, store connection and
calibration; the router; the front), also when stderr is no terminal; then one line per
request and a stats line every ``--stats-interval-s`` (``request_log.py``). When the cluster
runs TLS, so do the router's channels to its workers (``worker_tls.py``). This module imports
no torch (``kvstore serve --help`` stays fast): the workers are processes of their own.
Worker processes run in their own sessions (a terminal's Ctrl-C reaches only this process,
which then stops them in order), watch this process (they exit if it dies, even by SIGKILL)
and are stopped on exit, on SIGTERM/SIGINT and by ``atexit``: no orphans. A worker that
crashes is restarted on its port; the router stops sending it requests until its Health
answers. A worker that exits 0 (drained) stays stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_adapter.serving.api_keys import ApiKeys
from engine_adapter.serving.balancer import BalancerConfig
from engine_adapter.serving.front_config import FrontConfig, configure, front_config
from engine_adapter.serving.http_limits import guarded_h11_protocol
from engine_adapter.serving.request_log import ServingStats
from engine_adapter.serving.worker_flags import tuning_argv
from engine_adapter.serving.worker_pool import POLL_S, WorkerPool, cancel_on_signals
from engine_adapter.serving.worker_tls import WorkerTLS, worker_tls_for
from kvstore.cli.signals import sigterm_as_interrupt
from kvstore.errors import KVStoreError

if TYPE_CHECKING:
    from engine_adapter.serving.router import Router

__all__ = ["configure", "run", "serve_router"]  # configure, run: the command table's (kvstore/cli)

log = logging.getLogger(__name__)

STOP_GRACE_S = 2.0  # in-flight RPCs get this long when the router stops
SUPERVISE_INTERVAL_S = 1.0


async def serve_router(pool: WorkerPool, front: FrontConfig, tls: WorkerTLS | None = None) -> None:
    """Serve the HTTP front (and the gRPC face) until cancelled; restart crashed workers."""
    # Imported here, not at the top: `kvstore serve --help` must stay fast (no torch, no
    # FastAPI); the router's process needs the loader only for the tokenizer.
    from engine_adapter.loader import load_tokenizer, model_name
    from engine_adapter.serving.metrics import RouterMetrics
    from engine_adapter.serving.openai_api import create_app
    from engine_adapter.serving.router import Router

    cancel_on_signals()
    start_s = time.monotonic()
    api_keys = front.keys()
    with _stage("tokenizer loaded"):
        tokenizer = await asyncio.to_thread(load_tokenizer, front.model)
    name = front.served_model_name or model_name(front.model)
    router = Router(
        pool.addresses("prefill"),
        pool.addresses("decode"),
        policy=front.policy,
        balancer=BalancerConfig(bucket_bounds_tokens=front.bucket_bounds_tokens),
        tokenizer=tokenizer,
        metrics=RouterMetrics(model_name=name),
        admission=front.admission,
        timeout_s=front.request_timeout_s,
        credentials=tls.channel_credentials() if tls is not None else None,
    )
    with _stage(f"router connected to {len(router.endpoints)} workers"):
        await router.start()
    try:
        stats = ServingStats()
        app = create_app(router, name, api_keys, limits=front.limits, stats=stats,
                         log_requests=front.log_requests)  # fmt: skip
        await _serve_front(pool, front, router, app, stats, tls, start_s, name, api_keys)
    finally:
        await router.close()


async def _serve_front(
    pool: WorkerPool,
    front: FrontConfig,
    router: Router,
    app: object,
    stats: ServingStats,
    tls: WorkerTLS | None,
    start_s: float,
    name: str,
    api_keys: ApiKeys,
) -> None:
    """Serve HTTP (and gRPC) until cancelled: restart crashed workers, log the stats."""
    import grpc

    from engine_adapter.serving import serving_pb2_grpc as pb_grpc
    from engine_adapter.serving.router_service import RouterService
    from engine_adapter.serving.worker_endpoint import CHANNEL_OPTIONS

    closed = router.metrics.closed_connections.labels
    protocol = guarded_h11_protocol(front.limits, lambda reason: closed(reason).inc())
    http = _http_server(app, front.host, front.port, protocol, front.limits.keep_alive_s)
    grpc_server, grpc_line = None, ""
    if front.grpc_port is not None:
        grpc_server = grpc.aio.server(options=CHANNEL_OPTIONS)
        pb_grpc.add_RouterServicer_to_server(RouterService(router), grpc_server)
        address = f"{front.host}:{front.grpc_port}"
        if tls is None:
            bound = grpc_server.add_insecure_port(address)
        else:
            bound = grpc_server.add_secure_port(address, tls.face_credentials())
        await grpc_server.start()
        grpc_line = f", gRPC {front.host}:{bound}" + (" (TLS)" if tls is not None else "")
    http_task = asyncio.create_task(http.serve())
    try:
        port = await http.bound_port()
        auth = "API keys" if api_keys.enabled else "no auth"
        admin = f"; admin key file {front.admin_key_file}" if front.admin_key_file else ""
        print(
            f"kvstore serve: http://{front.host}:{port}/v1 ({name}, {auth}){grpc_line}; "
            f"run dir {pool.run_dir}{admin}; workers: {pool.pids()}",
            flush=True,
        )
        log.info("start-up: serving http://%s:%d/v1 after %.1f s (router and front; worker "
                 "channels %s)", front.host, port, time.monotonic() - start_s,
                 "over TLS" if tls is not None else "plaintext on 127.0.0.1")  # fmt: skip
        await _supervise(pool, front, router, stats, http_task)
    finally:
        http.should_exit = True
        await asyncio.gather(http_task, return_exceptions=True)
        if grpc_server is not None:
            await grpc_server.stop(STOP_GRACE_S)


async def _supervise(
    pool: WorkerPool,
    front: FrontConfig,
    router: Router,
    stats: ServingStats,
    http_task: asyncio.Task[None],
) -> None:
    """Each second restart crashed workers; every stats interval log what happened."""
    last, last_s = stats.snapshot(), time.monotonic()
    while not http_task.done():
        await asyncio.sleep(SUPERVISE_INTERVAL_S)
        pool.restart_dead()
        now_s = time.monotonic()
        if front.stats_interval_s and now_s - last_s >= front.stats_interval_s:
            busy = router.num_running + router.num_waiting
            if stats.num_by_status != last.num_by_status or busy:
                queued = router.admission.num_waiting
                running = router.num_running + router.num_waiting - queued
                log.info("%s", stats.line(last, now_s - last_s, running, queued))
            last, last_s = stats.snapshot(), now_s
    await http_task  # uvicorn exited by itself: its error, if any


@contextlib.contextmanager
def _stage(what: str) -> Iterator[None]:
    """Log one start-up stage with its time."""
    start_s = time.monotonic()
    yield
    log.info("start-up: %s (%.1f s)", what, time.monotonic() - start_s)


def _http_server(app: object, host: str, port: int, protocol: type, keep_alive_s: int) -> Any:
    """uvicorn inside our event loop; signals stay ours (they cancel ``serve_router``)."""
    import uvicorn

    class HttpServer(uvicorn.Server):
        def capture_signals(self) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        async def bound_port(self) -> int:
            """The port uvicorn listens on, once it does (``port`` 0 picks a free one)."""
            while not self.started:
                await asyncio.sleep(POLL_S)
            return self.servers[0].sockets[0].getsockname()[1]

    return HttpServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                     lifespan="off", access_log=False, http=protocol,
                                     timeout_keep_alive=keep_alive_s))  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Start the workers and the router; serve until SIGTERM or Ctrl-C."""
    if not args.cluster.is_file():
        print(f"error: no cluster config at {args.cluster}", file=sys.stderr)
        return 1
    # Start-up stages, request lines and stats are INFO, shown whatever --log-level says.
    serving_log = logging.getLogger("engine_adapter.serving")
    serving_log.setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="kvstore-serve-"))
    try:
        front = front_config(args, run_dir)
        tls = worker_tls_for(args.cluster, args.tls_cert_file, args.tls_key_file, run_dir)
    except (ValueError, KVStoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    worker_args = tuning_argv(args) + (tls.argv() if tls is not None else [])
    worker_args += ["--stall-timeout-s", str(args.request_timeout_s)]  # a wedge: see worker_base
    if args.served_model_name:
        worker_args += ["--served-model-name", args.served_model_name]
    log.info("start-up: %d prefill and %d decode workers loading %s (logs in %s)",
             args.prefill_workers, args.decode_workers, args.model, run_dir / "logs")  # fmt: skip
    try:
        with (
            sigterm_as_interrupt(),
            WorkerPool.start(
                args.cluster,
                run_dir,
                num_prefill=args.prefill_workers,
                num_decode=args.decode_workers,
                model=args.model,
                worker_args=worker_args,
                startup_timeout_s=args.startup_timeout_s,
            ) as pool,
        ):
            asyncio.run(serve_router(pool, front, tls))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("stopped; workers stopped", file=sys.stderr)
    except (KVStoreError, OSError) as exc:
        print(f"error: {exc}\n(worker logs: {run_dir}/logs)", file=sys.stderr)
        return 1
    return 0
