"""UCX vs gRPC data path microbenchmark: GET throughput of one client from one server process.

::

    python -m bench.ucx_bench [--json PATH] [--sizes 256KiB,1MiB,4MiB]
        [--concurrency 1,8,32] [--transports grpc,ucx,ucx-tcp] [--seconds S] [--rounds R]
        [--destination host,cuda,cuda-pinned]

A server process holds a 64 MiB buffer of random bytes and serves GETs of (offset, size):

- ``grpc``: a grpc.aio unary call whose reply carries the bytes; the client copies them into
  its buffer (what ``get_into`` over gRPC does).
- ``ucx`` / ``ucx-tcp``: the client registers its buffer (client/ucx/transport.py), sends
  its worker address and tag base in a grpc.aio unary call; the server replies at once and
  sends the bytes over UCX from the buffer itself (kvstore/node/ucx_server.py). ``ucx`` lets UCX
  pick transports (shared memory and CMA on one host), ``ucx-tcp`` forces UCX_TLS=tcp.

So every UCX GET also pays one gRPC round trip, as a storage read will.

``--destination`` says where the client's bytes end up (each client task owns one slot):

- ``host`` (the default): a slot of one host buffer pool, as above.
- ``cuda``: a slice of one preallocated torch CUDA uint8 tensor; ``ucx`` receives into it
  directly (UCX's cuda_copy transport moves the bytes; ``UcxWorker.receive`` takes any
  ``__cuda_array_interface__`` array). Only ``ucx`` lands there: gRPC cannot,
  and ``ucx-tcp``'s UCX_TLS=tcp leaves out the CUDA transports.
- ``cuda-pinned``: what the engine does: the bytes land in a slice of one pinned (page-locked)
  host tensor, then a ``non_blocking`` H2D copy moves them into the same CUDA slice; a GET
  ends when a CUDA event recorded after the copy has completed. Every transport can do this.

The CUDA destinations import torch in the client process only; without torch or a CUDA
device they are skipped with a note (in the console and the JSON's ``settings.skipped``).
On one H200 (docs/runs/ucx-h200/ucx_h200.txt) ``cuda`` was the slowest (0.6-0.7 GB/s at 4 MiB
against 2.0-2.5 for ``cuda-pinned`` and 2.4-3.2 for ``host``): UCX cannot CMA-read into GPU memory,
so the sender copies into shared-memory fragments that the receiver's cuda_copy moves to the GPU
(docs/runs/ucx-h200/ucx_h200_transports.txt has the protocols UCX chose).

Each (transport, destination) pair runs ``--rounds`` times, the pairs interleaved, for
``--seconds`` each after a short warm-up; the table shows the median GB/s (10**9 bytes/s),
latency percentiles over all rounds, and the CPU seconds each process spent per GB moved
(which, unlike GB/s, holds up when other work shares the cores). Every setting first runs
one GET per task concurrently and checks each slot's bytes (read back from the GPU for the
CUDA destinations) against the server's. Both processes tune glibc malloc first
(erasure/allocator.py), which helps gRPC's per-reply allocations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from rich.table import Table

from bench.common import percentile_ms, process_cpu_s, run_load
from client.buffer_pool import BufferPool
from client.ucx.transport import UcxTransport
from erasure.allocator import tune_glibc_malloc
from kvstore.cli.args import list_arg, size_arg
from kvstore.cli.tables import make_console, print_fitted
from kvstore.node.ucx_server import UcxServer
from kvstore.wire.ucx_worker import DEFAULT_SPIN_S, UcxWorker, ucx_available
from ttl.units import size_label

SOURCE_BYTES = 64 << 20
UCX_TRANSPORTS = {"ucx": None, "ucx-tcp": "tcp"}  # bench name -> UCX_TLS (None: UCX's choice)
HOST, CUDA, CUDA_PINNED = "host", "cuda", "cuda-pinned"  # where a client task's bytes end up
DESTINATIONS = (HOST, CUDA, CUDA_PINNED)
_GET = "/ucxbench.Bench/Get"
_UCX_GET = "/ucxbench.Bench/UcxGet"
_GET_REQUEST = struct.Struct("<QI")  # offset, size
_UCX_REQUEST = struct.Struct("<QQIB")  # tag_base, offset, size, index into UCX_TRANSPORTS
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 2 * SOURCE_BYTES)]
_SEND_TIMEOUT_S = 10.0


@dataclass
class Result:
    transport: str
    destination: str  # host, cuda (received there directly) or cuda-pinned (pinned, then H2D)
    block_bytes: int
    concurrency: int
    gb_per_s: float  # median over rounds
    gb_per_s_rounds: list[float]
    p50_ms: float
    p99_ms: float
    num_gets: int
    client_cpu_s_per_gb: float  # CPU time per GB moved: robust where the cores are shared
    server_cpu_s_per_gb: float


@dataclass
class Round:
    gb_per_s: float
    latencies_s: list[float]
    num_bytes: int
    client_cpu_s: float
    server_cpu_s: float


def source_buffer() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, SOURCE_BYTES, dtype=np.uint8)


def block_offset(index: int, size: int) -> int:
    """Where GET number ``index`` of ``size`` bytes starts: spread over the source buffer."""
    return (index * 4099 * 4096) % (SOURCE_BYTES - size)


# --- server process ---------------------------------------------------------------------


class BenchServer:
    """gRPC control plus one UcxServer per UCX transport, all over one source buffer."""

    def __init__(self, spin_s: float) -> None:
        self._array = source_buffer()
        self.source = memoryview(self._array).cast("B")
        tls_options = UCX_TRANSPORTS.values() if ucx_available() else []
        self.senders = [UcxServer(UcxWorker(tls, spin_s=spin_s)) for tls in tls_options]
        self._posts: set[asyncio.Future[bool]] = set()

    def get(self, request: bytes, context: Any) -> bytes:
        offset, size = _GET_REQUEST.unpack(request)
        return bytes(self.source[offset : offset + size])

    def ucx_get(self, request: bytes, context: Any) -> bytes:
        """Post the UCX send and reply at once: the bytes travel while the reply does."""
        tag_base, offset, size, index = _UCX_REQUEST.unpack_from(request)
        address = request[_UCX_REQUEST.size :]
        sender = self.senders[index]
        post = sender.post(address, tag_base, [self.source[offset : offset + size]], 10.0)
        self._posts.add(post)  # keep a reference until the send ends
        post.add_done_callback(self._posts.discard)
        return b""

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {
            "Get": self.get,
            "UcxGet": self.ucx_get,
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(_as_async(fn)) for name, fn in methods.items()
        }
        return grpc.method_handlers_generic_handler("ucxbench.Bench", handlers)


def _as_async(fn: Callable[[bytes, Any], bytes]) -> Callable[[bytes, Any], Awaitable[bytes]]:
    async def handle(request: bytes, context: Any) -> bytes:
        return fn(request, context)

    return handle


async def serve(port_fd: int, spin_s: float) -> None:
    """Serve until stdin closes; first write one JSON line with the gRPC port to ``port_fd``.

    Not to stdout: UCX logs there (UCX_PROTO_INFO=y, warnings), before the port line too.
    """
    bench_server = BenchServer(spin_s)
    server = grpc.aio.server(options=_CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers([bench_server.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    with os.fdopen(port_fd, "w") as port_file:
        port_file.write(json.dumps({"port": port}) + "\n")
    await asyncio.to_thread(sys.stdin.read)
    await server.stop(grace=None)
    for sender in bench_server.senders:
        await sender.close()


# --- client process ---------------------------------------------------------------------


class CudaSlots:
    """Per-task slices of one CUDA tensor, and of one pinned host tensor that stages H2D copies.

    ``torch`` is the imported module: the store side never imports torch, this bench only when
    a CUDA destination is asked for.
    """

    def __init__(self, torch: Any, slot_bytes: int, num_slots: int) -> None:
        total = slot_bytes * num_slots
        gpu = torch.empty(total, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        bounds = [(i * slot_bytes, (i + 1) * slot_bytes) for i in range(num_slots)]
        self.gpu = [gpu[start:stop] for start, stop in bounds]
        self.pinned = [pinned[start:stop] for start, stop in bounds]
        self.staging = [memoryview(t.numpy()) for t in self.pinned]  # host views of `pinned`
        self._copied = [torch.cuda.Event() for _ in bounds]

    async def upload(self, task: int, size: int) -> None:
        """Copy the task's pinned slot into its CUDA slot; return once the copy is done."""
        self.gpu[task][:size].copy_(self.pinned[task][:size], non_blocking=True)
        copied = self._copied[task]
        copied.record()
        while not copied.query():  # let the other tasks run while the copy engine works
            await asyncio.sleep(0)

    def read_back(self, task: int, size: int) -> bytes:
        return self.gpu[task][:size].cpu().numpy().tobytes()


