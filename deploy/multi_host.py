"""The cluster map of a multi-host deployment: one failure domain per host.

Pure code. ``multi_host_config`` lays out ``nodes_per_host`` nodes (say, one per NVMe drive)
on each host, makes each host a failure domain, and builds the placement groups with
kvstore.placement.make_groups, so with at least k+m hosts no group puts two shards on one host.
deploy/cluster.example.toml was written by ``write_example``::

    python -c "from deploy.multi_host import write_example; write_example()"

Copy the result to every host (``/etc/kvstore/cluster.toml``) and start one
``kvstore-node@<id>`` systemd unit per node (deploy/systemd/kvstore-node@.service).

The map is secure by default: TLS on every channel (``[tls]``; each node serves its own
certificate, ``/etc/kvstore/tls/<id>.pem``, which names its node id and its host, issued by
``kvstore certs issue --dir CA <id> --node --host <host>``: clients and peers accept a node only
with its own), and principals from ``/etc/kvstore/credentials.toml`` (the same file on every host,
mode 0600, readable by the nodes only), with the nodes' own token in
``/etc/kvstore/node.token``. docs/security.md has the set-up commands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomli_w

from kvstore.config import (
    ClusterConfig,
    CodecConfig,
    MembershipConfig,
    NodeConfig,
    TLSConfig,
    cluster_to_dict,
)
from kvstore.placement import make_groups

_IDENTITY_FIELDS = ("id", "address", "metrics_port", "failure_domain", "data_dir")
ETCD_EXAMPLE = "etcd.example.internal:2379"  # [membership] of the example map
K8S_ETCD = "etcd-client.kvstore.svc:2379"  # deploy/k8s/etcd.yaml's client Service
K8S_MAP_PATH = Path(__file__).with_name("k8s") / "kvstore-map.yaml"

EXAMPLE_PATH = Path(__file__).with_name("cluster.example.toml")
EXAMPLE_HEADER = """\
# Example cluster map: 12 hosts x 2 nodes (one per NVMe drive), each host a failure domain.
# Written by deploy/multi_host.py (write_example); edit addresses and paths for your hosts.
# Every node and client reads this one file. Never reorder or delete [[groups]] entries:
# a group's position is its identity for placement (kvstore/placement.py).
"""


def multi_host_config(
    hosts: Sequence[str],
    nodes_per_host: int,
    data_root: str = "/var/lib/kvstore",
    port: int = 50100,
    metrics_port: int = 50200,
    codec: CodecConfig | None = None,
    etc_dir: str = "/etc/kvstore",
) -> ClusterConfig:
    """Nodes ``<short host>-<i>`` on ``host:port + i``, data under ``data_root/<id>``, with
    TLS and credentials files under ``etc_dir`` (see the module docstring)."""
    ids = {(host, i): f"{host.split('.')[0]}-{i}" for host in hosts for i in range(nodes_per_host)}
    nodes = tuple(
        NodeConfig(
            id=ids[host, i],
            address=f"{host}:{port + i}",
            metrics_port=metrics_port + i,
            failure_domain=host,
            data_dir=f"{data_root}/{host.split('.')[0]}-{i}",
            credentials_file=f"{etc_dir}/credentials.toml",
            peer_token_file=f"{etc_dir}/node.token",
            metrics_auth=True,
            tls_cert_file=f"{etc_dir}/tls/{ids[host, i]}.pem",
            tls_key_file=f"{etc_dir}/tls/{ids[host, i]}.key",
        )
        for host in hosts
        for i in range(nodes_per_host)
    )
    codec = codec or CodecConfig()
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], codec.num_shards)
    tls = TLSConfig(mode="on", ca_file=f"{etc_dir}/tls/ca.pem")
    return ClusterConfig(epoch=1, nodes=nodes, groups=tuple(groups), codec=codec, tls=tls)


def example_config() -> ClusterConfig:
    config = multi_host_config([f"kv{h:02d}.example.internal" for h in range(12)], 2)
    return dataclasses.replace(config, membership=MembershipConfig(etcd=ETCD_EXAMPLE))


def kubernetes_config(replicas: int = 12, namespace: str = "kvstore") -> ClusterConfig:
    """The seed map of deploy/k8s/kvstore.yaml's StatefulSet: node ``kvstore-N`` is pod
    ``kvstore-N`` (its own failure domain: the pods never share a Kubernetes node), on its
    headless-Service name, its PVC at /var/lib/kvstore, membership on deploy/k8s/etcd.yaml."""
    pods = [f"kvstore-{i}.kvstore.{namespace}.svc" for i in range(replicas)]
    config = multi_host_config(pods, 1)
    nodes = tuple(
        dataclasses.replace(
            n,
            id=n.id.removesuffix("-0"),
            failure_domain=n.id.removesuffix("-0"),
            data_dir="/var/lib/kvstore",
            credentials_file="/etc/kvstore/secrets/credentials.toml",
            peer_token_file="/etc/kvstore/secrets/node.token",
            tls_cert_file=f"/etc/kvstore/tls/{n.id.removesuffix('-0')}.pem",
            tls_key_file=f"/etc/kvstore/tls/{n.id.removesuffix('-0')}.key",
        )
        for n in config.nodes
    )
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], config.codec.num_shards)
    return dataclasses.replace(
        config, nodes=nodes, groups=tuple(groups), membership=MembershipConfig(etcd=K8S_ETCD)
    )


def kubernetes_map_manifest(config: ClusterConfig) -> str:
    """The ConfigMap ``kvstore-map`` holding ``config`` as cluster.toml (YAML text)."""
    toml_text = tomli_w.dumps(compact_dict(config))
    body = "".join(f"    {line}\n" if line else "\n" for line in toml_text.splitlines())
    return (
        "# The seed cluster map of deploy/k8s/kvstore.yaml, written by\n"
        "# deploy.multi_host.write_kubernetes_map; etcd holds the live map once nodes start.\n"
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: kvstore-map\n"
        "  namespace: kvstore\ndata:\n  cluster.toml: |\n" + body
    )


def write_kubernetes_map(path: Path = K8S_MAP_PATH) -> None:
    """(Re)write deploy/k8s/kvstore-map.yaml."""
    path.write_text(kubernetes_map_manifest(kubernetes_config()))


def compact_dict(config: ClusterConfig) -> dict[str, Any]:
    """``cluster_to_dict`` with the fields every node shares moved to ``[node_defaults]``
    (each node keeps its identity and what differs, such as its own certificate)."""
    raw = cluster_to_dict(config)
    for node in raw["nodes"]:
        if node["state"] == "in":  # the default; a seed map's nodes are all in
            del node["state"]
    shared = {
        k: v
        for k, v in raw["nodes"][0].items()
        if k not in _IDENTITY_FIELDS and all(n.get(k) == v for n in raw["nodes"])
    }
    raw["node_defaults"] = shared
    raw["nodes"] = [{k: v for k, v in n.items() if k not in shared} for n in raw["nodes"]]
    return raw


def write_example(path: Path = EXAMPLE_PATH) -> None:
    """(Re)write deploy/cluster.example.toml."""
    path.write_text(EXAMPLE_HEADER + tomli_w.dumps(compact_dict(example_config())))
