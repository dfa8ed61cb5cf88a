"""``kvstore serve``: the OpenAI-compatible HTTP front, the router, and its prefill and
decode worker processes.

::

    kvstore serve --cluster DIR/cluster.toml [--host 127.0.0.1] [--port 8000]
                  [--api-keys keys.toml] [--grpc-port P] [--prefill-workers 2]
                  [--decode-workers 1] [--model default] [--policy balanced]
                  [--run-dir DIR] [--store-transport grpc|auto|ucx]

Layout (every box is a process; the store's nodes are started separately)::

  OpenAI client       +--> prefill worker p0 --+   put full blocks    +-------------+
  curl --HTTP--> router                        +--------------------> | kvstore     |
  (ServingClient      +--> prefill worker p1 --+                      | 12 nodes    |
   over gRPC)         |                                               | (10+2 EC)   |
                      +--> decode worker d0  <------------------------+-------------+
                           (handoff: token ids,  get_into full blocks
                            tail KV, first token)

The HTTP front (uvicorn) and the router's gRPC face run in one event loop with the router.
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
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn

from engine_adapter.loader import load_tokenizer, model_name
from engine_adapter.serving import serving_pb2_grpc as pb_grpc
from engine_adapter.serving.api_keys import ApiKeys
from engine_adapter.serving.balancer import DEFAULT_BUCKET_BOUNDS_TOKENS, BalancerConfig
from engine_adapter.serving.openai_api import create_app
from engine_adapter.serving.router import CHANNEL_OPTIONS, POLICIES, Router, RouterService
from engine_adapter.serving.worker_main import add_worker_tuning_arguments, tuning_argv
from kvstore.cli.args import list_arg
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable

log = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 8000  # vLLM's and SGLang's habit
STARTUP_TIMEOUT_S = 300.0  # loading the default model takes 15-60 s on a busy 2-core machine
STOP_TIMEOUT_S = 10.0
STOP_GRACE_S = 2.0  # in-flight RPCs get this long when the router stops
SUPERVISE_INTERVAL_S = 1.0
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
        worker = WorkerProcess(worker_id, role, proc, ready_file, port=port)
        self.workers[worker_id] = worker
        return worker

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until every worker wrote its ready file; Unavailable if one exits or is late."""
        deadline_s = time.monotonic() + timeout_s
        waiting = [w for w in self.workers.values() if not w.address]
        while waiting:
            for worker in list(waiting):
                if self._read_ready(worker):
                    waiting.remove(worker)
                elif not worker.alive:
                    raise Unavailable(
                        self._failure(worker, f"exited with {worker.proc.returncode}")
                    )
            if waiting and time.monotonic() > deadline_s:
                raise Unavailable(self._failure(waiting[0], f"not ready after {timeout_s} s"))
            if waiting:
                time.sleep(_POLL_S)

    def _read_ready(self, worker: WorkerProcess) -> bool:
        try:
            info = json.loads(worker.ready_file.read_text())
        except (OSError, ValueError):
            return False
        worker.address = info["address"]
        worker.port = int(worker.address.rpartition(":")[2])
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
        worker = self.workers.pop(worker_id)
        worker.proc.terminate()
        try:
            worker.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()

    def restart(self, worker_id: str, extra_args: Sequence[str] = ()) -> None:
        """Stop the worker if it runs, start it on its port with ``extra_args``; wait."""
        worker = self.workers[worker_id]
        if worker.alive:
            worker.proc.terminate()
            worker.proc.wait(STOP_TIMEOUT_S)
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
    policy: str = "balanced"
    max_waiting_requests: int = 0
    bucket_bounds_tokens: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS_TOKENS


