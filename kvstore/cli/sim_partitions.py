"""The partitioned simulator's shell: the store's placement hash, and Ray to run the tasks.

``kvstore sim --partitions P`` splits a trace's blocks over P partitions exactly as a cluster of
P placement groups splits its keys (``kvstore.placement.groups_of_keys``, rendezvous over
xxh3_64), each partition with its share of the capacity; ``ttl.partition`` has the pure steps
and why they combine exactly. A block of a trace has no token ids, so its key is made from its
64-bit identity (``identity_keys``: 16 well-mixed bytes, like the xxh3-128 digests
``client.block_keys`` gives), and the store's own hash places it.

Tasks run on Ray: a local ``ray.init()`` by default (``--workers`` CPUs), or the cluster at
``--ray ADDRESS`` (every node needs this package importable, e.g. installed the same way). ``--ray
none`` runs every task in this process, one after another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.placement import groups_of_keys
from ttl.partition import InlineExecutor, mix64

log = logging.getLogger(__name__)

LOCAL, INLINE = "local", "none"
_KEY_SALT = np.uint64(0x6B76_7374_6F72_6531)  # "kvstore1": the second word's stream


def identity_keys(identities: np.ndarray) -> np.ndarray:
    """16-byte block keys (uint64 [n, 2]) for 64-bit block identities: two mixed words."""
    identities = identities.astype(np.uint64, copy=False)
    zeros = np.zeros_like(identities)
    return np.stack([mix64(identities, zeros), mix64(identities, zeros + _KEY_SALT)], axis=1)


def placement_partitions(identities: np.ndarray, num_partitions: int) -> np.ndarray:
    """The placement group (of ``num_partitions``) the store would put each block in."""
    return groups_of_keys(identity_keys(identities), num_partitions)


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
        if self._started:
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address == LOCAL:
                options["num_cpus"] = num_cpus
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

    def close(self) -> None:
        """Shut Ray down if this executor started it."""
        if self._started:
            self._ray.shutdown()


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
