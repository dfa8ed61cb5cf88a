"""The ``kvstore`` command: one entry point, one table of subcommands, each with its own help.

A command lives in the module that owns the concept, named in :data:`COMMANDS` as
``"module"`` (the module's ``configure(parser)`` and ``run(args) -> int``) or
``"module:name"`` (its ``configure_name`` and ``run_name``). Modules are imported only when
their command runs, so ``kvstore node`` never imports torch; the table is the composition
root of the whole program, which is why it may name modules of every layer. Every flag shows
a help line and its default (tests/kvstore/cli/test_cli.py checks each command)::

    kvstore --help                 every command
    kvstore cluster --help         the cluster subcommands
    kvstore cluster up --help      one command's flags
    kvstore --version

The table also gives every command the same conventions (tests/kvstore/cli/test_conventions.py
walks it): ``--json PATH`` with ``-`` for standard output and ``--cluster`` with
``$KVSTORE_CLUSTER`` (kvstore/cli/args.py ``apply_conventions``), positionals anywhere, a
heartbeat line off a terminal (kvstore/cli/progress.py), and bad input that reaches a command
reported in one line instead of a traceback (:func:`run_command`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from erasure.allocator import tune_glibc_malloc
from kvstore.cli.args import HelpFormatter, apply_conventions, is_stdout
from kvstore.cli.progress import Heartbeat
from kvstore.cli.signals import Terminated, sigterm_as_interrupt
from kvstore.errors import ERRORS

log = logging.getLogger("kvstore.cli")

# Command path -> ("module" or "module:name", one-line help).
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("node",): ("kvstore.node.main", "run one storage node in the foreground"),
    ("cluster", "up"): ("deploy.cluster_cli:up", "start a local cluster in the background"),
    ("cluster", "status"): ("deploy.cluster_cli:status", "each node's and class's figures"),
    ("cluster", "down"): ("deploy.cluster_cli:down", "stop a local cluster's nodes"),
    ("cluster", "join"): ("deploy.cluster_cli:join", "add a node to an etcd cluster map"),
    ("cluster", "drain"): (
        "deploy.cluster_cli:drain",
        "move a node's shards to other nodes (verified) until it has none",
    ),
    ("cluster", "remove"): ("deploy.cluster_cli:remove", "remove a drained node from the map"),
    ("cluster", "reweight"): (
        "deploy.reweight_cli:reweight",
        "move an etcd cluster map to its nodes' byte limits (--dry-run: what would move)",
    ),
    ("cluster", "add-tenant"): (
        "deploy.cluster_cli:add_tenant",
        "add a tenant (or service) principal and print its new token",
    ),
    ("cluster", "rotate-token"): (
        "deploy.rotate_cli:token",
        "give a principal a new token; the old one lives on for a grace period",
    ),
    ("cluster", "rotate-certs"): (
        "deploy.rotate_cli:certs",
        "issue a local cluster's node and admin certificates anew",
    ),
    ("certs", "init"): ("kvstore.certs:init", "make a development CA for TLS"),
    ("certs", "issue"): ("kvstore.certs:issue", "issue a node or client certificate"),
    ("purge",): ("deploy.purge", "delete every block of a tenant and destroy its data key"),
    ("get",): ("client.key_commands:get", "read one key's block (exit 1 on a miss)"),
    ("put",): ("client.key_commands:put", "store a value or a file under one key"),
    ("del",): ("client.key_commands:delete", "delete keys on every node of their groups"),
    ("ttl",): ("client.key_commands:ttl", "how long one key's block still lives"),
    ("inspect",): (
        "client.key_commands:inspect",
        "one key on each node of its group: shards, versions, times, checksums",
    ),
    ("bench", "erasure"): ("bench.erasure_bench", "erasure codec throughput vs memcpy"),
    ("bench", "storage"): ("bench.storage_bench", "cluster PUT/GET throughput and latency"),
    ("bench", "expiry"): ("bench.expiry_bench", "expiry cost vs number of live blocks"),
    ("bench", "sim"): ("bench.sim_bench", "simulator block accesses per second"),
    ("bench", "integrity"): (
        "bench.integrity_bench",
        "keyed block versions (BLAKE3) vs xxh3-128, CPU-s per GB",
    ),
    ("bench", "index"): ("bench.index_bench", "lmdb index bytes per shard entry"),
    ("bench", "engine"): ("bench.engine_bench", "engine time to first token, cold vs cached"),
    ("bench", "swapin"): ("bench.swapin_bench", "KV blocks into the engine's buffer pool, GB/s"),
    ("bench", "accuracy"): (
        "bench.accuracy_bench",
        "what a stored KV format (e4m3x16) costs the real model's answers",
    ),
    ("bench", "repair"): ("bench.repair_bench", "writes through a 2-node outage, then the heal"),
    ("bench", "map-moves"): (
        "bench.map_moves_bench",
        "shards a cluster map change moves, against the ideal",
    ),
    ("bench", "capacity-fill"): (
        "bench.capacity_fill_bench",
        "hit ratio of a cluster with small disks, capacity-blind vs weighted placement",
    ),
    ("sim",): ("kvstore.cli.sim", "replay a request trace through the TTL and capacity policies"),
    ("sim", "generate"): ("kvstore.cli.sim:generate", "write a seeded multi-day workload"),
    ("sim", "replay"): ("bench.replay", "replay a trace against a live cluster, vs simulated"),
    ("plan",): ("bench.plan_cli", "SSD TB, nodes, bandwidth and cost of TTL x capacity settings"),
    ("bench", "serve"): ("bench.serve_bench", "prefill balance vs a perfect offline assignment"),
    ("serve",): ("engine_adapter.serving.serve", "the OpenAI-compatible HTTP front and workers"),
    ("serve", "drain"): ("engine_adapter.serving.drain", "move a decode worker's requests off it"),
    ("demo",): ("engine_adapter.serving.demo", "the main job on an embedded local cluster"),
}
# Packages some commands need beyond a storage node's install -> the extra that brings them.
MODULE_TO_EXTRA = {
    "pyarrow": "sim",
    "matplotlib": "sim",
    "torch": "engine",
    "gguf": "engine",
    "tokenizers": "engine",
    "fastapi": "engine",
    "uvicorn": "engine",
    "redis": "dev",
    "ucxx": "ucx",
}
NO_CREATED_SERIES_ENV = "PROMETHEUS_DISABLE_CREATED_SERIES"  # read by prometheus_client
# Commands that run until stopped and log their own state: no heartbeat lines.
SERVICES = {("node",), ("serve",)}
# Command groups that are not commands themselves.
GROUPS: dict[tuple[str, ...], str] = {
    ("cluster",): "start, inspect or stop a local cluster",
    ("bench",): "benchmarks: each prints a table and writes JSON",
    ("certs",): "a development CA and certificates for TLS",
}


def subcommands(prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Commands directly below ``prefix`` (one more word)."""
    names = {cmd[: len(prefix) + 1] for cmd in [*COMMANDS, *GROUPS] if cmd[: len(prefix)] == prefix}
    return sorted(n for n in names if len(n) == len(prefix) + 1)


