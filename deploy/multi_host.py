"""The cluster map of a multi-host deployment: one failure domain per host.

Pure code. ``multi_host_config`` lays out ``nodes_per_host`` nodes (say, one per NVMe drive)
on each host, makes each host a failure domain, and builds the placement groups with
kvstore.placement.make_groups, so with at least k+m hosts no group puts two shards on one host.
deploy/cluster.example.toml was written by ``write_example``::

    python -c "from deploy.multi_host import write_example; write_example()"

Copy the result to every host (``/etc/kvstore/cluster.toml``) and start one
``kvstore-node@<id>`` systemd unit per node (deploy/systemd/kvstore-node@.service).

The map is secure by default: TLS on every channel (``[tls]``; each host's nodes serve the
host's certificate, ``/etc/kvstore/tls/node.pem``, issued for its name by ``kvstore certs
issue``), and principals from ``/etc/kvstore/credentials.toml`` (the same file on every host,
mode 0600, readable by the nodes only), with the nodes' own token in
``/etc/kvstore/node.token``. The README's security section has the set-up commands.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomli_w

from kvstore.config import ClusterConfig, CodecConfig, NodeConfig, TLSConfig, cluster_to_dict
from kvstore.placement import make_groups

_IDENTITY_FIELDS = ("id", "address", "metrics_port", "failure_domain", "data_dir")

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
    nodes = tuple(
        NodeConfig(
            id=f"{host.split('.')[0]}-{i}",
            address=f"{host}:{port + i}",
            metrics_port=metrics_port + i,
            failure_domain=host,
            data_dir=f"{data_root}/{host.split('.')[0]}-{i}",
            credentials_file=f"{etc_dir}/credentials.toml",
            peer_token_file=f"{etc_dir}/node.token",
            metrics_auth=True,
            tls_cert_file=f"{etc_dir}/tls/node.pem",
            tls_key_file=f"{etc_dir}/tls/node.key",
        )
        for host in hosts
        for i in range(nodes_per_host)
    )
    codec = codec or CodecConfig()
    groups = make_groups([(n.id, n.failure_domain) for n in nodes], codec.num_shards)
    tls = TLSConfig(mode="on", ca_file=f"{etc_dir}/tls/ca.pem")
    return ClusterConfig(epoch=1, nodes=nodes, groups=tuple(groups), codec=codec, tls=tls)


def example_config() -> ClusterConfig:
    return multi_host_config([f"kv{h:02d}.example.internal" for h in range(12)], 2)


def compact_dict(config: ClusterConfig) -> dict[str, Any]:
    """``cluster_to_dict`` with the fields every node shares moved to ``[node_defaults]``."""
    raw = cluster_to_dict(config)
    shared = {k: v for k, v in raw["nodes"][0].items() if k not in _IDENTITY_FIELDS}
    if any({k: n[k] for k in shared} != shared for n in raw["nodes"]):
        return raw
    raw["node_defaults"] = shared
    raw["nodes"] = [{k: n[k] for k in _IDENTITY_FIELDS} for n in raw["nodes"]]
    return raw


def write_example(path: Path = EXAMPLE_PATH) -> None:
    """(Re)write deploy/cluster.example.toml."""
    path.write_text(EXAMPLE_HEADER + tomli_w.dumps(compact_dict(example_config())))
