"""Worker flags that ``kvstore serve`` passes through to its worker processes.

Kept apart from ``worker_main.py`` (which imports torch) so that ``kvstore serve --help``
and the router's process never import torch.
"""

from __future__ import annotations

import argparse

from engine_adapter.config import add_kv_format_argument, add_store_transport_argument
from kvstore.cli.args import duration_arg, list_arg

DEFAULT_DRAIN_GRACE_S = 60.0
DEFAULT_CALIBRATION_TOKENS = (64, 256, 512)


def add_worker_tuning_arguments(parser: argparse.ArgumentParser) -> None:
    """Worker flags that ``kvstore serve`` passes through to its workers (``tuning_argv``)."""
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokens per request")
    parser.add_argument(
        "--fetch-policy",
        choices=["cost", "always"],
        default="always",
        help="prefill: fetch every cached block (always) or when the cost model says it is "
        "faster than computing them (cost)",
    )
    add_store_transport_argument(parser)
    add_kv_format_argument(parser)
    parser.add_argument(
        "--calibration-tokens",
        type=list_arg(int),
        default=DEFAULT_CALIBRATION_TOKENS,
        help="prefill workers time cold prefills of these lengths at start-up, which seed "
        "the router's cost model of them ('' for none)",
    )
    parser.add_argument(
        "--prefill-step-budget-ms",
        type=float,
        default=0.0,
        help="solve the prefill chunk size so that one chunk's step, even at the end of "
        "--max-model-len, fits this many ms by the calibrated cost model (0: one block per "
        "chunk, which keeps every cached block usable)",
    )
    parser.add_argument(
        "--drain-grace-s",
        type=duration_arg,
        default=DEFAULT_DRAIN_GRACE_S,
        help="on SIGTERM a decode worker takes no new requests and moves what still runs "
        "after this many seconds to another decode worker",
    )


def tuning_argv(args: argparse.Namespace) -> list[str]:
    """The worker command line of the flags :func:`add_worker_tuning_arguments` parsed."""
    return [
        *("--max-model-len", str(args.max_model_len), "--fetch-policy", args.fetch_policy),
        *("--store-transport", args.store_transport, "--drain-grace-s", str(args.drain_grace_s)),
        *("--calibration-tokens", ",".join(map(str, args.calibration_tokens))),
        *("--prefill-step-budget-ms", str(args.prefill_step_budget_ms)),
        *("--kv-format", args.kv_format),
    ]
