"""The last cluster map seen from etcd, cached on disk beside ``cluster.toml``.

With ``[membership] etcd`` the file only seeds the map; the map in force lives in etcd. So that
nothing new (a client connecting, ``kvstore cluster status``, a node restarting) needs etcd to
start, every process that reads etcd's map also writes it here, and falls back to it when etcd
does not answer::

    DIR/cluster.toml             the seed (or, for a local cluster, a copy of the latest map)
    DIR/cluster.last-map.toml    the newest map any process here read from etcd

:func:`fallback_map` picks the newer of the two (by epoch). A process running on it marks its
map stale until etcd answers again (client/map_follower.py); the map's epoch only grows, so an
equal epoch from etcd later is the same map. Writing is best effort: a directory the process
may not write (a root-owned /etc/kvstore) only means there is no cache there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvstore.config import ClusterConfig, cluster_from_toml, cluster_to_toml, load_cluster

log = logging.getLogger(__name__)

CACHE_SUFFIX = ".last-map.toml"


def cache_path(cluster_toml: str | Path) -> Path:
    """``DIR/cluster.last-map.toml`` for ``DIR/cluster.toml``."""
    path = Path(cluster_toml)
    return path.with_name(path.stem + CACHE_SUFFIX)


def save_cached_map(cluster_toml: str | Path, cfg: ClusterConfig) -> bool:
    """Write ``cfg`` as the cached map unless the cache already holds this epoch or a newer
    one (several processes share it); False when it could not be written."""
    target = cache_path(cluster_toml)
    cached = load_cached_map(cluster_toml)
    if cached is not None and cached.epoch >= cfg.epoch:
        return True
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # one writer per temp file
    try:
        tmp.write_text(cluster_to_toml(cfg))
        tmp.replace(target)
    except OSError as exc:
        log.debug("cluster map not cached in %s: %s", target, exc)
        tmp.unlink(missing_ok=True)
        return False
    return True


def load_cached_map(cluster_toml: str | Path) -> ClusterConfig | None:
    """The cached map, or None when there is none (or it does not parse)."""
    path = cache_path(cluster_toml)
    try:
        return cluster_from_toml(path.read_text(), str(path))
    except (OSError, ValueError) as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("the cached cluster map %s is unusable: %s", path, exc)
        return None


def fallback_map(cluster_toml: str | Path, seed: ClusterConfig | None = None) -> ClusterConfig:
    """The map to run on while etcd does not answer: the cached one, or ``seed`` (the file's,
    read from ``cluster_toml`` when not given) when that is newer or there is no cache."""
    seed = seed if seed is not None else load_cluster(cluster_toml)
    cached = load_cached_map(cluster_toml)
    return cached if cached is not None and cached.epoch >= seed.epoch else seed
