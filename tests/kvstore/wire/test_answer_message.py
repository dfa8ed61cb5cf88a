"""A batch answer read in place into its one ReadBatchChunk message is byte for byte what the
plain chunk encoding gives (so old clients read it), and irregular reads go the plain way."""

from __future__ import annotations

import struct

import numpy as np

from kvstore.byte_arena import ByteArena
from kvstore.store.record_reads import address_of
from kvstore.wire import batch_answer
from kvstore.wire.answer_message import InPlaceAnswer, new_message


def _header(payload_len: int) -> bytes:
    """A shard header (erasure/shard.py) as far as the table checks it: its payload length."""
    header = bytearray(range(48))
    struct.pack_into("<I", header, 36, payload_len)
    return bytes(header)


def _entries(sizes: list[int]) -> list[batch_answer.Entry]:
    return [
        batch_answer.Entry(i, batch_answer.HIT, _header(size), size)
        if size
        else batch_answer.Entry(i, batch_answer.MISS, b"", 0)
        for i, size in enumerate(sizes)
    ]


def _read_into(answer: InPlaceAnswer, sizes: list[int], seed: int = 0) -> tuple:
    """What a batch read does: take the staging, write the payloads through its address."""
    payloads = np.random.default_rng(seed).bytes(sum(sizes))
    staging = answer.take(len(payloads))
    assert address_of(staging.view) or not payloads, "the native loop needs the address"
    staging.view[:] = payloads
    return staging, payloads


def test_a_new_message_is_writable_until_handed_over() -> None:
    message, view = new_message(5)
    view[:] = b"hello"
    assert message == b"hello" and isinstance(message, bytes)


def test_the_in_place_message_is_the_plain_encoding() -> None:
    sizes = [410_000, 0, 410_000, 1234]
    entries = _entries(sizes)
    fallback = ByteArena(1 << 20)
    answer = InPlaceAnswer(len(sizes), fallback.take)
    staging, payloads = _read_into(answer, sizes)
    message = answer.message(entries, staging, len(payloads))
    plain = batch_answer.encode_chunks(batch_answer.encode_table(entries), memoryview(payloads))
    assert plain == [message], "an in-place answer differs from the chunks old clients read"
    assert fallback.num_fallbacks == 0
    data = batch_answer.chunk_data(message)
    table_end = batch_answer.table_bytes(data)
    found, total = batch_answer.decode_table(data[:table_end], len(sizes))
    assert total == len(payloads) and bytes(data[table_end:]) == payloads
    assert found["status"].tolist() == [1, 0, 1, 1]


def test_an_answer_of_several_chunks_uses_the_staging_and_no_message() -> None:
    sizes = [3 << 20, 3 << 20]
    arena = ByteArena(8 << 20)
    answer = InPlaceAnswer(len(sizes), arena.take)
    staging, payloads = _read_into(answer, sizes)
    assert answer.message(_entries(sizes), staging, len(payloads)) is None
    assert staging.view.obj is not None and len(staging.view) == sum(sizes)
    staging.release()


def test_a_read_that_did_not_end_as_planned_goes_the_plain_way() -> None:
    sizes = [1000, 2000]
    answer = InPlaceAnswer(len(sizes), ByteArena(1 << 16).take)
    staging, payloads = _read_into(answer, sizes)
    # A shard failed its check: the table has a CORRUPT entry and the stream is shorter.
    short = answer.message(_entries(sizes), staging, len(payloads) - 2000)
    assert short is None, "a shorter stream must not be sent with the planned head"
    extra = [*_entries(sizes), batch_answer.Entry(1, batch_answer.CORRUPT, b"", 0)]
    assert answer.message(extra, staging, len(payloads)) is None, "the table outgrew its room"
