"""The ``kvstore cluster`` commands: up, status, down, join, drain, remove, add-tenant
(reweight: deploy/reweight_cli.py).

::

    kvstore cluster up --nodes 12 --dir DIR [--time-scale X] [--backend isal|zfec]
                       [--max-bytes 1GiB] [--no-fsync] [--base-port P] [--auth] [--tls]
                       [--etcd [HOST:PORT]] [--down-out-s 600]
    kvstore cluster status (--dir DIR | --cluster PATH) [--json [PATH]]
    kvstore cluster add-tenant --dir DIR TENANT [--role service --tenants a,b] [--max-ttl ...]
    kvstore cluster join --dir DIR [--id ID] [--address H:P --failure-domain D --data-dir P]
    kvstore cluster drain --dir DIR NODE [--timeout-s 600] [--no-wait]
    kvstore cluster remove --dir DIR NODE
    kvstore cluster down --dir DIR

Each command is a ``configure_<name>`` (its flags) and a ``run_<name>`` that kvstore/cli/
commands.py calls; the work is the library's (deploy/local_cluster.py, which documents the
layout of DIR). Errors are printed, with exit status 1, not raised.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from deploy.cluster_status import print_status
from deploy.local_cluster import DEFAULT_DOWN_OUT_S, DRAIN_TIMEOUT_S, LOCAL_ETCD, LocalCluster
from deploy.local_etcd import stop_etcd
from deploy.local_pids import is_node_process, read_pids, stop_pids, write_pids
from deploy.local_secrets import (
    ADMIN_TOKEN_FILE,
    CREDENTIALS_FILE,
    local_admin_token,
    local_client_cert,
    provision_integrity,
)
from kvstore.auth import Role, add_principal, set_tenant_caps
from kvstore.cli.args import duration_arg, is_stdout, list_arg, size_arg
from kvstore.config import ClusterConfig, load_cluster
from kvstore.errors import ERRORS, InvalidArgument
from kvstore.map_changes import changed_slots, drain, join
from ttl.units import parse_duration_s


def _add_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, type=Path, help="the cluster's directory")


def configure_up(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster up``."""
    _add_dir(parser)
    parser.add_argument("--nodes", type=int, default=12, help="number of nodes (at least k+m)")
    parser.add_argument(
        "--time-scale", type=float, default=1.0, help="virtual seconds per real second"
    )
    parser.add_argument(
        "--backend", choices=["isal", "zfec"], default="isal", help="erasure code backend"
    )
    parser.add_argument(
        "--max-bytes",
        type=size_arg,
        default=0,
        help="per-node limit for shard data, e.g. 1GiB; 0 = the disk's free space",
    )
    parser.add_argument("--no-fsync", action="store_true", help="skip fsync (tests only)")
    parser.add_argument(
        "--base-port", type=int, default=None, help="first port to use (default: free ports)"
    )
    _add_security_flags(parser)
    _add_membership_flags(parser)


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    """``up``'s credentials, TLS and encryption-at-rest flags (deploy/local_cluster.secure)."""
    parser.add_argument(
        "--auth",
        action="store_true",
        help="require credentials: write DIR/credentials.toml and an admin token (DIR/admin.token)",
    )
    parser.add_argument(
        "--tls", action="store_true", help="TLS on every channel: a dev CA and node certificates"
    )
    parser.add_argument(
        "--mtls", action="store_true", help="like --tls, and clients must present certificates"
    )
    parser.add_argument(
        "--encrypt",
        type=list_arg(str),
        default=[],
        help="tenants whose blocks clients seal (AES-GCM; DIR/master.key, DIR/keyring.json)",
    )


def _add_membership_flags(parser: argparse.ArgumentParser) -> None:
    """``up``'s etcd membership flags (without them the map is the static cluster.toml)."""
    parser.add_argument(
        "--etcd",
        nargs="?",
        const=LOCAL_ETCD,
        default=None,
        metavar="ENDPOINT",
        help="membership on etcd at HOST:PORT; without ENDPOINT start a local etcd from the "
        "etcd binary (DIR/etcd); absent: the static cluster.toml",
    )
    parser.add_argument(
        "--down-out-s",
        type=duration_arg,
        default=DEFAULT_DOWN_OUT_S,
        help="with --etcd: a node down this long (cluster clock) is marked out and replaced",
    )


def run_up(args: argparse.Namespace) -> int:
    return report_errors(_up, args)


