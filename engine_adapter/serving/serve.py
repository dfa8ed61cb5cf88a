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
import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_adapter.serving.admission import DEFAULT_TIMEOUT_S, AdmissionConfig
from engine_adapter.serving.api_keys import ApiKeys, admin_key
from engine_adapter.serving.balancer import (
    DEFAULT_BUCKET_BOUNDS_TOKENS,
    POLICIES,
    BalancerConfig,
)
from engine_adapter.serving.http_limits import FrontLimits, guarded_h11_protocol
from engine_adapter.serving.request_log import ServingStats
from engine_adapter.serving.worker_flags import add_worker_tuning_arguments, tuning_argv
from engine_adapter.serving.worker_tls import WorkerTLS, worker_tls_for
from kvstore.cli.args import duration_arg, list_arg, size_arg
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable

if TYPE_CHECKING:
    from engine_adapter.serving.router import Router

log = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000  # vLLM's and SGLang's habit
STARTUP_TIMEOUT_S = 300.0  # loading the default model takes 15-60 s on a busy 2-core machine
STOP_TIMEOUT_S = 10.0
STOP_GRACE_S = 2.0  # in-flight RPCs get this long when the router stops
SUPERVISE_INTERVAL_S = 1.0
STARTUP_PROGRESS_S = 15.0  # a "still waiting for" line this often while workers start
DEFAULT_MAX_WAITING_REQUESTS = 64
DEFAULT_MAX_QUEUE_WAIT_S = 30.0
DEFAULT_STATS_INTERVAL_S = 10.0
_POLL_S = 0.1
WORKER_MODULE = "engine_adapter.serving.worker_main"  # python -m: one worker process


