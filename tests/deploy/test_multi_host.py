"""The multi-host example cluster map is valid, current and spreads shards across hosts."""

from __future__ import annotations

import tomllib
from collections import Counter

from deploy.multi_host import EXAMPLE_PATH, compact_dict, example_config
from kvstore.config import load_cluster


def test_example_file_is_the_generated_one() -> None:
    on_disk = tomllib.loads(EXAMPLE_PATH.read_text())
    generated = compact_dict(example_config())
    for section in ("nodes", "groups", "codec", "client", "tls", "membership", "node_defaults"):
        assert on_disk[section] == generated[section], (
            f"[{section}] of deploy/cluster.example.toml is stale: "
            "regenerate it with deploy.multi_host.write_example"
        )


def test_example_groups_never_put_two_shards_on_one_host() -> None:
    config = load_cluster(EXAMPLE_PATH)
    assert len(config.nodes) == 24
    for group in config.groups:
        hosts = [config.node(n).failure_domain for n in group]
        assert len(set(hosts)) == len(hosts) == 12, f"two shards share a host in {group}"
    uses = Counter(n for g in config.groups for n in g)
    assert set(uses.values()) == {12}, f"nodes hold unequal numbers of group slots: {uses}"


def test_multi_host_maps_are_secure_by_default() -> None:
    config = load_cluster(EXAMPLE_PATH)
    assert config.tls_enabled, "a multi-host map must not run plaintext gRPC"
    assert all(n.credentials_file and n.tls_cert_file for n in config.nodes)
