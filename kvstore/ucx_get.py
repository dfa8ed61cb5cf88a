"""A node's get reply when the client asked for UCX delivery: headers over gRPC, payloads over UCX.

For each key that is a HIT, the newest version's payload is posted to the client's UCX worker
as message ``tag_base + i`` (i = the key's index) straight from the bytes the store read; the
gRPC reply carries the status, that version's 48-byte header (``ucx_header``) and any older
versions inline. A MISS, an expired key or a freed segment is a MISS in the reply and nothing
is sent for it. If the post fails at once (malformed or unreachable client address) the node
answers inline exactly as without UCX (:func:`serve_get_over_ucx` returns None), so a client
never depends on UCX succeeding. The posted bytes stay referenced by the UCX send until it
completes, the client took them, gave up, or the send timed out (kvstore/ucx_server.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from erasure.shard import HEADER_BYTES
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.get_reply import encode_get_shards_reply
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shard_reader import GetResult
from kvstore.ucx_server import UcxServer

log = logging.getLogger(__name__)

# How long a node keeps a posted payload for a client that does not take it.
UCX_SEND_TIMEOUT_S = 30.0


def serve_get_over_ucx(
    server: UcxServer, delivery: pb.UcxDelivery, results: Sequence[GetResult]
) -> bytes | None:
    """Post the HITs' newest payloads and return the serialized GetShardsReply, or None
    when UCX cannot deliver (the caller then answers inline)."""
    payloads = [_newest_payload(result) for result in results]
    if not any(payload is not None for payload in payloads):
        return None
    try:
        server.post(delivery.worker_address, delivery.tag_base, payloads, UCX_SEND_TIMEOUT_S)
    except (InvalidArgument, Unavailable) as exc:
        log.debug("answering a get inline: UCX delivery failed: %s", exc)
        return None
    return encode_get_shards_reply(results, ucx_header=True)


def _newest_payload(result: GetResult) -> memoryview | None:
    if result.status != pb.HIT or not result.shards:
        return None
    return memoryview(result.shards[0])[HEADER_BYTES:]