def configure_add_tenant(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster add-tenant``."""
    _add_dir(parser)
    parser.add_argument("tenant", help="the tenant (or service) name; its token is printed")
    parser.add_argument(
        "--role",
        choices=[Role.TENANT.value, Role.SERVICE.value, Role.ADMIN.value, Role.NODE.value],
        default=Role.TENANT.value,
        help="tenant: its own blocks; service: acts for --tenants; admin: stats and purge",
    )
    parser.add_argument(
        "--tenants",
        type=list_arg(str),
        default=[],
        help="for --role service: the tenants it may act for, comma-separated ('*' = any)",
    )
    parser.add_argument(
        "--max-ttl",
        type=list_arg(_class_cap),
        default=[],
        help="retention caps for this tenant, e.g. chat=1d,agent=12h (nodes enforce them)",
    )
    parser.add_argument(
        "--credentials",
        type=Path,
        default=None,
        help="the credentials file to change (default: DIR/credentials.toml)",
    )
    parser.add_argument(
        "--cert-identity", default="", help="common name of its mTLS client certificate"
    )
    parser.add_argument(
        "--expires",
        type=duration_arg,
        default=0.0,
        help="the token's lifetime, e.g. 90d (0: valid until `cluster rotate-token`)",
    )
    parser.add_argument(
        "--integrity-keys",
        type=Path,
        default=None,
        help="the integrity key file to add the tenant's key to (default: DIR/cluster.toml's)",
    )


def _class_cap(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"a cap is CLASS=DURATION like chat=1d, got {text!r}")
    return name.strip(), parse_duration_s(value.strip())


def run_add_tenant(args: argparse.Namespace) -> int:
    return report_errors(_add_tenant, args)


def _add_tenant(args: argparse.Namespace) -> int:
    if args.credentials is None:
        existing_map(args.dir / "cluster.toml")
    path = args.credentials or args.dir / CREDENTIALS_FILE
    role = Role(args.role)
    token = add_principal(
        path,
        args.tenant,
        role,
        frozenset(args.tenants),
        cert_identity=args.cert_identity,
        expires_in_s=args.expires,
    )
    if args.max_ttl:
        set_tenant_caps(path, args.tenant, dict(args.max_ttl))
    key_file = _integrity_key_file(args)
    made = provision_integrity(key_file, args.tenant, role, args.tenants)
    if made:
        print(f"integrity keys made in {key_file}: {', '.join(made)}", file=sys.stderr)
    print(token)
    return 0


def _integrity_key_file(args: argparse.Namespace) -> str:
    """The integrity key file add-tenant adds keys to: ``--integrity-keys``, else DIR's
    cluster.toml's (``[integrity] key_file``), else none."""
    if args.integrity_keys is not None:
        return str(args.integrity_keys)
    toml = args.dir / "cluster.toml"
    return load_cluster(toml).integrity.key_file if toml.exists() else ""


def add_cluster_location(parser: argparse.ArgumentParser) -> None:
    """``--dir DIR`` (a local cluster's) or ``--cluster PATH`` (any cluster.toml), one of."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--dir", type=Path, help="the cluster's directory (cluster up)")
    where.add_argument("--cluster", type=Path, help="or any cluster: its cluster.toml")


def configure_status(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster status``."""
    add_cluster_location(parser)
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        type=Path,
        metavar="PATH",
        help="the status as JSON at PATH instead of tables (--json alone: standard output)",
    )


def run_status(args: argparse.Namespace) -> int:
    return report_errors(_status, args)


def _status(args: argparse.Namespace) -> int:
    cluster_toml = args.cluster or args.dir / "cluster.toml"
    root = cluster_toml.parent
    config = load_cluster(existing_map(cluster_toml))
    status = partial(
        print_status,
        root,
        read_pids(root),
        as_json=args.json is not None,
        token=local_admin_token(root),
        client_cert=local_client_cert(root, config),
        cluster_toml=cluster_toml,
    )
    if args.json is None:
        return status()
    if not is_stdout(args.json):
        args.json.parent.mkdir(parents=True, exist_ok=True)
    with args.json.open("w") as out, contextlib.redirect_stdout(out):
        return status()


def existing_map(cluster_toml: Path) -> Path:
    """``cluster_toml``, or InvalidArgument saying what is missing (no traceback)."""
    if cluster_toml.is_file():
        return cluster_toml
    root = cluster_toml.parent
    what = "no such directory" if not root.is_dir() else f"no {cluster_toml.name} in it"
    raise InvalidArgument(
        f"{root}: {what}; give the directory of a `kvstore cluster up` (--dir) or a "
        "cluster.toml (--cluster, or $KVSTORE_CLUSTER)"
    )


