"""A node's cost of building one gRPC ``ReadBatch`` answer, plain chunks against in place.

::

    python -m bench.answer_bench [--seconds 2] [--rounds 3] [--shards 8]

One process, one shard store (fsync off, tmpfs-backed page cache after the first pass): per
round, for ``--seconds`` of CPU each, the store's batch read of ``--shards`` shards of a 4 MiB
block (410 KiB each) followed by the plain encoding (payloads read into the staging, then
joined into chunk messages) or by the in-place message (kvstore/wire/answer_message.py: the
payloads read straight into the message). Prints JSON: CPU-seconds per GB of each, per
round, with the load. gRPC's own send and everything per request (auth, metrics, the executor
hop) are not in it: this isolates what the in-place message saves.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

from erasure.allocator import tune_glibc_malloc
from erasure.shard import ShardHeader, block_checksum, pack_header
from kvstore.byte_arena import ByteArena
from kvstore.config import NodeConfig, TTLConfig
from kvstore.store.shard_store import ShardStore
from kvstore.wire import batch_answer
from kvstore.wire.answer_message import InPlaceAnswer
from ttl.clock import ManualClock
from ttl.policy import TrafficClasses

SHARD_PAYLOAD_BYTES = 419_431  # a 4 MiB block's data shard with k = 10
NUM_KEYS = 64


def _shard(payload: bytes) -> bytes:
    header = ShardHeader("zfec", 1, 0, 0, len(payload), block_checksum(payload), len(payload))
    return pack_header(header, payload) + payload


def _answers(store: ShardStore, arena: ByteArena) -> dict[str, Callable[[list[bytes]], list]]:
    def plain(keys: list[bytes]) -> list[bytes]:
        read = store.read_batch("bench", keys, b"", arena.take, max_reply_bytes=1 << 30)
        try:
            table = batch_answer.encode_table(read.entries)
            return batch_answer.encode_chunks(table, read.payloads)
        finally:
            read.release()

    def in_place(keys: list[bytes]) -> list[bytes]:
        answer = InPlaceAnswer(len(keys), arena.take)
        read = store.read_batch("bench", keys, b"", answer.take, max_reply_bytes=1 << 30)
        try:
            message = answer.message(read.entries, read.staging, read.payload_bytes)
            assert message is not None, "the answer did not fit one chunk: use fewer --shards"
            return [message]
        finally:
            read.release()

    return {"plain": plain, "in place": in_place}


def _cpu_s_per_gb(
    answer: Callable[[list[bytes]], list], keys: list[bytes], args: argparse.Namespace
) -> float:
    num_answers, start_s = 0, time.process_time()
    while time.process_time() - start_s < args.seconds:
        first = num_answers * args.shards % (NUM_KEYS - args.shards)
        answer(keys[first : first + args.shards])
        num_answers += 1
    gb = num_answers * args.shards * SHARD_PAYLOAD_BYTES / 1e9
    return round((time.process_time() - start_s) / gb, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=8)
    args = parser.parse_args()
    tune_glibc_malloc()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-answer-") as root:
        node = NodeConfig("n0", "127.0.0.1:1", 0, "d0", root, fsync=False)
        classes = TrafficClasses({"chat": 86400.0})
        store = ShardStore(node, TTLConfig(classes=classes), ManualClock(1000.0))
        keys = [i.to_bytes(16, "little") for i in range(NUM_KEYS)]
        for key in keys:
            store.put("bench", "chat", [(key, _shard(os.urandom(SHARD_PAYLOAD_BYTES)))])
        answers = _answers(store, ByteArena(64 << 20))
        assert answers["plain"](keys[:2]) == answers["in place"](keys[:2]), "answers differ"
        for round_index in range(args.rounds):
            for name, answer in answers.items():
                cost = _cpu_s_per_gb(answer, keys, args)
                load = os.getloadavg()[0]
                rows.append(
                    {"round": round_index, "answer": name, "cpu_s_per_gb": cost, "load": load}
                )
        store.close()
    print(json.dumps({"shards_per_answer": args.shards, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