async def serve_router(pool: WorkerPool, front: FrontConfig) -> None:
    """Serve the HTTP front (and the gRPC face) until cancelled; restart crashed workers."""
    cancel_on_signals()
    api_keys = ApiKeys.load(front.api_keys)
    tokenizer = await asyncio.to_thread(load_tokenizer, front.model)
    router = Router(
        pool.addresses("prefill"),
        pool.addresses("decode"),
        policy=front.policy,
        balancer=BalancerConfig(bucket_bounds_tokens=front.bucket_bounds_tokens),
        tokenizer=tokenizer,
        max_waiting_requests=front.max_waiting_requests,
    )
    async with router:
        name = front.served_model_name or model_name(front.model)
        http = _HttpServer(create_app(router, name, api_keys), front.host, front.port)
        grpc_server, grpc_line = None, ""
        if front.grpc_port is not None:
            grpc_server = grpc.aio.server(options=CHANNEL_OPTIONS)
            pb_grpc.add_RouterServicer_to_server(RouterService(router), grpc_server)
            bound = grpc_server.add_insecure_port(f"{front.host}:{front.grpc_port}")
            await grpc_server.start()
            grpc_line = f", gRPC {front.host}:{bound}"
        http_task = asyncio.create_task(http.serve())
        try:
            port = await http.bound_port()
            auth = "API keys" if api_keys.enabled else "no auth"
            print(
                f"kvstore serve: http://{front.host}:{port}/v1 ({name}, {auth}){grpc_line}; "
                f"run dir {pool.run_dir}; workers: {pool.pids()}",
                flush=True,
            )
            while not http_task.done():
                await asyncio.sleep(SUPERVISE_INTERVAL_S)
                pool.restart_dead()
            await http_task  # uvicorn exited by itself: its error, if any
        finally:
            http.should_exit = True
            await asyncio.gather(http_task, return_exceptions=True)
            if grpc_server is not None:
                await grpc_server.stop(STOP_GRACE_S)


class _HttpServer(uvicorn.Server):
    """uvicorn inside our event loop; signals stay ours (they cancel ``serve_router``)."""

    def __init__(self, app: object, host: str, port: int) -> None:
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        lifespan="off", access_log=False))  # fmt: skip

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    async def bound_port(self) -> int:
        """The port uvicorn listens on, once it does (``port`` 0 picks a free one)."""
        while not self.started:
            await asyncio.sleep(_POLL_S)
        return self.servers[0].sockets[0].getsockname()[1]


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore serve``."""
    defaults = FrontConfig()
    parser.add_argument("--cluster", required=True, type=Path, help="the store's cluster.toml")
    _add_front_flags(parser, defaults)
    _add_worker_flags(parser, defaults)
    _add_router_flags(parser, defaults)
    add_worker_tuning_arguments(parser)


def _add_front_flags(parser: argparse.ArgumentParser, defaults: FrontConfig) -> None:
    """Where the HTTP front (and the gRPC face) listen, and whom they serve."""
    parser.add_argument(
        "--host",
        default=defaults.host,
        help="HTTP (and gRPC) address to bind",
    )
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
        help='TOML file with a [keys] table of "KEY" = "TENANT" (default: none, no auth, '
        "every request is tenant 'default')",
    )
    parser.add_argument(
        "--served-model-name",
        default="",
        help="the model name clients send (default: the model's name, e.g. SmolLM2-135M-Instruct)",
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
        "--max-waiting-requests",
        type=int,
        default=0,
        help="requests that may wait for their first token before new ones get 429 (0: no limit)",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="worker logs and ready files (default: a new temporary directory)",
    )


def run(args: argparse.Namespace) -> int:
    """Start the workers and the router; serve until SIGTERM or Ctrl-C."""
    if not args.cluster.is_file():
        print(f"error: no cluster config at {args.cluster}", file=sys.stderr)
        return 1
    try:
        front = FrontConfig(
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
            model=args.model,
            served_model_name=args.served_model_name,
            api_keys=args.api_keys,
            policy=args.policy,
            max_waiting_requests=args.max_waiting_requests,
            bucket_bounds_tokens=BalancerConfig(
                bucket_bounds_tokens=args.bucket_bounds
            ).bucket_bounds_tokens,
        )
        BalancerConfig(bucket_bounds_tokens=front.bucket_bounds_tokens)  # checks the bounds
        ApiKeys.load(front.api_keys)  # a bad key file fails before the workers start
    except (ValueError, KVStoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="kvstore-serve-"))
    worker_args = tuning_argv(args)
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
            ) as pool,
        ):
            asyncio.run(serve_router(pool, front))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("stopped; workers stopped", file=sys.stderr)
    except (KVStoreError, OSError) as exc:
        print(f"error: {exc}\n(worker logs: {run_dir}/logs)", file=sys.stderr)
        return 1
    return 0
