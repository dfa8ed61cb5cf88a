"""``kvstore serve drain``: take a decode worker out of a running ``kvstore serve``.

::

    kvstore serve drain --worker d0 --admin-key-file RUN_DIR/admin.key [--grace-s 60]
                        [--url http://127.0.0.1:8000]

The router stops sending the worker new requests and tells it to drain: requests queued on
it move at once, the running one may finish within the grace, and after the grace it moves
with its KV (full blocks through the store, the tail inline) to another decode worker, which
continues it token for token. The worker then exits and ``kvstore serve`` does not restart
it. Sending the worker process SIGTERM does the same with its ``--drain-grace-s``.

``/admin/drain`` takes only the admin key (``kvstore serve`` prints the path of its key file
at start-up; ``$KVSTORE_SERVE_ADMIN_KEY_FILE`` may name it instead of the flag).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from kvstore.cli.args import duration_arg

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_GRACE_S = 60.0
ADMIN_KEY_FILE_ENV = "KVSTORE_SERVE_ADMIN_KEY_FILE"


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
        "--admin-key-file",
        type=Path,
        default=os.environ.get(ADMIN_KEY_FILE_ENV),
        help=f"the admin key of kvstore serve (its start-up line names the file; default: "
        f"${ADMIN_KEY_FILE_ENV})",
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="the HTTP front of kvstore serve, reached from this host",
    )


def run(args: argparse.Namespace) -> int:
    """Ask the router to drain; print its JSON answer."""
    if args.admin_key_file is None:
        print(f"error: give --admin-key-file (kvstore serve's start-up line names it) or set "
              f"${ADMIN_KEY_FILE_ENV}", file=sys.stderr)  # fmt: skip
        return 1
    try:
        key = Path(args.admin_key_file).read_text().strip()
    except OSError as exc:
        print(f"error: cannot read the admin key: {exc}", file=sys.stderr)
        return 1
    body = json.dumps({"worker": args.worker, "grace_s": args.grace_s}).encode()
    request = urllib.request.Request(
        f"{args.url.rstrip('/')}/admin/drain",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
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