@dataclass
class WorkerProcess:
    """One worker process this process started."""

    worker_id: str
    role: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    address: str = ""
    port: int = 0
    spawned_s: float = 0.0  # time.monotonic() when started

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerPool:
    """Prefill and decode worker processes, started and stopped by this process."""

    def __init__(
        self,
        cluster_toml: Path,
        run_dir: Path,
        model: str,
        worker_args: Sequence[str] = (),
    ) -> None:
        self.cluster_toml = Path(cluster_toml)
        self.run_dir = Path(run_dir)
        self.model = model
        self.worker_args = list(worker_args)
        self.workers: dict[str, WorkerProcess] = {}
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)

    @classmethod
    def start(
        cls,
        cluster_toml: str | Path,
        run_dir: str | Path,
        *,
        num_prefill: int = 2,
        num_decode: int = 1,
        model: str = "default",
        worker_args: Sequence[str] = (),
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> WorkerPool:
        """Start the workers (p0.., d0..) and wait until every one serves."""
        pool = cls.spawn_all(cluster_toml, run_dir, num_prefill, num_decode, model, worker_args)
        try:
            pool.wait_ready(startup_timeout_s)
        except BaseException:
            pool.stop()
            raise
        return pool

    @classmethod
    def spawn_all(
        cls,
        cluster_toml: str | Path,
        run_dir: str | Path,
        num_prefill: int,
        num_decode: int,
        model: str,
        worker_args: Sequence[str] = (),
    ) -> WorkerPool:
        """Start the worker processes without waiting (they load the model meanwhile)."""
        if num_prefill < 1 or num_decode < 1:
            raise InvalidArgument("serving needs at least one prefill and one decode worker")
        pool = cls(Path(cluster_toml), Path(run_dir), model, worker_args)
        for role, prefix, count in (("prefill", "p", num_prefill), ("decode", "d", num_decode)):
            for index in range(count):
                pool.spawn(f"{prefix}{index}", role)
        return pool

    def spawn(
        self, worker_id: str, role: str, port: int = 0, extra_args: Sequence[str] = ()
    ) -> WorkerProcess:
        """Start one worker in its own session, logging to ``run_dir/logs/<id>.log``."""
        ready_file = self.run_dir / f"{worker_id}.ready.json"
        ready_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", WORKER_MODULE, role, "--id", worker_id]
        command += ["--cluster", str(self.cluster_toml), "--model", self.model]
        command += ["--port", str(port), "--ready-file", str(ready_file)]
        command += ["--parent-pid", str(os.getpid()), *self.worker_args, *extra_args]
        with open(self.run_dir / "logs" / f"{worker_id}.log", "ab") as log_file:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = WorkerProcess(
            worker_id, role, proc, ready_file, port=port, spawned_s=time.monotonic()
        )
        self.workers[worker_id] = worker
        return worker

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until every worker wrote its ready file; Unavailable if one exits or is late."""
        start_s = time.monotonic()
        deadline_s, progress_s = start_s + timeout_s, start_s + STARTUP_PROGRESS_S
        waiting = [w for w in self.workers.values() if not w.address]
        while waiting:
            for worker in list(waiting):
                if self._read_ready(worker):
                    waiting.remove(worker)
                elif not worker.alive:
                    raise Unavailable(
                        self._failure(worker, f"exited with {worker.proc.returncode}")
                    )
            now_s = time.monotonic()
            if waiting and now_s > deadline_s:
                raise Unavailable(self._failure(waiting[0], f"not ready after {timeout_s} s"))
            if waiting and now_s > progress_s:
                names = ", ".join(w.worker_id for w in waiting)
                log.info("start-up: still waiting for %s (%.0f s so far)", names, now_s - start_s)
                progress_s = now_s + STARTUP_PROGRESS_S
            if waiting:
                time.sleep(_POLL_S)

    def _read_ready(self, worker: WorkerProcess) -> bool:
        try:
            info = json.loads(worker.ready_file.read_text())
        except (OSError, ValueError):
            return False
        worker.address = info["address"]
        worker.port = int(worker.address.rpartition(":")[2])
        stages = ", ".join(f"{k} {v:.1f} s" for k, v in info.get("stages_s", {}).items())
        log.info(
            "start-up: %s worker %s ready on %s after %.1f s (%s)",
            worker.role,
            worker.worker_id,
            worker.address,
            time.monotonic() - worker.spawned_s,
            stages or "no stages reported",
        )
        return True

    def _failure(self, worker: WorkerProcess, what: str) -> str:
        path = self.run_dir / "logs" / f"{worker.worker_id}.log"
        lines = path.read_text(errors="replace").splitlines()[-15:] if path.exists() else []
        return (
            f"{worker.role} worker {worker.worker_id} {what}; last lines of {path}:\n"
            + "\n".join(lines)
        )

    def addresses(self, role: str) -> list[str]:
        return [w.address for w in self.workers.values() if w.role == role]

    def pids(self) -> dict[str, int]:
        return {w.worker_id: w.proc.pid for w in self.workers.values()}

    def kill(self, worker_id: str) -> None:
        """SIGKILL one worker (a crash) and reap it."""
        worker = self.workers[worker_id]
        worker.proc.kill()
        worker.proc.wait()

    def add(self, worker_id: str, role: str, extra_args: Sequence[str] = ()) -> WorkerProcess:
        """Start one more worker and wait until it serves (scale up)."""
        if worker_id in self.workers:
            raise InvalidArgument(f"worker {worker_id} exists; pick another id")
        worker = self.spawn(worker_id, role, extra_args=extra_args)
        self.wait_ready()
        return worker

    def remove(self, worker_id: str) -> None:
        """Stop one worker and forget it (scale down); routers must drop its address."""
        _stop_process(self.workers.pop(worker_id).proc)

    def restart(self, worker_id: str, extra_args: Sequence[str] = ()) -> None:
        """Stop the worker if it runs, start it on its port with ``extra_args``; wait."""
        worker = self.workers[worker_id]
        if worker.alive:
            _stop_process(worker.proc)
        self.spawn(worker_id, worker.role, worker.port, extra_args)
        self.wait_ready()

    def restart_dead(self) -> list[str]:
        """Start again, on the same port, every worker that crashed after it served.

        A worker that dies before it serves is not restarted (it would likely die again);
        the router keeps routing around it.
        """
        for worker in self.workers.values():
            if not worker.address:
                self._read_ready(worker)
        # Exit status 0 is a worker that drained and stopped on purpose (SIGTERM from
        # outside, or `kvstore serve drain`): it stays stopped.
        dead = [w for w in self.workers.values() if w.address and not w.alive and w.proc.returncode]
        for worker in dead:
            log.warning(
                "%s worker %s exited with %s; restarting it on port %d",
                worker.role,
                worker.worker_id,
                worker.proc.returncode,
                worker.port,
            )
            self.spawn(worker.worker_id, worker.role, worker.port)
        return [w.worker_id for w in dead]

    def stop(self) -> None:
        """SIGTERM every worker, wait, SIGKILL what is left. Safe to call twice."""
        for worker in self.workers.values():
            if worker.alive:
                worker.proc.terminate()
        deadline_s = time.monotonic() + STOP_TIMEOUT_S
        for worker in self.workers.values():
            try:
                worker.proc.wait(max(deadline_s - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                log.warning("worker %s ignored SIGTERM; sending SIGKILL", worker.worker_id)
                worker.proc.kill()
                worker.proc.wait()
        atexit.unregister(self.stop)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it is still there after STOP_TIMEOUT_S (a loaded machine)."""
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while inside, so ``finally`` blocks stop children."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cancel_on_signals() -> None:
    """In a running event loop: SIGTERM and SIGINT cancel the current task.

    Raising from a plain signal handler could land inside any callback of the loop; a
    cancelled task unwinds through its ``finally`` blocks and ``asyncio.run`` then raises
    CancelledError.
    """
    task = asyncio.current_task()
    assert task is not None, "cancel_on_signals() must be called from a task"
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)


