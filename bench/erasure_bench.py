"""``kvstore bench erasure``: codec encode/decode MB/s per core, next to memcpy and raw libraries.

::

    kvstore bench erasure [--json PATH] [--block-sizes 64KiB,1MiB,4MiB,16MiB]
        [--seconds 0.5] [--codecs zfec,isal] [--k 10 --m 2] [--malloc tuned|default]

Everything runs in one thread of one process. MB/s is 10**6 bytes of block per second of that
thread's CPU time (``time.thread_time``), which is throughput per core even when other
processes share the machine; ``wall_mb_per_s`` has the wall-clock figure, equal on an idle
machine. For each block size the bench measures:

- ``none``/``memcpy``: numpy copy of the block into a preallocated array (the yardstick);
- ``zfec`` and ``isal`` (our :class:`erasure.codec.Codec`): ``encode``, ``decode`` (returns
  new bytes) and ``decode_into`` (``decode(out=...)``, the swap-in path), each with all data
  shards and with ``missing_data_shards`` (default 2) lost;
- the raw libraries as a user of them would call them, without our headers, checksums and
  buffer handling: ``zfec-raw`` (``zfec.easyfec``), ``isal-raw`` (pyeclib
  ``ECDriver(ec_type="isa_l_rs_vand")``, which adds its own 80-byte fragment headers and
  allocates every fragment) and ``isal-kernel`` (ISA-L's ``ec_encode_data`` alone on
  preallocated buffers: the floor).

Measurements of one block size are interleaved: ``--rounds`` passes over every case, each
``--seconds / --rounds`` CPU seconds long, and a record keeps the median pass, so a burst of
load from another process (which also evicts our caches) skews one pass of every case rather
than all of one case. Our records carry
``raw_mb_per_s`` (the matching raw library) and every record ``vs_memcpy``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zfec.easyfec
from pyeclib.ec_iface import ECDriver
from rich.console import Console
from rich.table import Table

from erasure.allocator import tune_glibc_malloc
from erasure.codec import Codec, make_codec
from erasure.config import CodecConfig
from erasure.isal_backend import IsalBackend, isal_version
from kvstore.cli.args import list_arg, size_arg
from kvstore.cli.progress import ProgressReporter
from kvstore.cli.tables import make_console, print_fitted
from ttl.units import size_label

MB = 1e6
BATCH_CPU_S = 1e-3
RAW_OF = {"zfec": "zfec-raw", "isal": "isal-raw"}
COLUMNS = ["none", "zfec", "zfec-raw", "isal", "isal-raw", "isal-kernel"]
COLUMN_TITLES = ["memcpy", "zfec", "zfec-raw", "isal", "isal-raw", "isal-kernel"]


@dataclass
class Case:
    codec: str  # "none", "zfec", "isal", "zfec-raw", "isal-raw", "isal-kernel"
    op: str  # "memcpy", "encode", "decode", "decode_into"
    missing_data_shards: int
    call: Callable[[], object]


@dataclass
class Record:
    codec: str
    op: str
    block_bytes: int
    missing_data_shards: int
    mb_per_s: float  # median pass, per CPU second of the measuring thread
    mb_per_s_passes: list[float]
    wall_mb_per_s: float  # median pass, per wall-clock second
    num_ops: int
    cpu_seconds: float
    wall_seconds: float
    vs_memcpy: float = 0.0
    raw_mb_per_s: float | None = None


def _codecs(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = set(names) - set(RAW_OF)
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"codecs {text!r}: choose from zfec, isal")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    parser.add_argument(
        "--block-sizes",
        type=list_arg(size_arg),
        default=list_arg(size_arg)("64KiB,1MiB,4MiB,16MiB"),
        metavar="LIST",
        help="comma-separated block sizes (B, KiB, MiB, GiB)",
    )
    parser.add_argument(
        "--seconds", type=float, default=0.5, help="CPU seconds per measurement (all passes)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved passes per size")
    parser.add_argument(
        "--codecs",
        type=_codecs,
        default=["zfec", "isal"],
        metavar="LIST",
        help="backends to measure, each with its raw library; default zfec,isal",
    )
    parser.add_argument("--k", type=int, default=10, help="data shards")
    parser.add_argument("--m", type=int, default=2, help="parity shards")
    parser.add_argument("--missing", type=int, default=2, help="data shards lost in decodes")
    parser.add_argument(
        "--malloc",
        choices=["tuned", "default"],
        default="tuned",
        help="tuned: erasure.allocator.tune_glibc_malloc() first (see its docstring)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random blocks")


def _codec_cases(codec: Codec, block: bytes, missing: int) -> list[Case]:
    shards = codec.encode(block)
    out = bytearray(len(block))
    cases = [Case(codec.backend, "encode", 0, lambda: codec.encode(block))]
    for lost in sorted({0, missing}):
        offered = shards[lost : lost + codec.k]
        cases.append(Case(codec.backend, "decode", lost, lambda s=offered: codec.decode(s)))
        cases.append(
            Case(codec.backend, "decode_into", lost, lambda s=offered: codec.decode(s, out=out))
        )
    return cases


def _zfec_raw_cases(k: int, m: int, block: bytes, missing: int) -> list[Case]:
    encoder, decoder = zfec.easyfec.Encoder(k, k + m), zfec.easyfec.Decoder(k, k + m)
    pieces = encoder.encode(block)
    padding = len(pieces[0]) * k - len(block)
    cases = [Case("zfec-raw", "encode", 0, lambda: encoder.encode(block))]
    for lost in sorted({0, missing}):
        offered, ids = pieces[lost : lost + k], list(range(lost, lost + k))
        cases.append(
            Case("zfec-raw", "decode", lost, lambda s=offered, i=ids: decoder.decode(s, i, padding))
        )
    return cases


def _isal_raw_cases(k: int, m: int, block: bytes, missing: int) -> list[Case]:
    driver = ECDriver(k=k, m=m, ec_type="isa_l_rs_vand")
    fragments = driver.encode(block)
    cases = [Case("isal-raw", "encode", 0, lambda: driver.encode(block))]
    for lost in sorted({0, missing}):
        offered = fragments[lost : lost + k]
        cases.append(Case("isal-raw", "decode", lost, lambda s=offered: driver.decode(s)))
    return cases


def _isal_kernel_cases(k: int, m: int, block: bytes, missing: int) -> list[Case]:
    """ec_encode_data alone: parity of, or ``missing`` payloads from, preallocated buffers."""
    backend = IsalBackend(k, m)
    payload_len = -(-len(block) // k)
    rows = bytearray(block.ljust(payload_len * k, b"\0")) + bytearray(payload_len * m)
    view = memoryview(rows)
    data, parity = view[: payload_len * k], view[payload_len * k :]
    backend.encode_parity([data], parity, payload_len)
    payloads = [view[i * payload_len : (i + 1) * payload_len] for i in range(k + m)]
    sources = dict(enumerate(payloads[missing : missing + k], start=missing))
    lost_ids = list(range(missing))
    out = [memoryview(bytearray(payload_len)) for _ in lost_ids]
    encode = Case(
        "isal-kernel", "encode", 0, lambda: backend.encode_parity([data], parity, payload_len)
    )
    if not missing:
        return [encode]
    return [
        encode,
        Case("isal-kernel", "decode", missing, lambda: backend.reconstruct(sources, lost_ids, out)),
    ]


def _memcpy_case(block: bytes) -> Case:
    source = np.frombuffer(block, np.uint8)
    dest = np.empty_like(source)
    return Case("none", "memcpy", 0, lambda: np.copyto(dest, source))


def cases_for(block: bytes, args: argparse.Namespace) -> list[Case]:
    """Every measurement of one block size, the memcpy yardstick first."""
    cases = [_memcpy_case(block)]
    for name in args.codecs:
        config = CodecConfig(args.k, args.m, name, max_block_bytes=max(len(block), 1))
        cases += _codec_cases(make_codec(config), block, args.missing)
    if "zfec" in args.codecs:
        cases += _zfec_raw_cases(args.k, args.m, block, args.missing)
    if "isal" in args.codecs and args.m:  # pyeclib needs m >= 1
        cases += _isal_raw_cases(args.k, args.m, block, args.missing)
        cases += _isal_kernel_cases(args.k, args.m, block, args.missing)
    return cases


@dataclass
class Pass:
    num_calls: int
    cpu_s: float  # this thread's CPU time: what "per core" means
    wall_s: float


def calls_per_batch(call: Callable[[], object]) -> int:
    """How many calls take about a millisecond, so reading the clock costs next to nothing."""
    start = time.thread_time()
    call()
    return max(1, int(BATCH_CPU_S / max(time.thread_time() - start, 1e-7)))


def time_pass(call: Callable[[], object], batch: int, cpu_seconds: float) -> Pass:
    """Call in batches until this thread has spent ``cpu_seconds`` of CPU time on it.

    CPU time rather than wall time: on a shared machine the thread is sometimes descheduled,
    which says nothing about the codec. Both are recorded.
    """
    num_calls, cpu_start, wall_start = 0, time.thread_time(), time.perf_counter()
    while True:
        for _ in range(batch):
            call()
        num_calls += batch
        cpu_s = time.thread_time() - cpu_start
        if cpu_s >= cpu_seconds:
            return Pass(num_calls, cpu_s, time.perf_counter() - wall_start)


def measure(
    cases: list[Case], block_bytes: int, args: argparse.Namespace, progress: ProgressReporter
) -> list[Record]:
    """Interleaved passes over ``cases``; one record per case, holding its median pass."""
    for case in cases:
        case.call()  # warm-up: allocations, tables, caches
    batches = [calls_per_batch(case.call) for case in cases]
    passes: list[list[Pass]] = [[] for _ in cases]
    for _ in range(args.rounds):
        for case, batch, results in zip(cases, batches, passes, strict=True):
            results.append(time_pass(case.call, batch, args.seconds / args.rounds))
            progress.advance()
    return [
        _record(case, block_bytes, results) for case, results in zip(cases, passes, strict=True)
    ]


def _record(case: Case, block_bytes: int, passes: list[Pass]) -> Record:
    def rate(num_calls: int, seconds: float) -> float:
        return round(block_bytes * num_calls / seconds / MB, 1)

    rates = [rate(p.num_calls, p.cpu_s) for p in passes]
    return Record(
        codec=case.codec,
        op=case.op,
        block_bytes=block_bytes,
        missing_data_shards=case.missing_data_shards,
        mb_per_s=statistics.median(rates),
        mb_per_s_passes=rates,
        wall_mb_per_s=statistics.median(rate(p.num_calls, p.wall_s) for p in passes),
        num_ops=sum(p.num_calls for p in passes),
        cpu_seconds=round(sum(p.cpu_s for p in passes), 3),
        wall_seconds=round(sum(p.wall_s for p in passes), 3),
    )


def add_ratios(records: list[Record]) -> None:
    """Fill ``vs_memcpy`` and, on our codecs' records, ``raw_mb_per_s``."""
    by_key = {(r.codec, r.op, r.block_bytes, r.missing_data_shards): r for r in records}
    for record in records:
        memcpy = by_key[("none", "memcpy", record.block_bytes, 0)]
        record.vs_memcpy = round(record.mb_per_s / memcpy.mb_per_s, 3)
        raw_op = "decode" if record.op == "decode_into" else record.op
        raw = by_key.get(
            (RAW_OF.get(record.codec, ""), raw_op, record.block_bytes, record.missing_data_shards)
        )
        if raw is not None:
            record.raw_mb_per_s = raw.mb_per_s


