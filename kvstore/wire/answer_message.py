"""A batch answer read in place into the one ReadBatchChunk message that carries it over gRPC.

gRPC sends ``bytes``. The plain way (kvstore/wire/batch_answer.py ``encode_chunks``) reads the
payloads into the node's staging and joins the table and the staging into chunk messages: one
more copy of every byte on the node. When the whole answer fits one chunk (at most
``CHUNK_BYTES``: what every client already takes in one message) the node instead creates the
message first, uninitialized, with room for its field head and table, and the batch read's
native loop ``preadv``s the payloads straight into it; the head and the table are written in
front once the read is over::

    message = 0x0A | varint(len(answer)) | table (8 + 64 x num_keys) | payloads
              ^ written last, in place   ^ written last, in place      ^ the read lands here

The message is the same bytes ``encode_chunks`` would give: clients old and new read it alike.
Only a read that ended as planned (one table entry per requested key, the payloads where they
were put, none grown into another buffer) is sent this way; anything else (a shard that
failed its checks, a segment gone under the read) goes the plain way, with the same bytes.

Writing into a ``bytes`` object is what CPython's C API allows for one made by
``PyBytes_FromStringAndSize(NULL, n)`` until it is shared: this module is its only holder until
:meth:`InPlaceAnswer.message` hands it over, and nothing hashes it before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

from kvstore.byte_arena import Region
from kvstore.wire import batch_answer
from kvstore.wire.protowire import field_head

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
_new_bytes.restype = ctypes.py_object
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = [ctypes.py_object]
_bytes_address.restype = ctypes.c_void_p

_CHUNK_FIELD = 1  # ReadBatchChunk.data


def new_message(num_bytes: int) -> tuple[bytes, memoryview]:
    """A new ``bytes`` of ``num_bytes`` (contents undefined) and a writable view of it; write
    it whole before anyone else sees the bytes."""
    message = _new_bytes(None, num_bytes)
    array = (ctypes.c_char * num_bytes).from_address(_bytes_address(message))
    return message, memoryview(array).cast("B")


class InPlaceAnswer:
    """One batch read's answer message for ``num_keys`` keys: :meth:`take` is the read's
    staging (the payload part of the message, or ``fallback``'s region for an answer of
    several chunks), :meth:`message` the message once read."""

    def __init__(
        self,
        num_keys: int,
        fallback: Callable[[int], Region],
        chunk_bytes: int = batch_answer.CHUNK_BYTES,
    ) -> None:
        self._fallback = fallback
        self._table_bytes = batch_answer.TABLE_HEAD.size + num_keys * batch_answer.ENTRY_BYTES
        self._num_keys = num_keys
        self._chunk_bytes = chunk_bytes
        self._message: bytes | None = None
        self._view: memoryview | None = None
        self._head = b""
        self._payloads: memoryview | None = None

    def take(self, payload_bytes: int) -> Region:
        """The payloads' place in a new message when the answer fits one chunk, else the
        fallback's region (then :meth:`message` gives None)."""
        answer_bytes = self._table_bytes + payload_bytes
        if answer_bytes > self._chunk_bytes:
            return self._fallback(payload_bytes)
        self._head = field_head(_CHUNK_FIELD, answer_bytes)
        prefix = len(self._head) + self._table_bytes
        self._message, self._view = new_message(prefix + payload_bytes)
        self._payloads = self._view[prefix:]
        return Region(None, 0, self._payloads)

    def message(
        self, entries: Sequence[batch_answer.Entry], staging: Region | None, payload_bytes: int
    ) -> bytes | None:
        """The serialized ReadBatchChunk holding the whole answer, or None when the read did
        not end as planned (send it the plain way then)."""
        view, payloads = self._view, self._payloads
        as_planned = (
            view is not None
            and payloads is not None
            and staging is not None
            and staging.view is payloads
            and payload_bytes == len(payloads)
            and len(entries) == self._num_keys
        )
        if not as_planned:
            return None
        assert view is not None and self._message is not None
        table = batch_answer.encode_table(entries)
        head = len(self._head)
        view[:head] = self._head
        view[head : head + len(table)] = table
        message, self._message, self._view, self._payloads = self._message, None, None, None
        return message
