"""``kvstore serve drain``: take a decode worker out of a running ``kvstore serve``.

::

    kvstore serve drain --worker d0 [--grace-s 60] [--url http://127.0.0.1:8000]

The router stops sending the worker new requests and tells it to drain: requests queued on
it move at once, the running one may finish within the grace, and after the grace it moves
with its KV (full blocks through the store, the tail inline) to another decode worker, which
continues it token for token. The worker then exits and ``kvstore serve`` does not restart
it. Sending the worker process SIGTERM does the same with its ``--drain-grace-s``.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from kvstore.cli.args import duration_arg

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_GRACE_S = 60.0


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore serve drain``."""
    parser.add_argument("--worker", required=True, help="decode worker id, e.g. d0")
    parser.add_argument(
        "--grace-s",
        type=duration_arg,
        default=DEFAULT_GRACE_S,
        help="seconds running requests may go on before they move",
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="the HTTP front of kvstore serve, reached from this host",
    )


def run(args: argparse.Namespace) -> int:
    """Ask the router to drain; print its JSON answer."""
    body = json.dumps({"worker": args.worker, "grace_s": args.grace_s}).encode()
    request = urllib.request.Request(
        f"{args.url.rstrip('/')}/admin/drain",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            print(reply.read().decode())
    except urllib.error.HTTPError as exc:
        print(f"error: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot reach kvstore serve at {args.url}: {exc}", file=sys.stderr)
        return 1
    return 0
