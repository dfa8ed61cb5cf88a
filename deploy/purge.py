"""``kvstore purge --tenant T``: delete every block of a tenant and destroy its data key.

::

    kvstore purge --tenant T (--dir DIR | --cluster DIR/cluster.toml) [--wait] [--timeout 60s]
                  [--json [PATH]]

Sends ``Purge`` (an admin call) to every node at once. Each node deletes the tenant's shards,
destroys their records' bytes on disk (kvstore/store/deletion.py) and logs the purge in its delete
log, and answers what it removed. A node that is down applies the purge from its peers' logs
when it returns (kvstore/node/tombstones.py); ``--wait`` keeps asking the nodes that did not answer
until each has, or the timeout passes. With encryption on for the tenant (``[encryption]``),
the tenant's data keys are destroyed too (crypto-shredding, client/keyring.py): every sealed
copy anywhere, a node that never returns included, is unreadable from then on.

The admin token comes from DIR/admin.token (``cluster up --auth``), else ``$KVSTORE_TOKEN`` /
``$KVSTORE_TOKEN_FILE``. Exit status 0 when every node confirmed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from rich.table import Table

from client.keyring import open_keyring
from deploy.cluster_cli import add_cluster_location
from deploy.local_secrets import local_admin_token, local_client_cert
from kvstore.auth import client_token
from kvstore.cli.args import duration_arg, write_json
from kvstore.cli.tables import make_console, print_fitted
from kvstore.config import ClusterConfig, load_cluster
from kvstore.grpc_errors import from_grpc_status
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.tls import channel_credentials, sync_channel
from ttl.units import format_bytes

CALL_TIMEOUT_S = 30.0
RETRY_S = 1.0


@dataclass
class NodePurge:
    """One node's answer (or why there is none yet)."""

    node_id: str
    done: bool = False
    num_deleted: int = 0
    bytes_erased: int = 0
    error: str = ""


def purge_nodes(
    config: ClusterConfig,
    tenant: str,
    token: str | None,
    client_cert: tuple[str | None, str | None] = (None, None),
    *,
    wait_s: float = 0.0,
) -> dict[str, NodePurge]:
    """Purge ``tenant`` on every node; retry the ones that did not answer for ``wait_s``."""
    credentials = channel_credentials(config, *client_cert)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    results = {n.id: NodePurge(n.id) for n in config.nodes}
    deadline_s = time.monotonic() + wait_s
    while True:
        pending = [n for n in config.nodes if not results[n.id].done]
        channels = {n.id: sync_channel(n.address, credentials, node_id=n.id) for n in pending}
        try:
            futures = {
                n.id: ShardStoreStub(channels[n.id]).Purge.future(
                    pb.PurgeRequest(tenant=tenant), timeout=CALL_TIMEOUT_S, metadata=metadata
                )
                for n in pending
            }
            for node_id, future in futures.items():
                results[node_id] = _outcome(node_id, future)
        finally:
            for channel in channels.values():
                channel.close()
        if all(r.done for r in results.values()) or time.monotonic() >= deadline_s:
            return results
        time.sleep(RETRY_S)


def _outcome(node_id: str, future: grpc.Future) -> NodePurge:
    try:
        reply = future.result()
    except grpc.RpcError as exc:
        error = from_grpc_status(exc.code(), exc.details())
        return NodePurge(node_id, error=str(error))
    return NodePurge(node_id, True, reply.num_deleted, reply.bytes_erased)


def shred_keys(config: ClusterConfig, tenant: str) -> bool | None:
    """Destroy the tenant's data keys; None when its blocks are not encrypted."""
    if not config.encryption.covers(tenant):
        return None
    return open_keyring(config.encryption).destroy(tenant)


def _table(tenant: str, results: dict[str, NodePurge]) -> Table:
    table = Table(title=f"purge of tenant {tenant!r}")
    for column in ("node", "status", "shards removed", "bytes erased"):
        table.add_column(column, justify="left" if column in ("node", "status") else "right")
    for r in results.values():
        status = "[green]done[/green]" if r.done else f"[red]pending[/red]: {r.error}"
        table.add_row(r.node_id, status, str(r.num_deleted), format_bytes(r.bytes_erased))
    return table


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", required=True, help="the tenant whose blocks go")
    add_cluster_location(parser)
    parser.add_argument(
        "--wait", action="store_true", help="keep asking nodes that did not answer (--timeout)"
    )
    parser.add_argument(
        "--timeout", type=duration_arg, default=60.0, help="how long --wait keeps asking, e.g. 5m"
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        type=Path,
        metavar="PATH",
        help="the result as JSON at PATH instead of a table (--json alone: standard output)",
    )


def run(args: argparse.Namespace) -> int:
    cluster_toml = args.cluster or args.dir / "cluster.toml"
    try:
        config = load_cluster(cluster_toml)
        root = cluster_toml.parent
        token = client_token(local_admin_token(root) if args.dir else None)
        client_cert = local_client_cert(root, config) if args.dir else (None, None)
        results = purge_nodes(
            config, args.tenant, token, client_cert, wait_s=args.timeout if args.wait else 0.0
        )
        shredded = shred_keys(config, args.tenant)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    document: dict[str, Any] = {
        "tenant": args.tenant,
        "data_key_destroyed": shredded,
        "nodes": [asdict(r) for r in results.values()],
    }
    if args.json is not None:
        write_json(document, args.json)
    else:
        print_fitted(_table(args.tenant, results), make_console(), keep=("status",))
        if shredded is not None:
            print(f"data key of {args.tenant!r}: {'destroyed' if shredded else 'none held'}")
        if not all(r.done for r in results.values()):
            print("pending nodes apply the purge from their peers' delete logs when they return")
    return 0 if all(r.done for r in results.values()) else 1
