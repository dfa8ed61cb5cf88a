"""Placement: which nodes hold a block's shards, and how a cluster's groups are built.

Pure code: no I/O, no clock. Clients and tools call it; nodes never need it.

**Key -> group** is rendezvous (highest-random-weight) hashing: every placement group scores
``xxh3_64(group_id || key)`` and the highest score wins. A group's id is its position in the
``[[groups]]`` list of ``cluster.toml`` (4 bytes, little-endian), so

* adding a group moves only the keys the new group wins, about ``1/(G+1)`` of them, and each
  moved key moves *to* the new group (never between old groups);
* replacing a failed node inside a group keeps that group's keys where they are.

Groups are therefore append-only: never reorder or delete entries of ``[[groups]]``.
Shard ``i`` of a block lives on ``group[i]``.

**Group generation** (:func:`make_groups`) for N nodes and groups of ``width = k + m``:
N groups are built one after another (N >= width). Group ``g`` takes nodes one at a time,
always picking the candidate whose failure domain is least represented in the group so far,
then the node used in the fewest groups so far, then the node closest after position ``g``
in the domain-interleaved ring. Consequences:

* whenever the cluster has at least ``width`` failure domains, no two shards of a group share a
  domain; with fewer domains each group spreads evenly (at most ``ceil(width / D)`` per domain);
* every node is used, and nodes hold (nearly) equal numbers of group slots, ``width`` each in
  balanced clusters, so reads and parity work spread evenly over the nodes;
* for a 12-node local cluster (each node its own domain) group ``g`` is the node list rotated
  by ``g``: every node holds each shard index once, and no node is always the idle 12th.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import xxhash

from kvstore.config import KEY_BYTES, ClusterConfig
from kvstore.errors import InvalidArgument
from kvstore.placement_weights import map_group_weights
from ttl import simloop

_GROUP_ID = struct.Struct("<I")
_TO_UNIT = 2.0**-64


def group_of_key(key: bytes, num_groups: int, weights: Sequence[int] | None = None) -> int:
    """Index of the placement group that holds ``key`` among ``num_groups`` groups
    (``weights``: the groups' integer weights, kvstore/placement_weights.py; None: equal)."""
    group_ids = [_GROUP_ID.pack(g) for g in range(num_groups)]
    if weights is None:
        return _highest_score(key, group_ids)
    return _highest_weighted_score(key, group_ids, weights)


def _highest_score(key: bytes, group_ids: list[bytes]) -> int:
    """Rendezvous hashing: the group whose ``xxh3_64(group_id || key)`` is highest."""
    best_index, best_score = 0, -1
    for index, group_id in enumerate(group_ids):
        score = xxhash.xxh3_64_intdigest(group_id + key)
        if score > best_score:
            best_index, best_score = index, score
    return best_index


def _highest_weighted_score(key: bytes, group_ids: list[bytes], weights: Sequence[int]) -> int:
    """Weighted rendezvous: the group with the highest ``w / -ln(u)``, ``u`` the group's
    ``xxh3_64(group_id || key)`` scaled into (0, 1); i.e. the lowest ``-ln(u) / w``. Group
    ``g`` wins ``w_g / sum(w)`` of the keys."""
    best_index, best_cost = 0, math.inf
    for index, (group_id, weight) in enumerate(zip(group_ids, weights, strict=True)):
        u = (xxhash.xxh3_64_intdigest(group_id + key) + 0.5) * _TO_UNIT
        cost = -math.log(u) / weight
        if cost < best_cost:
            best_index, best_cost = index, cost
    return best_index


class Placement:
    """The cluster map's placement: key -> group index -> node ids (shard i on nodes[i]).

    Groups are weighted as the map records, or by their nodes' byte limits
    (kvstore/placement_weights.py ``map_group_weights``); with equal limits this is plain
    rendezvous."""

    def __init__(self, config: ClusterConfig) -> None:
        self.groups: tuple[tuple[str, ...], ...] = config.groups
        self._group_ids = [_GROUP_ID.pack(g) for g in range(len(self.groups))]
        self.weights = map_group_weights(config)

    def group_index(self, key: bytes) -> int:
        """Which group holds ``key``; raises InvalidArgument for a key of the wrong size."""
        if self.weights is None:
            return _highest_score(check_key(key), self._group_ids)
        return _highest_weighted_score(check_key(key), self._group_ids, self.weights)

    def nodes_for_key(self, key: bytes) -> tuple[str, ...]:
        """The k+m node ids of the key's group; shard i goes to element i."""
        return self.groups[self.group_index(key)]

    def keys_by_group(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """Group index -> positions in ``keys`` of the keys it holds (one pass, stable order)."""
        group_to_positions: dict[int, list[int]] = {}
        for position, key in enumerate(keys):
            group_to_positions.setdefault(self.group_index(key), []).append(position)
        return group_to_positions


def check_key(key: object) -> bytes:
    """Return ``key`` if it is a 16-byte bytes object, else raise InvalidArgument with advice."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        got = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
        raise InvalidArgument(
            f"a block key must be {KEY_BYTES} bytes (an xxh3-128 digest), got {got}; "
            "make keys with client.block_keys(...)"
        )
    return key


def interleave_domains(node_to_domain: Sequence[tuple[str, str]]) -> list[str]:
    """Node ids ordered round-robin across failure domains (largest domains first)."""
    domain_to_nodes: dict[str, list[str]] = {}
    for node_id, domain in sorted(node_to_domain):
        domain_to_nodes.setdefault(domain, []).append(node_id)
    queues = sorted(domain_to_nodes.values(), key=lambda ids: (-len(ids), ids[0]))
    ring: list[str] = []
    for depth in range(max(len(q) for q in queues)):
        ring += [q[depth] for q in queues if depth < len(q)]
    return ring


def make_groups(
    node_to_domain: Sequence[tuple[str, str]],
    width: int,
    num_groups: int | None = None,
    node_to_weight: Mapping[str, float] | None = None,
) -> list[tuple[str, ...]]:
    """Placement groups of ``width`` nodes for ``(node_id, failure_domain)`` pairs.

    Builds ``num_groups`` groups (default: one per node); see the module docstring for the rule.
    With ``node_to_weight`` (byte limits), "least used" is uses per unit of weight, so a node
    with half the space is in about half as many groups. Raises InvalidArgument when there are
    fewer nodes than ``width``.
    """
    if len(node_to_domain) < width:
        raise InvalidArgument(
            f"{len(node_to_domain)} nodes cannot hold groups of k+m = {width} shards; "
            f"start at least {width} nodes"
        )
    ring = interleave_domains(node_to_domain)
    weight = dict.fromkeys(ring, 1.0) if node_to_weight is None else node_to_weight
    num_uses: Counter[str] = Counter()
    groups = []
    for g in range(len(ring) if num_groups is None else num_groups):
        group = _build_group(ring, dict(node_to_domain), num_uses, weight, start=g, width=width)
        num_uses.update(group)
        groups.append(group)
    return groups


def _build_group(
    ring: list[str],
    domain_of: dict[str, str],
    num_uses: Counter[str],
    weight: Mapping[str, float],
    start: int,
    width: int,
) -> tuple[str, ...]:
    """Greedy: least-represented domain, then least-used node (per unit of weight), then ring
    order from ``start``."""
    rotated = ring[start % len(ring) :] + ring[: start % len(ring)]
    group: list[str] = []
    domain_counts: Counter[str] = Counter()
    for _ in range(width):
        candidates = [n for n in rotated if n not in group]
        # min() keeps the first of equal candidates, i.e. the one nearest after ``start``.
        best = min(candidates, key=lambda n: (domain_counts[domain_of[n]], num_uses[n] / weight[n]))
        group.append(best)
        domain_counts[domain_of[best]] += 1
    return tuple(group)


# XXH3's default secret, bytes [0, 32) as little-endian u64: with the length term below, what
# ``groups_of_keys`` needs to compute xxh3_64 of 20-byte inputs (group id || key) in numpy
# (uint64 arithmetic wraps, as XXH3's does).
_XXH3_SECRET = np.frombuffer(
    bytes.fromhex("b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"), "<u8"
)
_XXH3_LEN20 = np.uint64(20 * 0x9E3779B185EBCA87 % 2**64)  # input length x XXH_PRIME64_1
_M32 = np.uint64(0xFFFFFFFF)


def groups_of_keys(
    keys: np.ndarray, num_groups: int, weights: Sequence[int] | None = None
) -> np.ndarray:
    """``group_of_key`` for many keys at once: ``keys`` is uint8 [n, 16] (or its little-endian
    uint64 [n, 2] view); returns int64 [n]. The same rendezvous scores, xxh3_64 of
    ``group_id || key``, computed in C where ``ttl/_simloop.so`` is built (bit for bit as
    :func:`group_of_key`, weighted or not), else with numpy over the batch (one pass per group;
    with ``weights``, numpy's log may differ from libm's in the last bit: a key at a near-tie
    may land elsewhere)."""
    words = _key_words(keys)
    if simloop.NATIVE:
        return simloop.rendezvous_groups(words, num_groups, weights)
    k0, k1 = words[:, 0], words[:, 1]
    # xxh3_64 of 20 bytes: avalanche(20 * P1 + mix16B(bytes 0..16) + mix16B(bytes 4..20)),
    # where bytes 4..20 are the key alone, so the second mix is the same for every group.
    key_part = _XXH3_LEN20 + _mul128_fold64(k0 ^ _XXH3_SECRET[2], k1 ^ _XXH3_SECRET[3])
    high_word = ((k0 >> np.uint64(32)) | (k1 << np.uint64(32))) ^ _XXH3_SECRET[1]
    low_key = (k0 & _M32) << np.uint64(32)
    best_group = np.zeros(len(words), np.int64)
    best_score = np.zeros(len(words), np.uint64)
    best_cost = np.full(len(words), np.inf)
    for g in range(num_groups):
        mixed = _mul128_fold64((low_key | np.uint64(g)) ^ _XXH3_SECRET[0], high_word)
        score = _xxh3_avalanche(key_part + mixed)
        if weights is not None:
            cost = -np.log((score.astype(np.float64) + 0.5) * _TO_UNIT) / weights[g]
            wins = cost < best_cost if g else np.ones(len(words), bool)
            best_group[wins], best_cost[wins] = g, cost[wins]
            continue
        wins = score > best_score if g else np.ones(len(words), bool)
        best_group[wins], best_score[wins] = g, score[wins]
    return best_group


def _key_words(keys: np.ndarray) -> np.ndarray:
    if keys.dtype == np.uint8 and keys.ndim == 2 and keys.shape[1] == KEY_BYTES:
        return np.ascontiguousarray(keys).view("<u8").astype(np.uint64)
    if keys.dtype == np.uint64 and keys.ndim == 2 and keys.shape[1] == 2:
        return keys
    raise InvalidArgument(
        f"keys must be uint8 [n, {KEY_BYTES}] or uint64 [n, 2], got {keys.dtype} {keys.shape}"
    )


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Low and high halves of the 128-bit product ``a * b``, xored (XXH3's portable form)."""
    a_lo, a_hi, b_lo, b_hi = a & _M32, a >> np.uint64(32), b & _M32, b >> np.uint64(32)
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = (lo_lo >> np.uint64(32)) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> np.uint64(32)) + (cross >> np.uint64(32)) + hi_hi
    lower = (cross << np.uint64(32)) | (lo_lo & _M32)
    return upper ^ lower


def _xxh3_avalanche(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(37))
    h = h * np.uint64(0x165667919E3779F9)
    return h ^ (h >> np.uint64(32))
