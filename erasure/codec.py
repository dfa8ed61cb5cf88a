"""The k+m Reed-Solomon codec: a block in, k+m self-checking shards out, and back.

::

    block  |<-------------------------- block_len bytes -------------------------->|
           | d0 (P bytes) | d1 (P) |  ...  | d(k-1): the tail, zero-padded to P   |
    shards [hdr|d0] [hdr|d1] ... [hdr|d(k-1)] [hdr|p0] ... [hdr|p(m-1)]

P = ceil(block_len / k); ``hdr`` is the 48-byte :mod:`erasure.shard` header (backend, k, m,
index, block length, the block's xxh3-128 = its version, the shard's own xxh3-64). The code
is systematic: data shards are the block's bytes, so a decode that has every data shard only
concatenates. Any k shards of one version rebuild the block; both checksums are verified on
the way, so the codec raises rather than return wrong bytes.

Backends (the parity bytes differ, so a cluster uses one; the header records which):

- ``isal`` (default): Intel ISA-L's SIMD Reed-Solomon (``isa_l_rs_vand``), loaded from the
  pyeclib wheel and called directly (:mod:`erasure.isal_backend`), so parity and recovered
  shards land in reused buffers instead of pyeclib's freshly allocated fragments.
- ``zfec``: portable table-driven C, no SIMD; for platforms without the pyeclib wheel and
  for (k, m) outside ISA-L's Vandermonde-safe region (:func:`erasure.isal_backend.check_vand_k_m`).

Why ISA-L is the default: zfec's table-driven kernel, not our checksums or copies, is the
bottleneck of a zfec encode or decode, and it would cap a client at about an eighth of
ISA-L's speed; ISA-L's kernel is faster than memcpy, so with it our encode's time goes to the
xxh3 passes (block and shards) and the one copy into the shards it returns. At small blocks a
call's fixed Python cost (twelve headers and checksums) dominates. The figures are in
docs/design-measurements.md and docs/durability.md, "Erasure codec".

Memory: encode returns k+m new ``bytes`` (protobuf takes nothing else); under glibc's default
settings each one touches fresh pages, see :mod:`erasure.allocator` for the measurement and
the fix. Decode allocates at most the returned block (none with ``out=``), and all padding,
parity and recovery work goes through one reused per-thread buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from erasure.config import CodecConfig
from erasure.errors import (
    ChecksumMismatch,
    InvalidCodecInput,
    MixedVersions,
    ShardHeaderError,
    TooFewShards,
)
from erasure.isal_backend import IsalBackend, buffer_address
from erasure.shard import (
    HEADER_BYTES,
    KEYED,
    Shard,
    ShardHeader,
    block_checksum,
    pack_headers,
    parse_header,
    shard_payload,
    verify_shard,
)
from erasure.zfec_backend import ZfecBackend

Buffer = bytes | bytearray | memoryview
# A block's version from its bytes: xxh3-128 (erasure.shard.block_checksum) or a keyed digest.
BlockDigest = Callable[[memoryview | bytes], bytes]


class Backend(Protocol):
    """The arithmetic a backend supplies; the codec does headers, checksums and buffers."""

    def encode_parity(
        self, data: Sequence[memoryview], parity: memoryview, payload_len: int
    ) -> None: ...

    def reconstruct(
        self,
        sources: Mapping[int, memoryview],
        wanted_ids: Sequence[int],
        out: Sequence[memoryview],
    ) -> None: ...


BACKENDS: dict[str, type[IsalBackend] | type[ZfecBackend]] = {
    "isal": IsalBackend,
    "zfec": ZfecBackend,
}


class _Scratch(threading.local):
    """One reusable buffer per thread for padding, parity and recovered payloads.

    Reusing it keeps encode and decode from touching fresh pages on every call.
    """

    def __init__(self) -> None:
        self.buffer = bytearray()

    def take(self, num_bytes: int) -> memoryview:
        if len(self.buffer) < num_bytes:
            # Replaced, never resized: a view still alive in a traceback would forbid resizing.
            self.buffer = bytearray(num_bytes)
        return memoryview(self.buffer)[:num_bytes]


_scratch = _Scratch()


def _rows(region: memoryview, row_bytes: int) -> list[memoryview]:
    """``region`` cut into consecutive ``row_bytes``-byte views."""
    return [region[start : start + row_bytes] for start in range(0, region.nbytes, row_bytes)]


def byte_view(buffer: object, what: str) -> memoryview:
    """A flat byte view of ``buffer``; InvalidCodecInput (naming ``what``) unless it is a
    contiguous buffer."""
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidCodecInput(
            f"{what} must be bytes-like (bytes, bytearray, memoryview, numpy array), "
            f"got {type(buffer).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidCodecInput(f"{what} must be C-contiguous; copy it first (e.g. bytes(x))")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Codec:
    """k data + m parity shards of a block, over the ``isal`` or ``zfec`` backend.

    Shard i (0 <= i < k) holds bytes [i*P, (i+1)*P) of the block, where
    P = :meth:`payload_bytes`; the last data payloads are zero-padded; shards k.. hold parity.
    Every shard starts with the 48-byte :mod:`erasure.shard` header. Thread-safe.
    """

    def __init__(self, config: CodecConfig) -> None:
        self.k = config.k
        self.m = config.m
        self.backend = config.backend
        self.num_shards = config.num_shards
        self.max_block_bytes = config.max_block_bytes
        # Decodes that needed the backend's matrix arithmetic (no systematic fast path).
        self.num_matrix_decodes = 0
        self._backend: Backend = BACKENDS[config.backend](config.k, config.m)

    def __repr__(self) -> str:
        return f"Codec(k={self.k}, m={self.m}, backend={self.backend!r})"

    def payload_bytes(self, block_len: int) -> int:
        """Payload bytes of every shard of a ``block_len``-byte block: ceil(block_len / k)."""
        return -(-block_len // self.k)

    def shard_bytes(self, block_len: int) -> int:
        """Whole shard size (header + payload) for a ``block_len``-byte block."""
        return HEADER_BYTES + self.payload_bytes(block_len)

    def encode(self, block: Buffer) -> list[bytes]:
        """k+m shards, each = erasure.shard header (48 B) + payload; shard i has index i."""
        view = self._check_block(block)
        spare = _scratch.take(self.spare_bytes(view.nbytes))
        return [header + payload for header, payload in self.encode_into(view, spare)]

    def spare_bytes(self, block_len: int) -> int:
        """Bytes of reusable space :meth:`encode_into` needs for a block: the zero-padded
        tail's payloads and the parity payloads."""
        payload_len = self.payload_bytes(block_len)
        if payload_len == 0:
            return 0
        return (self.k - block_len // payload_len + self.m) * payload_len

    def encode_into(
        self, block: Buffer, spare: memoryview, *, keyed_version: bytes | None = None
    ) -> list[tuple[bytes, memoryview]]:
        """k+m shards as (48-byte header, payload) pairs, shard i with index i, copying
        nothing but the padded tail: data payloads view ``block``, the tail and the parity
        are written into ``spare`` (:meth:`spare_bytes` long, reused by the caller). The
        pairs are valid while ``block`` and ``spare`` are unchanged.

        ``keyed_version``: the block's keyed digest (client/integrity.py), which the
        caller computed instead of the xxh3-128 this would; the shards carry it, flagged KEYED.
        """
        view = self._check_block(block)
        payload_len = self.payload_bytes(view.nbytes)
        flags = KEYED if keyed_version is not None else 0
        version = keyed_version if keyed_version is not None else block_checksum(view)
        if payload_len == 0:
            payloads = [view] * self.num_shards
        else:
            head, tail, parity = self._regions(view, payload_len, spare)
            if self.m:
                self._backend.encode_parity((head, tail), parity, payload_len)
            payloads = [*_rows(head, payload_len), *_rows(tail, payload_len)]
            payloads += _rows(parity, payload_len)
        headers = pack_headers(self.backend, self.k, self.m, view.nbytes, version, payloads, flags)
        return list(zip(headers, payloads, strict=True))

    def _check_block(self, block: Buffer) -> memoryview:
        view = byte_view(block, "block")
        if view.nbytes > self.max_block_bytes:
            raise InvalidCodecInput(
                f"block of {view.nbytes} bytes exceeds max_block_bytes={self.max_block_bytes}; "
                "split it or raise [codec] max_block_bytes in cluster.toml"
            )
        return view

    def _regions(
        self, view: memoryview, payload_len: int, spare: memoryview
    ) -> tuple[memoryview, memoryview, memoryview]:
        """The block's whole payloads (a view), its zero-padded tail (a copy), parity space."""
        num_full = view.nbytes // payload_len
        num_padded = self.k - num_full
        if len(spare) < (num_padded + self.m) * payload_len:
            raise InvalidCodecInput(
                f"spare buffer of {len(spare)} bytes is too small; encode_into needs "
                f"{self.spare_bytes(view.nbytes)} (Codec.spare_bytes)"
            )
        head, tail = view[: num_full * payload_len], spare[: num_padded * payload_len]
        rest = view[head.nbytes :]
        tail[: rest.nbytes] = rest
        tail[rest.nbytes :] = bytes(tail.nbytes - rest.nbytes)  # fewer than k bytes of padding
        return head, tail, spare[tail.nbytes :]

    def verify(self, shard: Shard) -> ShardHeader:
        """Check one shard's checksum and that this codec wrote it; return its header.

        Raises ShardHeaderError (malformed, or another codec's shard) or ChecksumMismatch.
        """
        return self._fits(verify_shard(shard))

    def _fits(self, header: ShardHeader) -> ShardHeader:
        if (header.backend, header.k, header.m) != (self.backend, self.k, self.m):
            raise ShardHeaderError(
                f"shard {header.index} was written by a {header.k}+{header.m} {header.backend} "
                f"codec, this codec is {self.k}+{self.m} {self.backend}: a cluster uses one "
                "codec (see [codec] in cluster.toml)"
            )
        if header.payload_len != self.payload_bytes(header.block_len):
            raise ShardHeaderError(
                f"shard {header.index} has a {header.payload_len}-byte payload, a "
                f"{header.block_len}-byte block needs {self.payload_bytes(header.block_len)}"
            )
        return header

    def decode(
        self,
        shards: Sequence[Shard],
        out: bytearray | memoryview | None = None,
        *,
        verified: bool = False,
        digest: BlockDigest | None = block_checksum,
    ) -> bytes | memoryview:
        """Exactly the block from any >= k shards of ONE version.

        Verifies every shard's checksum and the decoded block's checksum. Raises TooFewShards,
        MixedVersions, ShardHeaderError or ChecksumMismatch. With ``out`` (a writable buffer of
        exactly the block's length, else InvalidCodecInput) the block is written there and
        ``memoryview(out)`` returned; a payload that already lies at its place in ``out``
        (a :class:`erasure.shard.SplitShard` whose payload views ``out``) is not copied. With
        every data shard that holds block bytes present, no matrix decode is done: the
        payloads are concatenated.

        ``verified=True`` says the caller already ran :meth:`verify` on every shard, and skips
        the second pass over the shards' checksums. Headers are still checked, and the block
        checksum still guards the result, so even a wrong claim cannot yield wrong bytes.

        ``digest`` computes a block's version: xxh3-128 by default, a tenant's keyed digest
        for its reader (client/integrity.py), checked whatever the shards' KEYED flag says.
        ``None`` is for holders of no key (a node's repair): the block is then checked with
        xxh3-128 unless its shards say KEYED, where only the shard checksums guard it.
        """
        index_to_payload, header = self._consistent(shards, verified)
        target = None if out is None else self._target(out, header.block_len)
        pieces = self._data_pieces(index_to_payload, header, target)
        if target is None:
            block: bytes | memoryview = b"".join(pieces.values())
        else:
            block = target
            for start, piece in pieces.items():
                destination = target[start : start + piece.nbytes]
                if not _same_memory(piece, destination):  # a UCX read may have landed it there
                    destination[:] = piece
        check = digest if digest is not None or header.keyed else block_checksum
        if check is not None and check(block) != header.block_checksum:
            raise ChecksumMismatch(
                f"decoded block does not match its version {header.block_checksum.hex()} "
                "(shards forged or corrupted past their checksums); nothing valid was returned"
            )
        return block

    def _consistent(
        self, shards: Sequence[Shard], verified: bool
    ) -> tuple[dict[int, memoryview], ShardHeader]:
        """Index -> payload of shards that fit this codec and share one version."""
        if len(shards) < self.k:
            raise TooFewShards(
                f"{len(shards)} shards given; a {self.k}+{self.m} block needs any {self.k} "
                "of one version"
            )
        check = parse_header if verified else verify_shard
        headers = [self._fits(check(shard)) for shard in shards]
        first = headers[0]
        for header in headers:
            if header.block_checksum != first.block_checksum:
                raise MixedVersions(
                    f"shard {header.index} is of block version {header.block_checksum.hex()}, "
                    f"shard {first.index} of {first.block_checksum.hex()}: group shards by "
                    "erasure.shard.shard_version and decode one version"
                )
            if header.block_len != first.block_len:
                raise ShardHeaderError(
                    f"shards of version {first.block_checksum.hex()} disagree on the block "
                    f"length ({first.block_len} vs {header.block_len})"
                )
        index_to_payload = {h.index: shard_payload(s) for h, s in zip(headers, shards, strict=True)}
        if len(index_to_payload) < self.k:
            raise TooFewShards(
                f"{len(shards)} shards given but only {len(index_to_payload)} distinct "
                f"indices; a {self.k}+{self.m} block needs {self.k}"
            )
        return index_to_payload, first

    @staticmethod
    def _target(out: bytearray | memoryview, block_len: int) -> memoryview:
        target = byte_view(out, "out")
        if target.readonly or target.nbytes != block_len:
            raise InvalidCodecInput(
                f"out must be a writable buffer of exactly the block length {block_len} bytes, "
                f"got {'a read-only' if target.readonly else 'a writable'} one of "
                f"{target.nbytes} bytes"
            )
        return target

    def _data_pieces(
        self,
        index_to_payload: Mapping[int, memoryview],
        header: ShardHeader,
        target: memoryview | None,
    ) -> dict[int, memoryview]:
        """Block offset -> the bytes that belong there, recovering lost data shards.

        Only data shards that hold block bytes are needed: the rest hold padding alone.
        Shards recovered straight into ``target`` are already in place and left out.
        """
        payload_len, block_len = header.payload_len, header.block_len
        index_to_start = {i: i * payload_len for i in range(self.k) if i * payload_len < block_len}
        missing = [i for i in index_to_start if i not in index_to_payload]
        recovered = self._recover(index_to_payload, missing, header, target) if missing else {}
        available = {**index_to_payload, **recovered}
        return {
            start: available[i][: block_len - start]
            for i, start in index_to_start.items()
            if i in available
        }

    def _recover(
        self,
        index_to_payload: Mapping[int, memoryview],
        missing: list[int],
        header: ShardHeader,
        target: memoryview | None,
    ) -> dict[int, memoryview]:
        """Recover the ``missing`` data payloads; return those not written into ``target``.

        A lost shard lying wholly inside the block goes straight into ``target``; the partly
        filled last one (and every one when there is no target) goes to the scratch buffer.
        """
        payload_len = header.payload_len
        spare = _rows(_scratch.take(len(missing) * payload_len), payload_len)
        destinations, in_scratch = [], {}
        for index, scratch in zip(missing, spare, strict=True):
            start = index * payload_len
            if target is not None and start + payload_len <= header.block_len:
                destinations.append(target[start : start + payload_len])
            else:
                destinations.append(scratch)
                in_scratch[index] = scratch
        sources = {i: index_to_payload[i] for i in sorted(index_to_payload)[: self.k]}
        self.num_matrix_decodes += 1  # instrumentation: may miss a count under threads
        self._backend.reconstruct(sources, missing, destinations)
        return in_scratch


def _same_memory(a: memoryview, b: memoryview) -> bool:
    """Whether two equally long views cover the same bytes (nothing to copy).

    Views of different exporters are taken as apart without reading addresses: at worst a
    piece is copied onto itself, which is correct, and the usual case (a piece from a gRPC
    reply) costs no ctypes calls.
    """
    return a.obj is b.obj and not a.readonly and buffer_address(a) == buffer_address(b)


def make_codec(config: CodecConfig) -> Codec:
    """The codec a cluster's ``[codec]`` section describes.

    ``CodecConfig`` validates k and m; the isal backend also rejects (k, m) its Vandermonde
    matrix cannot always decode. Both raise ValueError with advice.
    """
    return Codec(config)