class BenchClient:
    """One GET function per (transport, destination), each filling a per-task slot."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        max_bytes: int,
        concurrency: int,
        spin_s: float,
        cuda: CudaSlots | None = None,
    ) -> None:
        self._get = channel.unary_unary(_GET)
        self._ucx_get = channel.unary_unary(_UCX_GET)
        self.pool = BufferPool(max_bytes, concurrency)
        self.slots = [self.pool.try_acquire() for _ in range(concurrency)]
        self.cuda = cuda
        self.offsets = [0] * concurrency  # where each task's last GET read from
        tls_options = UCX_TRANSPORTS.values() if ucx_available() else []
        self.receivers = [
            UcxTransport(UcxWorker(tls, spin_s=spin_s), seed=7) for tls in tls_options
        ]
        self._counter = 0
        self.server_pid = 0  # set once the server runs; measure() reads its CPU time

    def request_fn(
        self, transport: str, destination: str, size: int
    ) -> Callable[[int], Awaitable[bool]]:
        if transport == "grpc":
            return lambda task: self.grpc_get(task, size, destination)
        index = list(UCX_TRANSPORTS).index(transport)
        return lambda task: self.ucx_get(index, task, size, destination)

    def _next_offset(self, task: int, size: int) -> int:
        self._counter += 1
        self.offsets[task] = block_offset(self._counter, size)
        return self.offsets[task]

    def _landing(self, destination: str, task: int, size: int) -> Any:
        """Where the transport puts a task's bytes: host memory, or the CUDA slot itself."""
        if destination == HOST:
            return self.slots[task].view[:size]
        assert self.cuda is not None
        if destination == CUDA:
            return self.cuda.gpu[task][:size]
        return self.cuda.staging[task][:size]

    async def _landed(self, destination: str, task: int, size: int) -> None:
        if destination == CUDA_PINNED:
            assert self.cuda is not None
            await self.cuda.upload(task, size)

    def received(self, destination: str, task: int, size: int) -> bytes:
        """The bytes of the task's last GET where they ended up (copied back from the GPU)."""
        if destination == HOST:
            return self.slots[task].view[:size].tobytes()
        assert self.cuda is not None
        return self.cuda.read_back(task, size)

    async def grpc_get(self, task: int, size: int, destination: str) -> bool:
        data = await self._get(_GET_REQUEST.pack(self._next_offset(task, size), size))
        self._landing(destination, task, size)[:] = data
        await self._landed(destination, task, size)
        return len(data) == size

    async def ucx_get(self, index: int, task: int, size: int, destination: str) -> bool:
        receiver = self.receivers[index]
        batch = receiver.new_batch([self._landing(destination, task, size)])
        request = _UCX_REQUEST.pack(batch.tag_base, self._next_offset(task, size), size, index)
        await self._ucx_get(request + receiver.address)
        (num_bytes,) = await batch.wait(None, _SEND_TIMEOUT_S)
        await self._landed(destination, task, size)
        return num_bytes == size

    async def check(
        self, transport: str, destination: str, size: int, concurrency: int, source: np.ndarray
    ) -> None:
        """One GET per task, all at once, each slot compared with the server's bytes."""
        get = self.request_fn(transport, destination, size)
        done = await asyncio.gather(*(get(task) for task in range(concurrency)))
        for task, ok in enumerate(done):
            offset = self.offsets[task]
            expected = source[offset : offset + size].tobytes()
            if not ok or self.received(destination, task, size) != expected:
                raise AssertionError(
                    f"{transport} into {destination} returned wrong bytes for a {size}-byte GET"
                )

    async def close(self) -> None:
        for receiver in self.receivers:
            await receiver.close()


