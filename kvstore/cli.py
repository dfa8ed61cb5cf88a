"""The ``kvstore`` command: one entry point, subcommands implemented next to their code.

Each subcommand lives in the module that owns the concept and exposes two functions:
``configure(parser)`` adds its arguments and ``run(args) -> int`` runs it. Modules are
imported only when their command runs, so ``kvstore node`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from erasure.allocator import tune_glibc_malloc

# argv prefix -> (module, one-line help). The longest matching prefix wins.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("node",): ("kvstore.node", "run one storage node in the foreground"),
    ("cluster",): ("deploy.local_cluster", "start, inspect or stop a local cluster"),
    ("bench", "erasure"): ("bench.erasure_bench", "erasure codec throughput vs memcpy"),
    ("bench", "storage"): ("bench.storage_bench", "cluster PUT/GET throughput and latency"),
    ("bench", "expiry"): ("bench.expiry_bench", "expiry cost vs number of live blocks"),
    ("bench", "sim"): ("bench.sim_bench", "simulator block accesses per second"),
    ("bench", "engine"): ("bench.engine_bench", "engine time to first token, cold vs cached"),
    ("bench", "swapin"): ("bench.swapin_bench", "KV blocks into the engine's buffer pool, GB/s"),
    ("sim",): ("ttl.sim_cli", "replay a request trace through the TTL and capacity policies"),
    ("sim", "generate"): ("ttl.generate", "write a seeded multi-day synthetic workload"),
    ("serve",): ("engine_adapter.serve", "run the router, prefill and decode workers"),
    ("demo",): ("engine_adapter.demo", "the main job on an embedded local cluster"),
}


def _usage() -> str:
    lines = ["usage: kvstore COMMAND [options]   (kvstore COMMAND --help for details)", ""]
    lines += [f"  {' '.join(cmd):<16} {help_}" for cmd, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _match(argv: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    for size in (2, 1):
        prefix = tuple(argv[:size])
        if prefix in COMMANDS:
            return prefix, argv[size:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    matched = _match(argv)
    if matched is None:
        print(_usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else None)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, rest = matched
    # Every command moves multi-megabyte buffers; without this each encode page-faults
    # (erasure/allocator.py has the measurements).
    tune_glibc_malloc()
    module_name, help_ = COMMANDS[command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog="kvstore " + " ".join(command), description=help_)
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    module.configure(parser)
    args = parser.parse_args(rest)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