@dataclass(frozen=True)
class FrontConfig:
    """How ``kvstore serve`` faces its users."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT  # the OpenAI-compatible HTTP front; 0: any free port
    grpc_port: int | None = None  # the router's gRPC face (ServingClient); None: off
    model: str = "default"
    served_model_name: str = ""  # "" = loader.model_name(model)
    api_keys: Path | None = None
    api_key_values: tuple[str, ...] = ()  # --api-key: keys of tenant "default"
    admin_key_file: Path | None = None
    policy: str = "balanced"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    request_timeout_s: float = DEFAULT_TIMEOUT_S
    limits: FrontLimits = field(default_factory=FrontLimits)
    bucket_bounds_tokens: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS_TOKENS
    log_requests: bool = True
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S  # 0: no stats line

    def __post_init__(self) -> None:
        wait_s = self.admission.max_queue_wait_s
        if not self.request_timeout_s > 0 or wait_s >= self.request_timeout_s:
            raise ValueError(
                f"request timeout {self.request_timeout_s} s: give a positive one, above the "
                f"longest queue wait ({wait_s} s)"
            )

    def keys(self) -> ApiKeys:
        """The API keys and the admin key (a new one is written where none exists)."""
        admin = admin_key(self.admin_key_file) if self.admin_key_file else None
        return ApiKeys.load(self.api_keys, self.api_key_values, admin)


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
                await asyncio.sleep(_POLL_S)
            return self.servers[0].sockets[0].getsockname()[1]

    return HttpServer(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                     lifespan="off", access_log=False, http=protocol,
                                     timeout_keep_alive=keep_alive_s))  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore serve``."""
    defaults = FrontConfig()
    parser.add_argument("--cluster", required=True, type=Path, help="the store's cluster.toml")
    _add_front_flags(parser, defaults)
    _add_limit_flags(parser, defaults)
    _add_worker_flags(parser, defaults)
    _add_router_flags(parser, defaults)
    _add_log_flags(parser, defaults)
    add_worker_tuning_arguments(parser)


def _add_front_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """Where the HTTP front (and the gRPC face) listen, and whom they serve."""
    parser.add_argument("--host", default=defaults.host, help="HTTP (and gRPC) address to bind")
    parser.add_argument(
        "--port",
        type=int,
        default=defaults.port,
        help="OpenAI-compatible HTTP port, 0: any free one",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve the router's gRPC face (ServingClient) here, 0: any (default: off)",
    )
    parser.add_argument(
        "--api-keys",
        type=Path,
        help='TOML file with a [keys] table of "KEY" = "TENANT" (default: none; without it '
        "and --api-key there is no auth and every request is tenant 'default')",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an API key of tenant 'default', as vllm serve's (repeat the flag for more)",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        help="file with the key /admin/* needs (kvstore serve drain); made, mode 0600, if "
        "missing (default: RUN_DIR/admin.key)",
    )
    parser.add_argument(
        "--served-model-name",
        default="",
        help="the model name clients send (default: the model's name, e.g. SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--tls-cert-file",
        type=Path,
        help="with a TLS cluster: the certificate (of its CA, for 127.0.0.1) router and workers "
        "talk over (default: issued from the CA key beside the cluster's CA file, if there)",
    )
    parser.add_argument("--tls-key-file", type=Path, help="the key of --tls-cert-file")