async def measure(
    client: BenchClient,
    pair: tuple[str, str],
    size: int,
    concurrency: int,
    seconds: float,
) -> Round:
    transport, destination = pair
    get = client.request_fn(transport, destination, size)
    await run_load(get, concurrency, seconds / 4)  # warm-up
    client_cpu_s, server_cpu_s = time.process_time(), process_cpu_s(client.server_pid)
    latencies_s, num_failed, elapsed_s = await run_load(get, concurrency, seconds)
    client_cpu_s = time.process_time() - client_cpu_s
    server_cpu_s = process_cpu_s(client.server_pid) - server_cpu_s
    if num_failed:
        raise AssertionError(
            f"{num_failed} {transport} GETs of {size} bytes into {destination} came back short"
        )
    num_bytes = len(latencies_s) * size
    return Round(num_bytes / elapsed_s / 1e9, latencies_s, num_bytes, client_cpu_s, server_cpu_s)


async def bench_setting(
    client: BenchClient,
    args: argparse.Namespace,
    pairs: list[tuple[str, str]],
    size: int,
    concurrency: int,
    source: np.ndarray,
) -> list[Result]:
    for transport, destination in pairs:
        await client.check(transport, destination, size, concurrency, source)
    rounds: dict[tuple[str, str], list[Round]] = {pair: [] for pair in pairs}
    for _ in range(args.rounds):
        for pair in pairs:
            rounds[pair].append(await measure(client, pair, size, concurrency, args.seconds))
    return [_result(pair, size, concurrency, runs) for pair, runs in rounds.items()]


