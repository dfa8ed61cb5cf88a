"""The ceilings a swap-in is measured against, measured in the same run: copies of its bytes.

``kvstore bench swapin`` and ``kvstore bench engine`` put these in their JSON (``limits``), so
every figure carries the limit of the machine it ran on: a host memcpy of the same bytes (what
a client that copies every byte once pays) and, on CUDA, a copy of them from pinned host
memory to the device (the PCIe ceiling of the swap-in's last hop). With the stream transport,
also the same bytes over loopback TCP, one connection per node: the ceiling of a channel that
crosses the kernel's socket copies between processes of one host.
"""

from __future__ import annotations

import socket
import threading
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


def loopback_tcp_gb_per_s(num_bytes: int, connections: int, rounds: int) -> float:
    """``num_bytes`` over ``connections`` loopback TCP connections at once, in equal parts
    (best of ``rounds``; GB/s): per connection one thread sends from a buffer and another
    receives into one of its own with MSG_WAITALL, as the stream link does
    (client/stream/link.py). No framing, no checks, no Python per byte: what the kernel's
    two socket copies allow on this host."""
    part = max(num_bytes // connections, 1)
    listener = socket.create_server(("127.0.0.1", 0))
    pairs: list[tuple[socket.socket, socket.socket]] = []
    try:
        for _ in range(connections):
            sender = socket.create_connection(listener.getsockname())
            receiver, _ = listener.accept()
            pairs.append((sender, receiver))
        source = memoryview(bytes(part))
        targets = [memoryview(bytearray(part)) for _ in pairs]

        def receive(sock: socket.socket, target: memoryview) -> None:
            while len(target):
                target = target[sock.recv_into(target, len(target), socket.MSG_WAITALL) :]

        def transfer() -> None:
            threads = [threading.Thread(target=s.sendall, args=(source,)) for s, _ in pairs]
            threads += [
                threading.Thread(target=receive, args=(r, t))
                for (_, r), t in zip(pairs, targets, strict=True)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        return _best_gb_per_s(transfer, part * len(pairs), rounds)
    finally:
        listener.close()
        for sender, receiver in pairs:
            sender.close()
            receiver.close()
