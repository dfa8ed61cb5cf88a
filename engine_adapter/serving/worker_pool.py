"""The worker processes of ``kvstore serve``: started in their own sessions, watched until
ready, restarted when they crash, stopped in order (SIGTERM, then SIGKILL past a wait), and
the signal handling that makes sure they are (serve.py's module doc has the whole story).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # loading the default model takes 15-60 s on a busy 2-core machine
STOP_TIMEOUT_S = 10.0
STARTUP_PROGRESS_S = 15.0  # a "still waiting for" line this often while workers start
POLL_S = 0.1
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
                time.sleep(POLL_S)

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