def machine_info(args: argparse.Namespace, malloc_tuned: bool) -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "num_cpus": os.cpu_count(),
        "threads": 1,
        "python": platform.python_version(),
        "libc": " ".join(platform.libc_ver()),
        "isal": isal_version(),
        "versions": {
            name: importlib.metadata.version(name) for name in ("zfec", "pyeclib", "numpy")
        },
        "malloc": "tuned" if malloc_tuned else "default",
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "k": args.k,
        "m": args.m,
        "cpu_seconds_per_measurement": args.seconds,
        "timer": "thread CPU time (time.thread_time); wall time in wall_mb_per_s",
        "rounds": args.rounds,
        "seed": args.seed,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def render_table(records: list[Record]) -> Table:
    """One row per (block size, op, lost data shards); one column per codec, in MB/s."""
    table = Table(title="erasure codec throughput, MB/s per core (10**6 B of block per s)")
    for name in ["block", "op", "lost", *COLUMN_TITLES, "isal/raw", "isal/memcpy"]:
        table.add_column(name, justify="left" if name in ("block", "op") else "right")
    rows: dict[tuple[int, str, int], dict[str, Record]] = {}
    for r in records:
        rows.setdefault((r.block_bytes, r.op, r.missing_data_shards), {})[r.codec] = r
    for (block_bytes, op, lost), by_codec in rows.items():
        cells = [f"{by_codec[c].mb_per_s:,.0f}" if c in by_codec else "" for c in COLUMNS]
        ours = by_codec.get("isal")
        vs_raw = f"{ours.mb_per_s / ours.raw_mb_per_s:.2f}" if ours and ours.raw_mb_per_s else ""
        vs_memcpy = f"{ours.vs_memcpy:.2f}" if ours else ""
        table.add_row(size_label(block_bytes), op, str(lost), *cells, vs_raw, vs_memcpy)
    return table


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.missing <= args.m:
        Console(stderr=True).print(f"--missing must be between 0 and m={args.m}")
        return 2
    malloc_tuned = args.malloc == "tuned" and tune_glibc_malloc()
    rng = np.random.default_rng(args.seed)
    console = make_console()
    records: list[Record] = []
    load_before = os.getloadavg()
    for block_bytes in args.block_sizes:
        cases = cases_for(rng.bytes(block_bytes), args)
        total = len(cases) * args.rounds
        with ProgressReporter(f"erasure {size_label(block_bytes)} blocks", total) as progress:
            records += measure(cases, block_bytes, args, progress)
    add_ratios(records)
    print_fitted(render_table(records), console, keep=("isal", "isal/raw"))
    info = machine_info(args, malloc_tuned)
    info["load_average_1m"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    console.print(
        f"{info['cpu']}, {info['num_cpus']} CPUs, malloc {info['malloc']}, ISA-L "
        f"{info['isal']}, load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"results": [asdict(r) for r in records], **info}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0
