"""Client side of the UCX data path: the client's worker, tag bases, and the nodes it reaches.

A batch read from one node registers where the node's messages must land, then sends the
request over UCX with a fresh tag base (client/ucx/reader.py; kvstore/wire/ucx_frames.py has the
exchange). :class:`UcxReceiveBatch` registers one contiguous slot per message, for the UCX
microbenchmark (bench/ucx_bench.py) and tests; the read path receives its payloads with one
group receive per node instead (kvstore/wire/ucx_worker.py).

Tags are made here and are unique per client worker: a random 44-bit request counter in the
high bits and the message index in the low 20 bits (kvstore.wire.ucx_worker.batch_tag).

Nodes are tracked by the worker address each advertises over gRPC: a node that restarts
comes back with a new address, :meth:`UcxTransport.observe_node` reports the change, and the
caller drops what it knew about the old process, its endpoint included. Whether UCX reaches a
node is checked once per node process (:meth:`UcxTransport.reachable`), by making the one
endpoint this client keeps to it. Failures never surface as wrong bytes: a message that does
not arrive in time is reported missing (``None``), its receive is cancelled before the slot is
handed back, and the caller falls back to gRPC or to other nodes.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.wire.ucx_worker import (
    BATCH_INDEX_BITS,
    MAX_BATCH_MESSAGES,
    REQUEST_TAG,
    UcxWorker,
    batch_tag,
)

logger = logging.getLogger(__name__)

_REQUEST_ID_BITS = 64 - BATCH_INDEX_BITS


class UcxReceiveBatch:
    """The receives of one read from one node: message i lands in ``slots[i]``.

    A slot is writable host memory (the message lands there), a CUDA array, an ``int`` n
    (a buffer of exactly the message's length, at most n bytes, is allocated on arrival:
    for payloads whose size is not known in advance) or None (no message expected).
    """

    def __init__(self, worker: UcxWorker, tag_base: int, slots: Sequence[Any | None]) -> None:
        if len(slots) > MAX_BATCH_MESSAGES:
            raise InvalidArgument(
                f"{len(slots)} messages in one batch; at most {MAX_BATCH_MESSAGES}, split it"
            )
        self.tag_base = tag_base
        self._worker = worker
        self._landed: dict[int, Any] = {}  # message index -> where it lands
        self._futures: dict[int, asyncio.Future[int]] = {}
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            tag = batch_tag(tag_base, i)
            if isinstance(slot, int):
                self._futures[i] = worker.receive(tag, self._allocator(i), max_bytes=slot)
            else:
                self._landed[i] = slot
                self._futures[i] = worker.receive(tag, slot)

    def _allocator(self, index: int) -> Any:
        def allocate(num_bytes: int) -> memoryview:
            view = self._landed[index] = memoryview(bytearray(num_bytes))
            return view

        return allocate

    def received(self, index: int, num_bytes: int) -> Any:
        """Where message ``index`` landed, cut to its ``num_bytes`` (host memory views)."""
        landed = self._landed[index]
        return landed[:num_bytes] if isinstance(landed, memoryview) else landed

    def __len__(self) -> int:
        return len(self._futures)

    async def wait(self, indexes: Iterable[int] | None, timeout_s: float) -> list[int | None]:
        """Byte counts of messages ``indexes`` (None = all), waiting up to ``timeout_s``.

        A message that failed or did not arrive in time is ``None``; its receive is cancelled
        before this returns, so every slot asked about is free to reuse afterwards.
        """
        wanted = list(self._futures) if indexes is None else list(indexes)
        unknown = [i for i in wanted if i not in self._futures]
        if unknown:
            raise InvalidArgument(f"messages {unknown} have no receive slot in this batch")
        futures = [self._futures[i] for i in wanted]
        if futures:
            await asyncio.wait(futures, timeout=timeout_s)
        counts = [_byte_count(i, f, self.tag_base) for i, f in zip(wanted, futures, strict=True)]
        await self._cancel(i for i, n in zip(wanted, counts, strict=True) if n is None)
        return counts

    async def cancel_one(self, index: int) -> None:
        """Cancel message ``index``'s receive unless it was delivered; afterwards nothing
        writes into its slot."""
        if index in self._futures:  # the worker waits for a transfer still in progress
            await self._worker.cancel(batch_tag(self.tag_base, index))

    async def cancel(self) -> None:
        """Cancel every receive not yet delivered; afterwards no slot can be written."""
        await self._cancel(i for i, f in self._futures.items() if not f.done())

    async def _cancel(self, indexes: Iterable[int]) -> None:
        for index in indexes:
            await self._worker.cancel(batch_tag(self.tag_base, index))

    async def __aenter__(self) -> UcxReceiveBatch:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.cancel()


class UcxTransport:
    """A client's UCX receiver: one worker, tag bases, and the UCX address of each node."""

    def __init__(
        self,
        worker: UcxWorker | None = None,
        *,
        transports: str | None = None,
        seed: int | None = None,
    ) -> None:
        self.worker = worker if worker is not None else UcxWorker(transports)
        self._next_request_id = random.Random(seed).getrandbits(_REQUEST_ID_BITS)
        self._node_to_address: dict[str, bytes] = {}
        self._node_to_reachable: dict[str, bool] = {}
        self._node_to_endpoint: dict[str, Any] = {}

    @property
    def address(self) -> bytes:
        """This client's UCX worker address: sent to nodes in each UCX read request."""
        return self.worker.address

    def next_tag_base(self) -> int:
        """A fresh tag base for one request's messages (unique on this client's worker)."""
        request_id = self._next_request_id
        self._next_request_id = (request_id + 1) % (1 << _REQUEST_ID_BITS)
        return request_id << BATCH_INDEX_BITS

    def new_batch(self, slots: Sequence[Any | None]) -> UcxReceiveBatch:
        """Register receives for one request: message i lands in ``slots[i]`` (None: none).

        Call before sending the request; pass the batch's ``tag_base`` to the node.
        """
        return UcxReceiveBatch(self.worker, self.next_tag_base(), slots)

    def observe_node(self, node_id: str, node_address: bytes) -> bool:
        """Record the UCX address a node advertises; True if it changed (the node restarted).

        A change forgets what was known about the old process, reachability included.
        """
        previous = self._node_to_address.get(node_id)
        if previous == node_address:
            return False
        self.forget_node(node_id)
        self._node_to_address[node_id] = node_address
        if previous is not None:
            logger.info("node %s has a new UCX worker address: it restarted", node_id)
        return previous is not None

    def reachable(self, node_id: str) -> bool:
        """Whether reads from ``node_id`` can come over UCX: the node advertised an address
        and this worker's transports reach it. Checked once per node process, then cached.

        A worker made with ``transports="^tcp"`` reaches only nodes on the same host (or over
        RDMA): over TCP, UCX is slower than gRPC, so transport="auto" should use such a worker.
        """
        address = self._node_to_address.get(node_id)
        if address is None:
            return False
        if node_id not in self._node_to_reachable:
            self._node_to_reachable[node_id] = self._connect(node_id, address)
        return self._node_to_reachable[node_id]

    def send_request(self, node_id: str, frame: bytes) -> asyncio.Future[None]:
        """Send a request frame (kvstore/wire/ucx_frames.py) to a node :meth:`reachable`
        approved."""
        endpoint = self._node_to_endpoint.get(node_id)
        if endpoint is None:
            raise Unavailable(f"node {node_id} is not reachable over UCX")
        sent = self.worker.send(endpoint, REQUEST_TAG, frame)
        sent.add_done_callback(_retrieve_send_outcome)
        return sent

    def node_address(self, node_id: str) -> bytes | None:
        """The UCX address last seen for ``node_id``, or None if it has none."""
        return self._node_to_address.get(node_id)

    def forget_node(self, node_id: str) -> None:
        """Stop using UCX for ``node_id`` until it advertises an address again."""
        self._node_to_address.pop(node_id, None)
        self._node_to_reachable.pop(node_id, None)
        endpoint = self._node_to_endpoint.pop(node_id, None)
        if endpoint is not None:
            endpoint.close()  # never wait for a peer that may be gone

    def _connect(self, node_id: str, address: bytes) -> bool:
        """Make the node's endpoint; UCX fails it when no transport of ours reaches it."""
        try:
            self._node_to_endpoint[node_id] = self.worker.connect(address)
        except (InvalidArgument, Unavailable) as exc:
            logger.info("node %s is not reachable over UCX, reads use gRPC: %s", node_id, exc)
            return False
        return True

    async def close(self) -> None:
        for node_id in list(self._node_to_endpoint):
            self.forget_node(node_id)
        await self.worker.close()


def _retrieve_send_outcome(sent: asyncio.Future[None]) -> None:
    """A request's send is not awaited: its reader waits for the reply, which a failed send
    never brings (the reader's deadline says so). Its outcome is still retrieved, so a send
    cut short by closing the worker is logged here once, not reported by asyncio as "Future
    exception was never retrieved" at exit."""
    if not sent.cancelled() and sent.exception() is not None:
        logger.debug("a UCX request was not sent: %s", sent.exception())


def _byte_count(index: int, future: asyncio.Future[int], tag_base: int) -> int | None:
    if not future.done() or future.cancelled():
        return None
    error = future.exception()
    if error is not None:
        logger.warning("UCX message %d of batch %#x not delivered: %s", index, tag_base, error)
        return None
    return future.result()
