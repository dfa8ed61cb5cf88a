"""The codec's own errors. Pure: no other package of the project, no grpc.

``kvstore.errors`` re-exports these as part of the one error hierarchy and
``kvstore.grpc_errors`` maps them to status codes: misuse is INVALID_ARGUMENT, the rest
DATA_LOSS. Misuse errors are ``ValueError`` subclasses, as misuse is everywhere in kvstore.
"""

from __future__ import annotations


class ErasureError(Exception):
    """Base class of every error the codec raises on purpose."""


class InvalidCodecInput(ErasureError, ValueError):
    """Misuse of the codec: not a byte buffer, a block over max_block_bytes, a wrong ``out``."""


class CodecError(ErasureError):
    """Erasure decoding could not produce the exact block."""


class ShardHeaderError(CodecError):
    """A shard header is malformed or does not match the codec (k, m, backend, version)."""


class ChecksumMismatch(CodecError):
    """A shard or a decoded block failed its checksum: the bytes are corrupt."""


class MixedVersions(CodecError):
    """Shards of different block versions were offered to one decode."""


class TooFewShards(CodecError):
    """Fewer than k valid shards of one version were available."""
