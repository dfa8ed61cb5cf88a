"""The cluster map cached beside cluster.toml, for starting while etcd is down."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deploy.local_cluster import local_config
from kvstore.config import save_cluster
from kvstore.map_cache import cache_path, fallback_map, load_cached_map, save_cached_map


def test_the_newest_map_is_cached_and_preferred_over_an_older_seed(tmp_path: Path) -> None:
    seed = local_config(tmp_path, 12)
    cluster_toml = tmp_path / "cluster.toml"
    save_cluster(seed, cluster_toml)
    assert load_cached_map(cluster_toml) is None
    assert fallback_map(cluster_toml) == seed, "no cache: the seed is the map"
    newer = dataclasses.replace(seed, epoch=5)
    assert save_cached_map(cluster_toml, newer)
    assert cache_path(cluster_toml) == tmp_path / "cluster.last-map.toml"
    assert fallback_map(cluster_toml).epoch == 5
    assert save_cached_map(cluster_toml, dataclasses.replace(seed, epoch=3))
    assert load_cached_map(cluster_toml).epoch == 5, "an older map replaced a newer cache"
    save_cluster(dataclasses.replace(seed, epoch=7), cluster_toml)
    assert fallback_map(cluster_toml).epoch == 7, "a seed newer than the cache lost"


def test_an_unwritable_or_damaged_cache_is_no_cache(tmp_path: Path) -> None:
    seed = local_config(tmp_path, 12)
    assert not save_cached_map(tmp_path / "missing-dir" / "cluster.toml", seed)
    cluster_toml = tmp_path / "cluster.toml"
    save_cluster(seed, cluster_toml)
    cache_path(cluster_toml).write_text("not [ toml")
    assert fallback_map(cluster_toml) == seed