def _listing(prefix: tuple[str, ...]) -> str:
    rows = []
    for cmd in subcommands(prefix):
        help_ = COMMANDS[cmd][1] if cmd in COMMANDS else GROUPS[cmd]
        rows.append(f"  {' '.join(cmd):<18} {help_}")
        if prefix == ():
            rows += [f"    {' '.join(sub):<16} {COMMANDS[sub][1]}" for sub in subcommands(cmd)]
    return "\n".join(rows)


def _usage(prefix: tuple[str, ...]) -> str:
    name = " ".join(("kvstore", *prefix))
    return f"usage: {name} COMMAND [options]   ({name} COMMAND --help for its options)\n\n" + (
        _listing(prefix)
    )


def match_command(argv: Sequence[str]) -> tuple[tuple[str, ...], int]:
    """The longest command or group path at the start of ``argv``, and its length."""
    path: tuple[str, ...] = ()
    for word in argv:
        longer = (*path, word)
        if longer not in COMMANDS and longer not in GROUPS:
            break
        path = longer
    return path, len(path)


def command_functions(command: tuple[str, ...]) -> tuple[Callable[..., None], Callable[..., Any]]:
    """(configure, run) of ``command``, importing its module."""
    target = COMMANDS[command][0]
    module_name, _, name = target.partition(":")
    module = importlib.import_module(module_name)
    suffix = f"_{name}" if name else ""
    return getattr(module, "configure" + suffix), getattr(module, "run" + suffix)