def configure_join(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster join``."""
    _add_dir(parser)
    parser.add_argument("--id", default=None, help="the new node's id (default: the next nNN)")
    parser.add_argument(
        "--address",
        default=None,
        help="host:port of a node started elsewhere (default: start one here on 127.0.0.1)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="with --address: its metrics port"
    )
    parser.add_argument("--failure-domain", default=None, help="with --address: its host or rack")
    parser.add_argument("--data-dir", default=None, help="with --address: its data directory")


def run_join(args: argparse.Namespace) -> int:
    return report_errors(_join, args)


def _join(args: argparse.Namespace) -> int:
    cluster = _attached(args.dir)
    before = cluster.current_map()
    if args.address is None:
        node = cluster.join_node(args.id)
        print(f"node {node.id} joined on {node.address} (pid {cluster.procs[node.id].pid})")
    else:
        if not (args.id and args.failure_domain and args.data_dir):
            raise InvalidArgument("--address needs --id, --failure-domain and --data-dir too")
        node = dataclasses.replace(
            before.nodes[0],
            id=args.id,
            address=args.address,
            metrics_port=args.metrics_port,
            failure_domain=args.failure_domain,
            data_dir=args.data_dir,
            state="in",
        )
        cluster.change_map(lambda c: join(c, node))
        print(
            f"node {node.id} joined the map; start it on its host: "
            f"`kvstore node --config cluster.toml --id {node.id}`"
        )
    _print_move(before, cluster.config)
    return 0


def _print_move(before: ClusterConfig, after: ClusterConfig) -> None:
    slots = changed_slots(before.groups, after.groups)
    print(
        f"map epoch {before.epoch} -> {after.epoch}: {len(slots)} of "
        f"{sum(map(len, after.groups))} group slots move; repair fills them, and the keeper "
        "finishes the move once verified (`kvstore cluster status`)"
    )


def configure_drain(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster drain``."""
    _add_dir(parser)
    parser.add_argument("node", help="id of the node to drain")
    parser.add_argument(
        "--timeout-s", type=duration_arg, default=DRAIN_TIMEOUT_S, help="how long to wait"
    )
    parser.add_argument("--no-wait", action="store_true", help="start the drain and return")


def run_drain(args: argparse.Namespace) -> int:
    return report_errors(_drain, args)


def _drain(args: argparse.Namespace) -> int:
    cluster = _attached(args.dir)
    before = cluster.current_map()
    if args.no_wait:
        cluster.change_map(lambda c: drain(c, args.node))
        _print_move(before, cluster.config)
        return 0
    started_s = time.monotonic()
    after = cluster.drain_node(args.node, args.timeout_s)
    print(
        f"node {args.node} drained in {time.monotonic() - started_s:.1f} s: its shards are on "
        f"their new nodes (verified), map epoch {after.epoch}; remove it with "
        f"`kvstore cluster remove --dir {args.dir} {args.node}`"
    )
    return 0


def configure_remove(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster remove``."""
    _add_dir(parser)
    parser.add_argument("node", help="id of a drained ('left') node")


def run_remove(args: argparse.Namespace) -> int:
    return report_errors(_remove, args)


def _remove(args: argparse.Namespace) -> int:
    cluster = _attached(args.dir)
    pid = read_pids(args.dir).get(args.node)
    after = cluster.remove_node(args.node)
    stopped = ""
    if pid is not None and is_node_process(pid, args.node):
        stop_pids({args.node: pid})
        stopped = f"; stopped its process (pid {pid})"
        write_pids(args.dir, {n: p for n, p in read_pids(args.dir).items() if n != args.node})
    print(f"node {args.node} removed from the map (epoch {after.epoch}){stopped}")
    return 0


def _attached(root: Path) -> LocalCluster:
    """The cluster of ``root`` as the CLI sees it (its processes are not ours)."""
    return LocalCluster(root, load_cluster(existing_map(root / "cluster.toml")))


def configure_down(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvstore cluster down``."""
    _add_dir(parser)


def run_down(args: argparse.Namespace) -> int:
    return report_errors(_down, args)


def report_errors(action: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one cluster action; errors are printed, not raised."""
    try:
        return action(args)
    except (*ERRORS, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _down(args: argparse.Namespace) -> int:
    existing_map(args.dir / "cluster.toml")
    node_to_pid = read_pids(args.dir)
    running = {n: pid for n, pid in node_to_pid.items() if is_node_process(pid, n)}
    stop_pids(node_to_pid)
    write_pids(args.dir, {})
    if running:
        print(
            f"stopped {len(running)} node{'s' if len(running) != 1 else ''}: "
            + ", ".join(f"{n} (pid {p})" for n, p in sorted(running.items()))
        )
    else:
        print(f"no node of {args.dir} was running")
    etcd = stop_etcd(args.dir)
    if etcd is not None:
        print(f"stopped etcd (pid {etcd}); its data stays in {args.dir / 'etcd'}")
    return 0


def _up(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {"max_bytes": args.max_bytes}
    if args.no_fsync:
        overrides["fsync"] = False
    cluster = LocalCluster.start(
        args.dir,
        args.nodes,
        args.time_scale,
        backend=args.backend,
        base_port=args.base_port,
        auth=args.auth,
        tls=args.tls,
        mtls=args.mtls,
        encrypt=args.encrypt,
        etcd=args.etcd,
        down_out_s=args.down_out_s,
        **overrides,
    )
    print(f"{len(cluster.procs)} nodes serving; cluster map: {cluster.cluster_toml}")
    if cluster.config.membership.endpoints:
        print(
            f"membership on etcd {cluster.config.membership.etcd} (map epoch "
            f"{cluster.config.epoch}, down->out after {args.down_out_s:g} s)"
        )
    if args.auth:
        print(
            f"auth on: admin token in {args.dir / ADMIN_TOKEN_FILE}; add tenants with "
            f"`kvstore cluster add-tenant --dir {args.dir} TENANT`"
        )
    return 0
