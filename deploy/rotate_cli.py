"""``kvstore cluster rotate-token|rotate-certs``: new credentials without an outage.

::

    kvstore cluster rotate-token --dir DIR NAME [--grace 10m] [--expires 90d]
                                 [--credentials PATH] [--token-file PATH]
    kvstore cluster rotate-certs --dir DIR [--days 825]

``rotate-token`` gives principal NAME (a tenant, service, admin or the node principal) a new
token (kvstore/auth.py :func:`rotate_token`): the old one stays valid for ``--grace`` (0: it is
refused within a second, when the nodes re-read their credentials file), the new one until
``--expires`` (default: until the next rotation). The new token goes to ``--token-file`` (mode
0600) if given; for a local cluster the node principal's goes to ``DIR/node.token`` and the
admin's to ``DIR/admin.token``, where nodes and tools pick it up within a second
(:class:`kvstore.auth.TokenFile`); any other is printed, once.

``rotate-certs`` issues every node of a local cluster a new node certificate and the admin a
new client certificate from ``DIR/tls``'s CA; nodes serve the new one from their next TLS
handshake (kvstore/tls.py). On many hosts, run ``kvstore certs issue --node`` per host instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.local_secrets import ADMIN_TOKEN_FILE, CREDENTIALS_FILE, NODE_TOKEN_FILE, TLS_DIR
from kvstore.auth import Role, load_credentials, rotate_token, write_private
from kvstore.certs import issue_files
from kvstore.cli.args import duration_arg
from kvstore.config import load_cluster

DEFAULT_GRACE_S = 600.0


def configure_token(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster rotate-token``."""
    parser.add_argument("--dir", required=True, type=Path, help="the cluster's directory")
    parser.add_argument("name", help="the principal whose token to replace")
    parser.add_argument(
        "--grace",
        type=duration_arg,
        default=DEFAULT_GRACE_S,
        help="how long the old token stays valid, e.g. 10m or 0 (seconds without a unit)",
    )
    parser.add_argument(
        "--expires",
        type=duration_arg,
        default=0.0,
        help="the new token's lifetime, e.g. 90d (0: valid until rotated)",
    )
    parser.add_argument(
        "--credentials",
        type=Path,
        default=None,
        help="the credentials file to change (default: DIR/credentials.toml)",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help="write the new token here (0600) instead of printing it",
    )


def run_token(args: argparse.Namespace) -> int:
    path = args.credentials or args.dir / CREDENTIALS_FILE
    try:
        role = _role_of(path, args.name)
        token = rotate_token(path, args.name, grace_s=args.grace, expires_in_s=args.expires)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    token_file = args.token_file or _local_token_file(args.dir, role)
    kept = "the old one is void"
    if args.grace:
        kept = f"the old one is valid for {args.grace:g} s more"
    if token_file is None:
        print(token)
        print(f"rotated the token of {args.name!r}; {kept}", file=sys.stderr)
        return 0
    write_private(token_file, token)
    print(f"rotated the token of {args.name!r} into {token_file}; {kept}")
    return 0


def _role_of(path: Path, name: str) -> Role:
    principal = next((p for p in load_credentials(path).principals if p.name == name), None)
    if principal is None:
        raise ValueError(f"no principal {name!r} in {path}")
    return principal.role


def _local_token_file(root: Path, role: Role) -> Path | None:
    """Where a local cluster keeps the token of ``role``'s principal, if it keeps one."""
    name = {Role.NODE: NODE_TOKEN_FILE, Role.ADMIN: ADMIN_TOKEN_FILE}.get(role)
    path = root / name if name else None
    return path if path is not None and path.exists() else None


def configure_certs(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster rotate-certs``."""
    parser.add_argument("--dir", required=True, type=Path, help="the cluster's directory")
    parser.add_argument("--days", type=float, default=825, help="validity of the new ones")


def run_certs(args: argparse.Namespace) -> int:
    config = load_cluster(args.dir / "cluster.toml")
    tls_dir = args.dir / TLS_DIR
    if not config.tls_enabled or not (tls_dir / "ca.key").exists():
        print(f"error: no local CA in {tls_dir} (start the cluster with --tls)", file=sys.stderr)
        return 1
    for node in config.nodes:
        issue_files(tls_dir, node.id, [node.host], node=True, days=args.days)
    issue_files(tls_dir, "admin", days=args.days)
    print(
        f"issued new certificates for {len(config.nodes)} nodes and the admin in {tls_dir}; "
        "nodes serve them from their next TLS handshake"
    )
    return 0
