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
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from erasure.allocator import tune_glibc_malloc
from kvstore.cli.args import HelpFormatter

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
    ("bench", "repair"): ("bench.repair_bench", "writes through a 2-node outage, then the heal"),
    ("bench", "map-moves"): (
        "bench.map_moves_bench",
        "shards a cluster map change moves, against the ideal",
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
    return parser, run


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    args = parser.parse_args(rest)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return int(run(args) or 0)