def _result(pair: tuple[str, str], size: int, concurrency: int, runs: list[Round]) -> Result:
    latencies_s = [lat for run in runs for lat in run.latencies_s]
    gb_per_s = [round(run.gb_per_s, 3) for run in runs]
    num_gb = sum(run.num_bytes for run in runs) / 1e9
    return Result(
        transport=pair[0],
        destination=pair[1],
        block_bytes=size,
        concurrency=concurrency,
        gb_per_s=round(statistics.median(gb_per_s), 3),
        gb_per_s_rounds=gb_per_s,
        p50_ms=round(percentile_ms(latencies_s, 50), 3),
        p99_ms=round(percentile_ms(latencies_s, 99), 3),
        num_gets=len(latencies_s),
        client_cpu_s_per_gb=round(sum(run.client_cpu_s for run in runs) / num_gb, 3),
        server_cpu_s_per_gb=round(sum(run.server_cpu_s for run in runs) / num_gb, 3),
    )


def start_server(spin_us: float) -> tuple[subprocess.Popen[str], int]:
    port_read, port_write = os.pipe()
    cmd = [sys.executable, "-m", "bench.ucx_bench", "--serve", str(port_write)]
    cmd += ["--spin-us", str(spin_us)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(port_write,), text=True)
    os.close(port_write)  # the server holds the only write end: EOF if it dies
    with os.fdopen(port_read) as port_file:
        line = port_file.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"bench server exited before listening (code {proc.wait()})")
    return proc, json.loads(line)["port"]


def stop_server(proc: subprocess.Popen[str]) -> None:
    """Close the server's stdin (its signal to stop); kill it if it does not exit."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cuda_torch() -> tuple[Any, str | None]:
    """torch, when it is installed and sees a CUDA device; else None and why not."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} sees no CUDA device"
    return torch, None


def plan_pairs(
    transports: list[str], destinations: list[str], cuda_missing: str | None
) -> tuple[list[tuple[str, str]], list[str]]:
    """The (transport, destination) pairs to measure, and a note for each one left out."""
    skipped = []
    if cuda_missing is not None and set(destinations) - {HOST}:
        gone = [d for d in destinations if d != HOST]
        skipped.append(f"{cuda_missing}: skipping destination {', '.join(gone)}")
        destinations = [d for d in destinations if d == HOST]
    pairs = []
    for transport in transports:
        for destination in destinations:
            if destination == CUDA and transport != "ucx":
                skipped.append(f"{transport} cannot receive into CUDA memory directly: skipped")
            else:
                pairs.append((transport, destination))
    return pairs, skipped


async def bench(args: argparse.Namespace, pairs: list[tuple[str, str]], torch: Any) -> list[Result]:
    """Every size and concurrency, each measuring ``pairs`` interleaved; ``torch`` is None
    unless a pair has a CUDA destination."""
    proc, port = start_server(args.spin_us)
    results: list[Result] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_CHANNEL_OPTIONS) as ch:
            slot_bytes, num_slots = max(args.sizes), max(args.concurrency)
            cuda = None if torch is None else CudaSlots(torch, slot_bytes, num_slots)
            client = BenchClient(ch, slot_bytes, num_slots, args.spin_us / 1e6, cuda)
            client.server_pid = proc.pid
            source = source_buffer()
            for size in args.sizes:
                for concurrency in args.concurrency:
                    results += await bench_setting(client, args, pairs, size, concurrency, source)
            await client.close()
    finally:
        stop_server(proc)
    return results


