"""The ceilings a swap-in is measured against, measured in the same run: copies of its bytes.

``kvstore bench swapin`` and ``kvstore bench engine`` put these in their JSON (``limits``), so
every figure carries the limit of the machine it ran on: a host memcpy of the same bytes (what
a client that copies every byte once pays) and, on CUDA, a copy of them from pinned host
memory to the device (the PCIe ceiling of the swap-in's last hop).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

GB = 1e9


def copy_limits(num_bytes: int, device: torch.device, rounds: int) -> dict[str, float]:
    """The ceilings of a fetch of ``num_bytes``, measured now: one host memcpy of them, and on
    CUDA a copy from pinned host memory to the device (best of ``rounds``; GB/s)."""
    source = np.full(num_bytes, 7, np.uint8)
    target = np.empty_like(source)
    limits = {
        "host_copy_gb_per_s": _best_gb_per_s(lambda: np.copyto(target, source), num_bytes, rounds)
    }
    if device.type == "cuda":
        pinned = torch.from_numpy(source).pin_memory()
        on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)

        def h2d() -> None:
            on_device.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize(device)

        limits["pinned_h2d_gb_per_s"] = _best_gb_per_s(h2d, num_bytes, rounds)
    return limits


def _best_gb_per_s(copy: Callable[[], None], num_bytes: int, rounds: int) -> float:
    copy()  # warm-up
    best_s = float("inf")
    for _ in range(max(rounds, 1)):
        started = time.perf_counter()
        copy()
        best_s = min(best_s, time.perf_counter() - started)
    return num_bytes / best_s / GB
