"""The partitioned simulator's shell: the store's placement hash, and Ray to run the tasks.

``kvstore sim --partitions P`` splits a trace's blocks over P partitions exactly as a cluster of
P placement groups splits its keys (``kvstore.placement.groups_of_keys``, rendezvous over
xxh3_64; ``weighted_placement`` for a map whose groups weigh differently), each partition with
its share of the capacity; ``ttl.partition`` has the pure steps and why they combine exactly. A
block of a trace has no token ids, so its key is made from its 64-bit identity
(``identity_keys``: 16 well-mixed bytes, like the xxh3-128 digests ``client.block_keys``
gives), and the store's own hash places it: in a split's one C pass where ``ttl/_simloop.so``
is built (``ttl.partition.StorePlacement``), else here.

Tasks run on Ray: a local ``ray.init()`` by default (``--workers`` CPUs), or the cluster at
``--ray ADDRESS`` (every node needs this package importable, e.g. installed the same way). ``--ray
none`` runs every task in this process, one after another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.placement import groups_of_keys
from ttl.partition import InlineExecutor, StorePlacement
from ttl.traces import mix64

log = logging.getLogger(__name__)

LOCAL, INLINE = "local", "none"
_KEY_SALT = np.uint64(0x6B76_7374_6F72_6531)  # "kvstore1": the second word (simloop.c: KEY_SALT)


def identity_keys(identities: np.ndarray) -> np.ndarray:
    """16-byte block keys (uint64 [n, 2]) for 64-bit block identities: two mixed words."""
    identities = identities.astype(np.uint64, copy=False)
    zeros = np.zeros_like(identities)
    return np.stack([mix64(identities, zeros), mix64(identities, zeros + _KEY_SALT)], axis=1)


def _place(
    identities: np.ndarray, num_partitions: int, weights: tuple[int, ...] | None = None
) -> np.ndarray:
    """The placement group (of ``num_partitions``, with ``weights``: the groups' integer
    weights, None: equal) the store would put each block in."""
    return groups_of_keys(identity_keys(identities), num_partitions, weights)


placement_partitions = StorePlacement(_place)  # equal groups: P placement groups of a map


def weighted_placement(weights: tuple[int, ...]) -> StorePlacement:
    """The placement of a map whose groups weigh ``weights``
    (``kvstore.placement_weights.map_group_weights``)."""
    return StorePlacement(_place, tuple(weights))


class RayExecutor:
    """``ttl.partition.Executor`` on Ray: each submit is one Ray task."""

    def __init__(self, address: str = LOCAL, num_cpus: int | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError(
                "--partitions runs on Ray, which is not installed: pip install 'kvstore[ray]' "
                "(or pass --ray none to run the partitions in this process)"
            ) from None
        self._ray = ray
        self._started = not ray.is_initialized()
        self._temp_dir: str | None = None
        if self._started:
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address == LOCAL:
                options["num_cpus"] = num_cpus
                self._start_local(options)
            else:
                options["address"] = address
                ray.init(**options)
        self._task = ray.remote(_call)
        self._cpu_handles: list[Any] = []

    def submit(self, fn: Callable[..., Any], *args: Any, num_returns: int = 1) -> Any:
        """One Ray task; it also returns its CPU seconds, which ``task_cpu_s`` adds up."""
        task = self._task.options(num_returns=num_returns + 1)
        *handles, cpu_handle = task.remote(fn, num_returns, *args)
        self._cpu_handles.append(cpu_handle)
        return handles if num_returns > 1 else handles[0]

    def put(self, value: Any) -> Any:
        return self._ray.put(value)

    def get(self, handles: Sequence[Any]) -> list[Any]:
        return list(self._ray.get(list(handles)))

    def task_cpu_s(self) -> float:
        """CPU seconds of the tasks submitted so far, each measured in its worker process."""
        return float(sum(self._ray.get(self._cpu_handles)))

    def _start_local(self, options: dict[str, Any]) -> None:
        """``ray.init()`` of a local node in a temp dir of its own. Ray gives its raylet a
        fixed 30 s to register (``ray/_private/node.py``), which a loaded machine can miss:
        then the half-started node's processes (found by that dir) are stopped and it starts
        again, up to ``_LOCAL_START_ATTEMPTS`` times."""
        self._temp_dir = tempfile.mkdtemp(prefix="kvsray-")
        for attempt in range(1, _LOCAL_START_ATTEMPTS + 1):
            try:
                self._ray.init(_temp_dir=self._temp_dir, **options)
                return
            except Exception as error:
                if "timed out during startup" not in str(error):
                    self._remove_temp_dir()
                    raise
                _stop_processes_of(self._temp_dir)
                if attempt == _LOCAL_START_ATTEMPTS:
                    self._remove_temp_dir()
                    raise ValueError(
                        f"a local Ray node did not start in {attempt} attempts (Ray gives each "
                        "30 s; is the machine overloaded?); --ray none runs the partitions in "
                        "this process"
                    ) from error
                log.warning("local Ray node missed Ray's 30 s start limit; starting it again")

    def _remove_temp_dir(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def close(self) -> None:
        """Shut Ray down if this executor started it."""
        if self._started:
            self._ray.shutdown()
            self._remove_temp_dir()


_LOCAL_START_ATTEMPTS = 3


def _stop_processes_of(temp_dir: str) -> None:
    """SIGKILL, by pid, every process of a failed local Ray start: those whose command line
    names ``temp_dir`` (its GCS, raylet and agents get the session dir) and this process's
    own Ray reaper child (its only one: Ray was not running here before)."""
    me = os.getpid()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if temp_dir.encode() in cmdline or (parent == me and b"ray_process_reaper" in cmdline):
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


def _call(fn: Callable[..., Any], num_returns: int, *args: Any) -> Any:
    """Run ``fn`` in a Ray worker and return its result(s) and the CPU seconds it took; lists
    of object refs among the arguments arrive as values (Ray resolves only refs passed
    directly)."""
    import ray

    def resolve(arg: Any) -> Any:
        if isinstance(arg, list) and arg and isinstance(arg[0], ray.ObjectRef):
            return ray.get(arg)
        return arg

    resolved = [resolve(arg) for arg in args]  # waiting for inputs is not this task's CPU
    start_s = time.process_time()
    result = fn(*resolved)
    cpu_s = time.process_time() - start_s
    return (*result, cpu_s) if num_returns > 1 else (result, cpu_s)


def make_executor(address: str, num_cpus: int | None) -> InlineExecutor | RayExecutor:
    """The executor ``--ray`` names: ``none`` (this process), ``local`` or a cluster address."""
    if address == INLINE:
        return InlineExecutor()
    return RayExecutor(address, num_cpus)