def _add_limit_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """Limits against floods and slow clients."""
    limits = defaults.limits
    parser.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        help="open HTTP connections; more are answered 503 and closed",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=size_arg,
        default=limits.max_body_bytes,
        help="largest request body (e.g. 2MiB); larger ones get 413 before they are read",
    )
    parser.add_argument(
        "--header-timeout-s",
        type=duration_arg,
        default=limits.header_timeout_s,
        help="seconds a client has to send a request's headers (else 408, closed)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=duration_arg,
        default=limits.body_timeout_s,
        help="seconds a client has to send the whole body after the headers (else 408, closed)",
    )


def _add_worker_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """How many workers of each role, running which model."""
    parser.add_argument(
        "--prefill-workers",
        type=int,
        default=2,
        help="prefill worker processes",
    )
    parser.add_argument(
        "--decode-workers",
        type=int,
        default=1,
        help="decode worker processes",
    )
    parser.add_argument(
        "--model",
        default=defaults.model,
        help="which model: 'default' is SmolLM2-135M-Instruct; also random:<size>, a .gguf "
        "file or a safetensors dir; default: %(default)s",
    )


def _add_router_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """How the router picks prefill workers and queues requests; where the workers log."""
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default=defaults.policy,
        help="how prefill workers are picked",
    )
    parser.add_argument(
        "--bucket-bounds",
        type=list_arg(int),
        default=DEFAULT_BUCKET_BOUNDS_TOKENS,
        help="prompt-length bucket bounds in tokens (<16K, 16-64K, 64-256K, >=256K)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=duration_arg,
        default=defaults.request_timeout_s,
        help="a request's deadline, from its arrival to its last token",
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=0,
        help="requests sent to the workers at once (0: prefill workers + 2 x decode workers, "
        "what they serve without queueing out of sight)",
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests queued for a worker; more get 429 at once (0: no limit)",
    )
    parser.add_argument(
        "--max-queue-wait-s",
        type=duration_arg,
        default=DEFAULT_MAX_QUEUE_WAIT_S,
        help="longest wait in the queue: a request that waited this long, or would by the "
        "rate requests finish, gets 429 with Retry-After (0: up to its deadline)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="worker logs and ready files (default: a new temporary directory)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=duration_arg,
        default=STARTUP_TIMEOUT_S,
        help="how long the workers may take to load the model and calibrate",
    )


def _add_log_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """The request log and the stats line (vllm serve's flags)."""
    parser.add_argument(
        "--disable-log-requests", action="store_true", help="no log line per request"
    )
    parser.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    parser.add_argument(
        "--stats-interval-s",
        type=duration_arg,
        default=defaults.stats_interval_s,
        help="seconds between two stats lines (logged only while something happens)",
    )


def front_config(args: argparse.Namespace, run_dir: Path) -> FrontConfig:
    """The FrontConfig of parsed ``kvstore serve`` flags; ValueError/KVStoreError if bad."""
    max_running = args.max_running_requests or args.prefill_workers + 2 * args.decode_workers
    front = FrontConfig(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        model=args.model,
        served_model_name=args.served_model_name,
        api_keys=args.api_keys,
        api_key_values=tuple(args.api_key),
        admin_key_file=args.admin_key_file or run_dir / "admin.key",
        policy=args.policy,
        admission=AdmissionConfig(max_running, args.max_waiting_requests, args.max_queue_wait_s),
        request_timeout_s=args.request_timeout_s,
        limits=FrontLimits(
            max_connections=args.max_connections,
            header_timeout_s=args.header_timeout_s,
            body_timeout_s=args.body_timeout_s,
            max_body_bytes=args.max_body_bytes,
        ),
        bucket_bounds_tokens=BalancerConfig(
            bucket_bounds_tokens=tuple(args.bucket_bounds)
        ).bucket_bounds_tokens,
        log_requests=not args.disable_log_requests,
        stats_interval_s=0.0 if args.disable_log_stats else args.stats_interval_s,
    )
    front.keys()  # a bad key file fails before the workers start
    return front


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
