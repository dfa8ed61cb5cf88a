"""Block keys: chained xxh3-128 over full blocks of token ids.

Pure code, no I/O. The chain (in the spirit of vLLM's ``hash_block_tokens``)::

    root    = xxh3_128( b"kvstore.block_keys.v1"
                        || u32(len(namespace)) || namespace
                        || u32(len(salt))      || salt
                        || u32(block_tokens) )
    key[-1] = root
    key[i]  = xxh3_128( key[i-1] || tokens[i*B : (i+1)*B] as little-endian uint32 )

All integers are little-endian; ``str`` fields are UTF-8. Length prefixes keep fields from
running together (namespace "ab" + salt "c" differs from "a" + "bc"). Because each key
covers every earlier block, equal keys mean equal prefixes, so a prefix lookup can stop at the
first missing key. Only full blocks get keys: a trailing partial block is recomputed, never
cached. Same inputs give the same keys in every process and on every machine (no per-process
hash seed is involved).

Engines that hash their own blocks (vLLM's ``block_hashes``, SGLang's page hashes, LMCache's
chunk keys) keep their chains; :func:`namespaced_keys` maps each of their keys into ours::

    root   = xxh3_128( b"kvstore.namespaced_keys.v1"
                       || u32(len(namespace)) || namespace || u32(len(salt)) || salt )
    key[i] = xxh3_128( root || u32(len(part)) || part || engine_key[i] )

so the same engine key under another namespace (model, dtype, layout, parallel rank, page
size), salt or part (K and V halves of one page) is another store key.

A key given as a ``str`` (the client's calls and ``kvstore get|put|del|ttl|inspect KEY``) is
hashed by :func:`string_key`, the same way in every process and tool::

    key = xxh3_128( b"kvstore.string_key.v1" || u32(len(utf8)) || utf8 )

so ``kv.put("greeting", ...)`` and ``kvstore get greeting`` name one block. Tenants do not
enter the hash: the nodes keep every tenant's keys apart anyway.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from kvstore.config import KEY_BYTES
from kvstore.errors import InvalidArgument

_DOMAIN_TAG = b"kvstore.block_keys.v1"
_NAMESPACED_TAG = b"kvstore.namespaced_keys.v1"
_STRING_TAG = b"kvstore.string_key.v1"
_U32 = struct.Struct("<I")
_MAX_TOKEN_ID = 2**32 - 1


def block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    namespace: str | bytes,
    salt: str | bytes,
) -> list[bytes]:
    """16-byte keys of the full ``block_tokens``-token blocks of ``token_ids`` (see module doc).

    ``namespace`` names what the KV is (model id, KV layout, dtype, block size); ``salt`` is
    the tenant's secret salt, so tenants never share keys. Token ids must be in [0, 2**32).
    """
    if not isinstance(block_tokens, int) or block_tokens <= 0:
        raise InvalidArgument(f"block_tokens must be a positive int, got {block_tokens!r}")
    tokens = _as_uint32(token_ids)
    key = xxhash.xxh3_128_digest(
        _DOMAIN_TAG + _prefixed(namespace) + _prefixed(salt) + _U32.pack(block_tokens)
    )
    keys = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        key = xxhash.xxh3_128_digest(key + tokens[start : start + block_tokens].tobytes())
        keys.append(key)
    return keys


def namespaced_keys(
    engine_keys: Sequence[str | bytes],
    namespace: str | bytes,
    salt: str | bytes = b"",
    part: str | bytes = b"",
) -> list[bytes]:
    """16-byte store keys for an engine's own block keys (see the module doc).

    ``namespace`` names what the bytes are (the engine adapters build it from the engine's
    config: engine_adapter/engine_keys.py); ``salt`` separates tenants; ``part`` tells the
    pieces of one engine block apart when they are stored as separate blocks.
    """
    root = xxhash.xxh3_128_digest(_NAMESPACED_TAG + _prefixed(namespace) + _prefixed(salt))
    prefix = root + _prefixed(part)
    return [xxhash.xxh3_128_digest(prefix + _as_bytes(key)) for key in engine_keys]


def string_key(name: str) -> bytes:
    """The 16-byte store key of a string key (see the module doc)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"a string key must be a non-empty str, got {name!r}")
    return xxhash.xxh3_128_digest(_STRING_TAG + _prefixed(name))


def as_key(key: str | bytes) -> bytes:
    """A store key: a 16-byte key as it is, a ``str`` hashed by :func:`string_key`."""
    if isinstance(key, str):
        return string_key(key)
    if isinstance(key, bytes) and len(key) == KEY_BYTES:
        return key
    got = f"{len(key)} bytes" if isinstance(key, bytes | bytearray) else type(key).__name__
    raise InvalidArgument(
        f"a key is a str or {KEY_BYTES} bytes (an xxh3-128 digest, e.g. from "
        f"client.block_keys), got {got}"
    )


def _as_bytes(field: str | bytes) -> bytes:
    if isinstance(field, str):
        return field.encode()
    if isinstance(field, bytes | bytearray | memoryview):
        return bytes(field)
    raise InvalidArgument(f"engine keys must be str or bytes, got {type(field).__name__}")


def _prefixed(field: str | bytes) -> bytes:
    if isinstance(field, str):
        field = field.encode()
    if not isinstance(field, bytes):
        raise InvalidArgument(f"namespace and salt must be str or bytes, got {type(field)}")
    return _U32.pack(len(field)) + field


def _as_uint32(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D little-endian uint32 array; raise InvalidArgument for bad ids."""
    array = np.asarray(token_ids)
    if array.size == 0:
        return np.empty(0, dtype="<u4")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise InvalidArgument(
            f"token_ids must be a 1-D sequence of ints, got shape {array.shape} "
            f"of {array.dtype}; flatten it or pass a list of ints"
        )
    if array.min() < 0 or array.max() > _MAX_TOKEN_ID:
        raise InvalidArgument(
            f"token ids must be in [0, 2**32), got values in [{array.min()}, {array.max()}]"
        )
    return array.astype("<u4", copy=False)
