"""Checks of a store request's input, all before anything is touched (pure, no I/O).

A request that fails any check raises InvalidArgument (or UnknownTrafficClass) saying what was
expected, what came and how to fix it, and changes nothing: a put is validated whole first.
"""

from __future__ import annotations

from collections.abc import Sequence

from erasure.shard import HEADER_BYTES, VERSION_BYTES, verify_shard
from kvstore.config import KEY_BYTES, NodeConfig
from kvstore.errors import CodecError, InvalidArgument
from ttl.policy import TrafficClasses

MAX_KEYS_PER_REQUEST = 1 << 16
MAX_TENANT_CHARS = 256


def check_tenant(tenant: str) -> None:
    """Raise unless ``tenant`` is a non-empty name of at most ``MAX_TENANT_CHARS``."""
    if not tenant or len(tenant) > MAX_TENANT_CHARS:
        raise InvalidArgument(
            f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters "
            f"(e.g. the account id), got {len(tenant)} characters"
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
    shards: Sequence[tuple[bytes, bytes]],
) -> list[tuple[bytes, bytes, bytes]]:
    """(key, version, shard) of a whole put request, checked and deduplicated."""
    check_tenant(tenant)
    classes.check(traffic_class)
    check_keys([key for key, _ in shards])
    total_bytes = sum(len(shard) for _, shard in shards)
    if total_bytes > node.max_batch_bytes:
        raise InvalidArgument(
            f"put of {total_bytes} bytes exceeds max_batch_bytes "
            f"{node.max_batch_bytes}; split it into smaller requests"
        )
    unique: dict[tuple[bytes, bytes], bytes] = {}
    for key, shard in shards:
        unique[(bytes(key), _check_shard(node, key, shard))] = shard
    return [(key, version, shard) for (key, version), shard in unique.items()]


def _check_shard(node: NodeConfig, key: bytes, shard: bytes) -> bytes:
    """The shard's version; InvalidArgument if oversized or malformed."""
    limit = node.max_shard_bytes + HEADER_BYTES
    if len(shard) > limit:
        raise InvalidArgument(
            f"shard of key {key.hex()} is {len(shard)} bytes; this node accepts at most "
            f"{limit} (max_shard_bytes + header); use a larger k or smaller blocks"
        )
    try:
        return verify_shard(shard).block_checksum
    except CodecError as exc:
        raise InvalidArgument(f"malformed shard for key {key.hex()}: {exc}") from None