def _settings(args: argparse.Namespace, skipped: list[str], torch: Any) -> dict[str, Any]:
    return {
        "seconds": args.seconds,
        "rounds": args.rounds,
        "source_bytes": SOURCE_BYTES,
        "spin_us": args.spin_us,
        "cpu_count": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(),
        "ucxx": _ucxx_version(),
        "gpu": "none" if torch is None else _gpu(torch),
        "skipped": skipped,
    }


def _gpu(torch: Any) -> str:
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"


def _ucxx_version() -> str:
    if not ucx_available():
        return "not installed"
    import ucxx

    return f"ucxx {ucxx.__version__}, UCX {'.'.join(map(str, ucxx.get_ucx_version()))}"


def results_table(results: list[Result]) -> Table:
    table = Table(title="GET throughput, one client process, one server process")
    columns = ["transport", "destination", "block", "conc", "GB/s (median)", "GB/s rounds"]
    for column in [*columns, "p50 ms", "p99 ms", "client CPU s/GB", "server CPU s/GB"]:
        table.add_column(column, justify="right")
    for r in results:
        rounds = " ".join(f"{g:.2f}" for g in r.gb_per_s_rounds)
        table.add_row(
            r.transport,
            r.destination,
            size_label(r.block_bytes),
            str(r.concurrency),
            f"{r.gb_per_s:.2f}",
            rounds,
            f"{r.p50_ms:.2f}",
            f"{r.p99_ms:.2f}",
            f"{r.client_cpu_s_per_gb:.2f}",
            f"{r.server_cpu_s_per_gb:.2f}",
        )
    return table


def _transport_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = set(names) - {"grpc", *UCX_TRANSPORTS}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown transports {sorted(unknown)}")
    return names


def _destination_list(text: str) -> list[str]:
    names = [d.strip() for d in text.split(",") if d.strip()]
    unknown = set(names) - set(DESTINATIONS)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown destinations {sorted(unknown)}; choose from {', '.join(DESTINATIONS)}"
        )
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    parser.add_argument("--sizes", type=list_arg(size_arg), default="256KiB,1MiB,4MiB")
    parser.add_argument(
        "--concurrency", type=lambda t: [int(c) for c in t.split(",")], default="1,8,32"
    )
    parser.add_argument("--transports", type=_transport_list, default="grpc,ucx,ucx-tcp")
    parser.add_argument(
        "--destination",
        type=_destination_list,
        default=HOST,
        help="where the bytes end up: host, cuda (UCX into GPU memory) and/or cuda-pinned "
        "(pinned host memory, then an H2D copy)",
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="measured seconds per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per setting")
    parser.add_argument(
        "--spin-us",
        type=float,
        default=DEFAULT_SPIN_S * 1e6,
        help="how long an idle UCX worker polls before it sleeps on its epoll fd",
    )
    parser.add_argument("--serve", type=int, metavar="PORT_FD", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    tune_glibc_malloc()
    if args.serve is not None:
        asyncio.run(serve(args.serve, args.spin_us / 1e6))
        return 0
    console = make_console()
    skipped = []
    if not ucx_available():
        args.transports = [t for t in args.transports if t == "grpc"]
        skipped.append("ucxx is not installed; measuring gRPC only")
    torch, cuda_missing = cuda_torch() if set(args.destination) - {HOST} else (None, None)
    pairs, not_planned = plan_pairs(args.transports, args.destination, cuda_missing)
    skipped += not_planned
    if not any(destination != HOST for _, destination in pairs):
        torch = None  # every CUDA pair was left out: allocate nothing on the GPU
    if not pairs:
        skipped.append("no transport and destination left to measure")
    for note in skipped:
        console.print(f"note: {note}")
    start_s = time.perf_counter()
    results = asyncio.run(bench(args, pairs, torch)) if pairs else []
    report = {
        "settings": _settings(args, skipped, torch),
        "results": [asdict(r) for r in results],
    }
    report["settings"]["wall_s"] = round(time.perf_counter() - start_s, 1)
    print_fitted(results_table(results), console)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ucx_bench", description=__doc__)
    configure(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