def build_parser(command: tuple[str, ...]) -> tuple[argparse.ArgumentParser, Callable[..., Any]]:
    """The parser of one command, with ``--log-level``, and its run function."""
    configure, run = command_functions(command)
    below = subcommands(command)
    parser = argparse.ArgumentParser(
        prog=" ".join(("kvstore", *command)),
        description=COMMANDS[command][1],
        epilog=f"subcommands:\n{_listing(command)}" if below else None,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level")
    configure(parser)
    apply_conventions(parser)
    return parser, run


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # `kvstore ... | head`: the reader left; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a command killed by SIGPIPE


def _main(argv: list[str]) -> int:
    if argv[:1] in (["--version"], ["-V"]):
        print(f"kvstore {package_version()}")
        return 0
    command, length = match_command(argv)
    rest = argv[length:]
    if command not in COMMANDS:  # the top level or a group: list what is below it
        asked = not rest or rest[0] in ("-h", "--help")
        if not asked:
            print(f"kvstore: unknown command {' '.join(argv[: length + 1])!r}", file=sys.stderr)
        print(_usage(command), file=None if asked else sys.stderr)
        return 0 if asked else 2
    # Every command moves multi-megabyte buffers; without this each encode page-faults
    # (erasure/allocator.py has the measurements).
    tune_glibc_malloc()
    # Counters and histograms of this process and its children (serve's workers) export no
    # `_created` series: dashboards and alert rules never use them (deploy/observability/).
    os.environ.setdefault(NO_CREATED_SERIES_ENV, "True")
    try:
        parser, run = build_parser(command)
    except ModuleNotFoundError as exc:
        extra = MODULE_TO_EXTRA.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"kvstore {' '.join(command)} needs {exc.name}, from the {extra!r} extra: "
            f"pip install 'kvstore[{extra}]'",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_intermixed_args(rest)  # positionals anywhere: put KEY --ttl 1h VALUE
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return run_command(command, run, args)


def run_command(command: tuple[str, ...], run: Callable[..., Any], args: argparse.Namespace) -> int:
    """Run one parsed command: its own output to standard error when its JSON goes to standard
    output, a heartbeat off a terminal, and bad input reported in one line, not a traceback."""
    name = " ".join(("kvstore", *command))
    json_to_stdout = is_stdout(getattr(args, "json", None))
    heartbeat = contextlib.nullcontext() if command in SERVICES else Heartbeat(" ".join(command))
    # Without this a benchmark or demo killed by SIGTERM died at once and left the nodes of
    # its embedded cluster running, orphaned. Services stop on SIGTERM their own way.
    terminable = command not in SERVICES and threading.current_thread() is threading.main_thread()
    try:
        with (
            sigterm_as_interrupt() if terminable else contextlib.nullcontext(),
            heartbeat,
            contextlib.redirect_stdout(sys.stderr if json_to_stdout else sys.stdout),
        ):
            return int(run(args) or 0)
    except (*ERRORS, OSError, ValueError) as exc:
        # Bad input that reached the command (a missing or malformed file, a refused value):
        # one line that says what; the traceback only at --log-level DEBUG.
        log.debug("%s failed", name, exc_info=True)
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    except Terminated:
        print(f"{name}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


def package_version() -> str:
    """The installed kvstore's version (``kvstore --version``)."""
    from importlib import metadata  # only --version needs it (a tenth of a second)

    try:
        return metadata.version("kvstore")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: run from a source tree)"
