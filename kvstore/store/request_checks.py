"""Checks of a store request's input, all before anything is touched (pure, no I/O).

A request that fails any check raises InvalidArgument (or UnknownTrafficClass) saying what was
expected, what came and how to fix it, and changes nothing: a put is validated whole first.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from erasure.config import CodecConfig
from erasure.shard import HEADER_BYTES, VERSION_BYTES, ShardHeader, verify_shard
from kvstore.config import KEY_BYTES, NodeConfig
from kvstore.errors import CodecError, InvalidArgument, quoted
from ttl.policy import TrafficClasses

# The shard index a node holds for a key (its position in the key's group), None if the node
# is not in that group.
ShardIndexOf = Callable[[bytes], int | None]

MAX_KEYS_PER_REQUEST = 1 << 16
MAX_TENANT_CHARS = 256
# Tenant names: ASCII letters, digits and . _ - @ : (an account id, an e-mail-like name, a
# "org:team" pair); docs/security.md lists this rule.
TENANT_CHARS_DOC = "ASCII letters, digits and . _ - @ :"
_TENANT_PATTERN = re.compile(r"[A-Za-z0-9._@:-]+")
MAX_HINTS_PER_REQUEST = 4096  # repair hints of one QueueRepair (clients send at most 512)


def check_tenant(tenant: str) -> None:
    """Raise unless ``tenant`` is 1 to ``MAX_TENANT_CHARS`` characters of ``TENANT_CHARS``.

    The same on every cluster, with auth or without: a tenant name ends up in the index,
    in logs and in metric labels, where a NUL, a newline or a megabyte name does harm.
    """
    if not tenant or len(tenant) > MAX_TENANT_CHARS:
        raise InvalidArgument(
            f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters "
            f"(e.g. the account id), got {len(tenant)} characters"
        )
    if not _TENANT_PATTERN.fullmatch(tenant):
        raise InvalidArgument(
            f"tenant {quoted(tenant)} has a character outside {TENANT_CHARS_DOC}; use an "
            "account id or a name of those characters"
        )


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise unless there are at most ``MAX_KEYS_PER_REQUEST`` keys of ``KEY_BYTES`` each."""
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise InvalidArgument(
            f"{len(keys)} keys in one request; at most {MAX_KEYS_PER_REQUEST}, split it"
        )
    for key in keys:
        if len(key) != KEY_BYTES:
            raise InvalidArgument(
                f"keys must be {KEY_BYTES} bytes (xxh3-128 block keys), got {len(key)} "
                f"bytes: {bytes(key[:32]).hex()}"
            )


def check_seconds(field: str, value: float) -> None:
    """Raise, naming ``field``, unless ``value`` is a finite time in seconds, >= 0."""
    if not (math.isfinite(value) and value >= 0):
        raise InvalidArgument(f"{field} must be a finite number of seconds >= 0, got {value}")


def check_count(field: str, count: int, limit: int) -> None:
    """Raise, naming ``field``, unless a request carries at most ``limit`` of it."""
    if count > limit:
        raise InvalidArgument(f"{count} {field} in one request; at most {limit}, split it")


def check_below(field: str, value: int, bound: int, what: str) -> None:
    """Raise, naming ``field``, unless ``0 <= value < bound`` (``what`` says what bound is)."""
    if not 0 <= value < bound:
        raise InvalidArgument(f"{field} {value} is out of range: {what} is {bound}")


def check_version(version: bytes) -> None:
    """Raise unless ``version`` is empty (every version) or a block checksum."""
    if version and len(version) != VERSION_BYTES:
        raise InvalidArgument(
            f"version must be {VERSION_BYTES} bytes (a shard header's block checksum) or "
            f"empty for every version, got {len(version)} bytes"
        )


def check_put(
    node: NodeConfig,
    classes: TrafficClasses,
    tenant: str,
    traffic_class: str,
    shards: Sequence[tuple[bytes, bytes, float]],
    codec: CodecConfig | None = None,
    shard_index_of: ShardIndexOf | None = None,
) -> list[tuple[bytes, ShardHeader, bytes, float]]:
    """(key, shard header, shard, written_at_s) of a whole put request, checked and
    deduplicated; ``shards`` are (key, shard, written_at_s).

    With ``codec`` every shard header must fit the cluster's code (k, m, backend); with
    ``shard_index_of`` every shard must be the one this node holds for its key. A mismatch
    means the client and the node read different cluster maps: INVALID_ARGUMENT, nothing
    stored.
    """
    check_tenant(tenant)
    classes.check(traffic_class)
    check_keys([key for key, _, _ in shards])
    total_bytes = sum(len(shard) for _, shard, _ in shards)
    if total_bytes > node.max_batch_bytes:
        raise InvalidArgument(
            f"put of {total_bytes} bytes exceeds max_batch_bytes "
            f"{node.max_batch_bytes}; split it into smaller requests"
        )
    unique: dict[tuple[bytes, bytes], tuple[ShardHeader, bytes, float]] = {}
    for key, shard, written_at_s in shards:
        header = _check_shard(node, key, shard)
        _check_fits(node, key, header, codec, shard_index_of)
        unique[(bytes(key), header.block_checksum)] = (header, shard, written_at_s)
    return [(key, *value) for (key, _), value in unique.items()]


def _check_shard(node: NodeConfig, key: bytes, shard: bytes) -> ShardHeader:
    """The shard's header; InvalidArgument if oversized or malformed."""
    limit = node.max_shard_bytes + HEADER_BYTES
    if len(shard) > limit:
        raise InvalidArgument(
            f"shard of key {key.hex()} is {len(shard)} bytes; this node accepts at most "
            f"{limit} (max_shard_bytes + header); use a larger k or smaller blocks"
        )
    try:
        header = verify_shard(shard)
    except CodecError as exc:
        raise InvalidArgument(f"malformed shard for key {key.hex()}: {exc}") from None
    if not header.payload_len or not header.block_len:  # a client refuses empty blocks too
        raise InvalidArgument(
            f"shard of key {key.hex()} is empty ({header.payload_len} payload bytes of a "
            f"{header.block_len}-byte block): a block holds at least one byte"
        )
    return header


def _check_fits(
    node: NodeConfig,
    key: bytes,
    header: ShardHeader,
    codec: CodecConfig | None,
    shard_index_of: ShardIndexOf | None,
) -> None:
    if codec is not None and (header.k, header.m, header.backend) != (
        codec.k,
        codec.m,
        codec.backend,
    ):
        raise InvalidArgument(
            f"shard of key {key.hex()} is coded {header.k}+{header.m} with {header.backend}, but "
            f"this cluster codes {codec.k}+{codec.m} with {codec.backend}; the client read "
            "another cluster.toml than node " + node.id
        )
    expected = None if shard_index_of is None else shard_index_of(key)
    if shard_index_of is not None and expected != header.index:
        holds = "no shard" if expected is None else f"shard {expected}"
        raise InvalidArgument(
            f"node {node.id} holds {holds} of key {key.hex()} in its placement group, not shard "
            f"{header.index}; the client read another cluster.toml (groups) than the node"
        )
