"""``[ttl] eviction_order`` in cluster.toml: default, validation, loading and round trip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deploy.multi_host import compact_dict, example_config
from kvstore.config import TTLConfig, cluster_from_dict, load_cluster, save_cluster
from tests.kvstore.node_harness import write_config
from ttl.policy import DEFAULT_EVICTION_ORDER, EvictionOrder

_MINIMAL_TOML = """
epoch = 1
[codec]
k = 1
m = 0
backend = "zfec"
[client]
read_fanout = 1
write_quorum = 1
[ttl]
{ttl_line}
[[nodes]]
id = "n0"
address = "127.0.0.1:1"
metrics_port = 0
failure_domain = "d0"
data_dir = "/tmp/unused"
[[groups]]
nodes = ["n0"]
"""


def test_default_is_lru() -> None:
    assert DEFAULT_EVICTION_ORDER is EvictionOrder.LRU
    assert TTLConfig().eviction_order == "lru" and TTLConfig().eviction is EvictionOrder.LRU


def test_unknown_order_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"choose 'lru'.*or 'expiry'"):
        TTLConfig(eviction_order="fifo")


@pytest.mark.parametrize(
    ("ttl_line", "expected"),
    [("", EvictionOrder.LRU), ('eviction_order = "expiry"', EvictionOrder.EXPIRY)],
)
def test_loaded_from_the_ttl_section(
    tmp_path: Path, ttl_line: str, expected: EvictionOrder
) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(_MINIMAL_TOML.format(ttl_line=ttl_line))
    assert load_cluster(path).ttl.eviction is expected, "[ttl] eviction_order not honoured"


def test_bad_order_in_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(_MINIMAL_TOML.format(ttl_line='eviction_order = "random"'))
    with pytest.raises(ValueError, match=r"cluster\.toml.*eviction_order 'random'"):
        load_cluster(path)


@pytest.mark.parametrize("eviction_order", ["lru", "expiry"])
def test_round_trips_through_save_and_load(tmp_path: Path, eviction_order: str) -> None:
    cluster = load_cluster(write_config(tmp_path, eviction_order=eviction_order))
    assert cluster.ttl.eviction_order == eviction_order
    again = tmp_path / "again.toml"
    save_cluster(cluster, again)
    assert 'eviction_order = "' + eviction_order + '"' in again.read_text()
    assert load_cluster(again) == cluster, "save_cluster/load_cluster changed the config"


def test_sizes_and_durations_take_units(tmp_path: Path) -> None:
    toml = _MINIMAL_TOML.format(ttl_line='expiry_window_s = "90m"').replace(
        'data_dir = "/tmp/unused"',
        'data_dir = "/tmp/unused"\nmax_bytes = "1GiB"\nscrub_bytes_per_s = "64MiB"\n'
        'scrub_pass_interval_s = "2h"',
    )
    path = tmp_path / "cluster.toml"
    path.write_text(toml)
    cluster = load_cluster(path)
    node = cluster.nodes[0]
    assert (node.max_bytes, node.scrub_bytes_per_s) == (1 << 30, 64 << 20), "sizes with units"
    assert (node.scrub_pass_interval_s, cluster.ttl.expiry_window_s) == (7200.0, 5400.0)
    path.write_text(toml.replace('"1GiB"', '"lots"'))
    with pytest.raises(ValueError, match="bad size 'lots'"):
        load_cluster(path)


def test_plaintext_to_remote_nodes_and_the_shared_token_are_refused() -> None:
    raw = compact_dict(example_config())
    raw["tls"] = {"mode": "off"}
    with pytest.raises(ValueError, match="plaintext"):
        cluster_from_dict(raw)
    raw["tls"] = {"mode": "auto"}  # on, because the nodes are off loopback: needs a CA
    with pytest.raises(ValueError, match="ca_file"):
        cluster_from_dict(raw)
    raw = compact_dict(example_config())
    raw["node_defaults"]["auth_token"] = "s3cret"
    with pytest.raises(ValueError, match="credentials_file"):
        cluster_from_dict(raw)


def _load(tmp_path: Path, toml: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(toml)
    load_cluster(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('address = "127.0.0.1:1"', 'address = "127.0.0.1:99999"'), "port in 1..65535"),
        (("metrics_port = 0", "metrics_port = 70000"), "metrics_port 70000"),
        (("epoch = 1", "epoch = 1\n[clinet]\nread_fanout = 1"), "unknown section or key 'clinet'"),
        (("read_fanout = 1", "read_fanout = 1\nread_fan_out = 2"), "unknown key 'read_fan_out'"),
        (('data_dir = "/tmp/unused"', 'data_dir = "/tmp/unused"\nfsync = "yes"'), "fsync"),
        (("write_quorum = 1", 'write_quorum = "one"'), "write_quorum must be an integer"),
        (("k = 1", "k = 1.5"), "[codec] k must be an integer"),
        (("{ttl_line}", 'time_scale = "fast"'), "time_scale"),
        (("{ttl_line}", 'expiry_window_s = "1 fortnight"'), "expiry_window_s"),
        (('data_dir = "/tmp/unused"', 'data_dir = "/tmp/unused"\nmax_bytes = true'), "max_bytes"),
        (('failure_domain = "d0"\n', ""), "lacks failure_domain"),
        (('nodes = ["n0"]', 'nodes = "n0"'), "nodes must be a list of node ids"),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    old, new = change
    toml = _MINIMAL_TOML.replace(old, new).replace("{ttl_line}", "")
    assert toml != _MINIMAL_TOML.replace("{ttl_line}", ""), "the change did not apply"
    with pytest.raises(ValueError, match=re.escape(message)):
        _load(tmp_path, toml)


def test_sizes_and_durations_with_units_still_load(tmp_path: Path) -> None:
    toml = _MINIMAL_TOML.replace("{ttl_line}", 'expiry_window_s = "1h"').replace(
        'data_dir = "/tmp/unused"', 'data_dir = "/tmp/unused"\nmax_bytes = "30GiB"\nfsync = false'
    )
    path = tmp_path / "cluster.toml"
    path.write_text(toml)
    cluster = load_cluster(path)
    assert cluster.nodes[0].max_bytes == 30 << 30 and cluster.nodes[0].fsync is False
    assert cluster.ttl.expiry_window_s == 3600.0
