"""One UCX worker driven by the asyncio loop: the engine under both ends of the UCX data path.

The UCX data path moves shard bytes from a node's memory straight into slots of the client's
buffer pool; gRPC stays the control plane (kvstore/node/ucx_server.py, client/ucx/transport.py).
This module owns what both ends share: the UCX context and worker, endpoints, tagged sends,
tagged receives into caller-owned buffers, their cancellation, and progress. What it tracks
per receive (slots, destinations, a batch's group receive) is kvstore/wire/ucx_receives.py;
loading ucxx and the tag space, kvstore/wire/ucx_runtime.py.

Why one message per shard, received straight into its place (not one message per node)
    A batch read asks each node once; the node answers with a small reply frame (one 64-byte
    entry per shard: status and shard header) and then each HIT payload as a message of its
    own, sent from its staging (kvstore/wire/ucx_frames.py). The client knows every payload's
    place from the table before the payloads arrive, so each message is received straight
    into it: the data shard's place in the caller's block, or scratch for parity. Over shared
    memory each receive is one CMA read by the client (over RDMA, one RDMA read), and the
    node's worker does nothing per byte. The per-shard Python work on the client is a few
    ctypes calls in the worker's dispatch loop (probe, receive, and a status poll when the
    transfer is not done at once): one :class:`GroupReceive` and one future per node per
    batch, never one per shard.
    The alternatives we measured and dropped (one message per node into an IOV, one
    gathered message copied into place, one-sided RMA writes, sending an IOV) are in
    docs/ucx-measurements.md with their figures; in short, each either kept the node's
    worker busy per byte, cost more CPU per GB, or could write into a buffer after its read
    stopped guarding it.

UCX over TCP (``transports="tcp"``; the only transport this wheel has between hosts without a
system UCX built for RDMA) moves less than gRPC (docs/ucx-measurements.md): pick UCX for a
peer only when a worker with ``transports="^tcp"`` can reach it (shared memory, CMA, RDMA).

Why endpoints from worker addresses, with peer error handling off
    Endpoints made from worker addresses (exchanged over gRPC) with error handling off use
    shared memory; with error handling on, UCX drops the shared-memory transports and falls
    back to TCP, an order of magnitude slower (docs/ucx-measurements.md). Without UCX's peer
    failure detection we detect failures ourselves: every wait has a timeout, gRPC tells us a
    node is down or restarted, and over TCP a dead peer still surfaces as a connection-reset
    error. A sender survives a dead receiver (its send just never completes, or fails over
    TCP).

Why receives are matched on arrival (probe, then receive) rather than pre-posted
    A pre-posted receive cannot be cancelled safely: a receive already matched keeps writing
    into its buffer. So :meth:`UcxWorker.receive` only *registers* the slot; when a message
    arrives the progress loop probes it, reads its length and receives it into the exact slot
    (or, for a :class:`GroupReceive`, holds it until its regions are named). A message
    whose tag nobody expects (cancelled, timed out, or too long for its slot) is received into
    a 1-byte tombstone: the truncated receive completes the sender's send without reading
    the payload. :meth:`UcxWorker.cancel` returns only once no UCX operation can still write
    into the slot, so the caller may reuse the buffer at once.

Progress
    One asyncio task calls ``worker.progress`` while anything is pending (or a listener is
    registered), yielding to the loop between calls; after ``spin_s`` without activity it arms
    the worker and sleeps on its epoll file descriptor (and wakes when new work is submitted).
    A timer guards that sleep against a missed event: ``idle_wait_s`` at first, doubling up to
    ``max_idle_wait_s`` while only the timer wakes it (at a fixed 50 ms it was the largest
    part of an idle node's CPU). An idle worker costs almost no CPU, which matters with a
    dozen nodes and clients sharing two cores. UCX refuses to arm while rendezvous sends wait
    for their receiver's pull, and those raise no event: then the loop sleeps ``busy_wait_s``
    (0.5 ms) between turns instead of spinning, which cut the nodes' CPU per GB at the same
    throughput. ``spin_s`` defaults to
    0: polling before sleeping cost throughput on the 2-core machine, where a dozen nodes
    poll, and was a wash on a 16-core host (figures in docs/ucx-measurements.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.wire import ucp, ucx_runtime
from kvstore.wire.ucx_receives import (
    Destination,
    GroupReceive,
    Listener,
    Receive,
    Send,
    destination_of,
    region_for,
    resolve_receive,
    resolve_send,
)

# Re-exported: the names the client, the node and the tests import from this module.
from kvstore.wire.ucx_runtime import (
    BATCH_INDEX_BITS,
    INSTALL_HINT,
    MAX_BATCH_MESSAGES,
    REQUEST_TAG,
    batch_tag,
    check_tag,
    ucx_available,
)

__all__ = [
    "BATCH_INDEX_BITS",
    "DEFAULT_SPIN_S",
    "INSTALL_HINT",
    "MAX_BATCH_MESSAGES",
    "REQUEST_TAG",
    "GroupReceive",
    "UcxWorker",
    "batch_tag",
    "ucx_available",
]

logger = logging.getLogger(__name__)

_MAX_ADDRESS_BYTES = 1 << 16
_ADDRESS_VERSION_MASK = 0x0F  # low bits of a packed worker address's first byte
_TOMBSTONE_BYTES = 1  # a receive this small truncates any real message: nothing is read
_RESTART_PROGRESS_S = 1.0  # after progress failed, while listeners wait for messages
DEFAULT_SPIN_S = 0.0  # polling before sleeping on the epoll fd (see Progress above)


class UcxWorker:
    """A UCX context and worker, progressed by the running asyncio loop.

    ``transports`` sets UCX_TLS for this worker only (e.g. ``"tcp"``); None keeps UCX's choice
    (shared memory and CMA between processes of one host, TCP across hosts). All methods must
    be called from the loop's thread.
    """

    def __init__(
        self,
        transports: str | None = None,
        *,
        spin_s: float = DEFAULT_SPIN_S,
        idle_wait_s: float = 0.05,
        max_idle_wait_s: float = 2.0,
        busy_wait_s: float = 0.0005,
        grace_s: float = 10.0,
    ) -> None:
        if not ucx_available() or ucx_runtime.UCP is None:
            raise Unavailable(f"UCX is not available: ucxx is not installed; {INSTALL_HINT}")
        self._ucp = ucx_runtime.UCP
        self._context = ucx_runtime.make_context(transports)
        self._worker = ucx_runtime.ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._handle: int = self._worker.handle
        self.address: bytes = self._worker.address.tobytes()
        self._spin_s = spin_s
        self._idle_wait_s = idle_wait_s
        self._max_idle_wait_s = max(idle_wait_s, max_idle_wait_s)
        self._next_idle_wait_s = idle_wait_s  # doubles while waits time out with no event
        self._busy_wait_s = busy_wait_s
        self._grace_s = grace_s  # how long a cancelled tag's late message is still drained
        self._expected: dict[int, Receive] = {}
        self._matched: dict[int, Receive] = {}
        self._groups: dict[int, GroupReceive] = {}  # tag base -> its group receive
        self._abandoned: dict[int, float] = {}  # tag -> monotonic deadline
        self._sends: dict[asyncio.Future[None], Send] = {}
        self._listeners: dict[int, Listener] = {}
        # Listened messages in transfer: (receive, the buffer it fills, its listener).
        self._incoming: list[tuple[ucp.Receive, memoryview, Listener]] = []
        self._tombstones: list[ucp.Receive] = []
        self._tombstone = memoryview(bytearray(_TOMBSTONE_BYTES))
        self._wakeup: asyncio.Future[object] | None = None  # set while the loop sleeps
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def connect(self, address: bytes) -> Any:
        """A new endpoint to the worker at ``address``.

        Raises InvalidArgument for a malformed address, Unavailable if UCX finds no
        transport to reach it.
        """
        self._check_open()
        self._check_address(address)
        api = ucx_runtime.ucx_api
        try:
            remote = api.UCXAddress.create_from_buffer(address)
            return api.UCXEndpoint.create_from_worker_address(self._worker, remote, False)
        except api.UCXInvalidParamError as exc:
            raise InvalidArgument(f"malformed UCX worker address ({exc})") from exc
        except Exception as exc:  # ucxx raises its own error types, one per UCX status
            raise Unavailable(f"cannot reach UCX worker ({type(exc).__name__}: {exc})") from exc

    def send(self, endpoint: Any, tag: int, data: Any) -> asyncio.Future[None]:
        """Send ``data`` (any contiguous buffer) with ``tag``; the future resolves when sent.

        ``data`` must stay unchanged until then: UCX reads it in place (zero copy). Cancel
        the future to give up; the peer may still read ``data`` later if it claims the
        message, which is why readers verify checksums.
        """
        self._check_open()
        check_tag(tag)
        array = ucx_runtime.Array(data)
        try:
            request = endpoint.tag_send(array, ucx_runtime.ucx_api.UCXXTag(tag))
        except Exception as exc:
            raise Unavailable(f"UCX send of tag {tag:#x} failed: {exc}") from exc
        future = asyncio.get_running_loop().create_future()
        self._sends[future] = Send(request, future, array)
        future.add_done_callback(self._forget_abandoned_send)
        self._wake()
        return future

    def receive(
        self, tag: int, out: Destination, max_bytes: int | None = None
    ) -> asyncio.Future[int]:
        """Deliver the message tagged ``tag`` into ``out``; the future gives its length.

        ``out`` is writable contiguous host memory, a CUDA array, or a function that the
        worker calls on arrival with the message's length and that returns host memory for
        it (then ``max_bytes`` bounds the length). A message longer than ``out`` (or
        ``max_bytes``) fails the future with InvalidArgument and is discarded. Register before
        asking the peer to send: a message whose tag is not registered is discarded.
        """
        destination, capacity = destination_of(out, max_bytes)
        return self._expect(tag, destination, capacity)

    def receive_group(self, tag_base: int, first: int) -> GroupReceive:
        """Expect messages ``tag_base + first`` onwards (``tag_base`` as :func:`batch_tag`
        takes it); name their regions later with :meth:`GroupReceive.land`."""
        self._check_open()
        batch_tag(tag_base, first)
        if tag_base in self._groups:
            raise InvalidArgument(f"tag base {tag_base:#x} already has a group receive")
        group = GroupReceive(self, tag_base, first, asyncio.get_running_loop().create_future())
        self._groups[tag_base] = group
        self._wake()
        return group

    def _expect(self, tag: int, destination: Destination, capacity: int) -> asyncio.Future[int]:
        self._check_open()
        check_tag(tag)
        if tag in self._expected or tag in self._matched:
            raise InvalidArgument(f"tag {tag:#x} already has a receive; tags are single-use")
        future = asyncio.get_running_loop().create_future()
        self._expected[tag] = Receive(destination, capacity, future)
        self._abandoned.pop(tag, None)
        self._wake()
        return future

    async def cancel_group(self, group: GroupReceive) -> None:
        """Stop a group receive; return once nothing can write into its regions any more."""
        await group.cancel()

    def forget_group(self, group: GroupReceive) -> None:
        """A group is over (landed or cancelled) and nothing of it is in transfer."""
        self._groups.pop(group.tag_base, None)

    def listen(self, tag: int, handler: Callable[[memoryview], None], max_bytes: int) -> None:
        """Receive every message tagged ``tag`` (up to ``max_bytes``; longer ones are
        discarded) into a buffer of its own and call ``handler`` with it.

        The worker then progresses for as long as it is open, sleeping on its epoll file
        descriptor while idle, so that messages are noticed as they arrive.
        """
        self._check_open()
        check_tag(tag)
        self._listeners[tag] = Listener(handler, max_bytes)
        self._wake()

    async def cancel(self, tag: int) -> None:
        """Stop waiting for ``tag``; return once nothing can write into its buffer any more.

        A message that arrives later is discarded without being read. Cancelling a tag that
        is done or unknown does nothing.
        """
        receive = self._expected.pop(tag, None)
        if receive is not None:
            receive.future.cancel()
            receive.released.set()
            self._abandoned[tag] = time.monotonic() + self._grace_s
            return
        receive = self._matched.get(tag)
        if receive is not None:
            receive.future.cancel()
            await receive.released.wait()

    @property
    def num_pending(self) -> int:
        """Sends, receives and tombstones still in flight (for tests and metrics)."""
        return (
            len(self._sends)
            + len(self._expected)
            + len(self._matched)
            + len(self._incoming)
            + len(self._tombstones)
            + sum(len(g.posted) for g in self._groups.values())
        )

    async def close(self) -> None:
        """Cancel every receive, stop progress and release the worker."""
        if self._closed:
            return
        for tag in list(self._expected):
            await self.cancel(tag)
        for group in list(self._groups.values()):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.cancel_group(group), self._idle_wait_s * 10)
        for tag in list(self._matched):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.cancel(tag), self._idle_wait_s * 10)
        self._closed = True
        self._listeners.clear()
        for future in list(self._sends):
            if not future.done():
                future.set_exception(Unavailable("UCX worker closed before the send ended"))
        self._sends.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _check_address(self, address: bytes) -> None:
        """Reject what is surely no worker address before UCX sees it.

        UCX asserts, aborting the whole process, when an address's first byte carries an
        unknown format version; other malformed addresses make it raise, which we map.
        """
        if not 0 < len(address) <= _MAX_ADDRESS_BYTES or (
            address[0] & _ADDRESS_VERSION_MASK != self.address[0] & _ADDRESS_VERSION_MASK
        ):
            raise InvalidArgument(
                f"{len(address)} bytes are not a UCX worker address of this UCX release; "
                "send the address that UcxWorker.address gives, unchanged"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("this UCX worker is closed; create a new one")

    def _wake(self) -> None:
        if self._closed:
            return
        if self._wakeup is not None:
            _set_once(self._wakeup)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._progress_loop())

    def _busy(self) -> bool:
        return bool(
            self._sends
            or self._expected
            or self._matched
            or self._incoming
            or self._tombstones
            or self._abandoned
            or self._listeners
            or self._groups
        )

    async def _progress_loop(self) -> None:
        try:
            await self._progress_until_idle()
        except Exception as exc:
            logger.exception("UCX progress failed; failing every pending transfer")
            self._fail_all(Unavailable(f"UCX progress failed: {type(exc).__name__}: {exc}"))
            if self._listeners and not self._closed:  # a node must keep hearing requests
                asyncio.get_running_loop().call_later(_RESTART_PROGRESS_S, self._wake)

    async def _progress_until_idle(self) -> None:
        """The hot path: progress, match arrivals, resolve completions, yield; sleep if idle."""
        last_active_s = time.monotonic()
        while self._busy() and not self._closed:
            active = self._progress()
            active = self._dispatch() or active
            active = self._reap() or active
            now_s = time.monotonic()
            if active:
                last_active_s = now_s
                self._next_idle_wait_s = self._idle_wait_s
            self._expire_abandoned(now_s)  # stops at the first tag still in its grace period
            if active or now_s - last_active_s < self._spin_s:
                await asyncio.sleep(0)
            else:
                await self._wait_for_event()

    def _progress(self) -> bool:
        """Progress until UCX has nothing more to do now; True if it did anything.

        One ``progress_once`` per turn leaves events behind, and then ``arm`` refuses to
        sleep: the loop spun at 25,000 turns a second on every node of a 12-node cluster.
        """
        active = False
        while self._worker.progress_once():
            active = True
        return active

    async def _wait_for_event(self) -> None:
        """Sleep until the worker's epoll fd fires, new work arrives, or idle_wait_s passes."""
        if not self._worker.arm():
            # UCX reports work pending but had none to do this turn: typically sends waiting
            # for their receiver to pull (rendezvous), whose completion raises no event. Do
            # not spin on them: the receiver's pull needs no progress here, and a short sleep
            # delays only our own bookkeeping (spinning cost the nodes CPU per GB for nothing:
            # docs/ucx-measurements.md).
            await asyncio.sleep(self._busy_wait_s)
            return
        loop = asyncio.get_running_loop()
        wakeup = self._wakeup = loop.create_future()
        fd = self._worker.epoll_file_descriptor
        loop.add_reader(fd, _set_once, wakeup)
        timer = loop.call_later(self._next_idle_wait_s, _set_once, wakeup, _TIMED_OUT)
        try:
            woke_by = await wakeup
        finally:
            timer.cancel()
            loop.remove_reader(fd)
            self._wakeup = None
        # The timer only guards against a missed event: while it alone wakes us, back off
        # (an idle node's wakeups were most of its idle CPU); any event starts over.
        if woke_by is _TIMED_OUT:
            self._next_idle_wait_s = min(2 * self._next_idle_wait_s, self._max_idle_wait_s)
        else:
            self._next_idle_wait_s = self._idle_wait_s

    def _dispatch(self) -> bool:
        """Match every arrived message to its slot, or to a tombstone; True if any arrived."""
        arrived = False
        while (probed := self._ucp.probe(self._handle)) is not None:
            arrived = True
            self._match(*probed)
        return arrived

    def _match(self, message: int, tag: int, num_bytes: int) -> None:
        listener = self._listeners.get(tag)
        if listener is not None and num_bytes <= listener.max_bytes:
            buffer = memoryview(bytearray(num_bytes))
            self._incoming.append((self.post_receive(message, buffer), buffer, listener))
            return
        receive = self._expected.get(tag)
        if receive is None:
            group = self._groups.get(tag - tag % MAX_BATCH_MESSAGES)
            if group is not None and tag % MAX_BATCH_MESSAGES >= group.first:
                group.arrive(tag % MAX_BATCH_MESSAGES, message, num_bytes)
                return
        if receive is not None and num_bytes > receive.capacity:
            self._fail(
                tag, receive, f"is {num_bytes} bytes but its receive holds {receive.capacity}"
            )
            receive = None
        if receive is None:
            self._abandoned.pop(tag, None)
            self.discard(message, num_bytes)
            return
        del self._expected[tag]
        self._post(tag, receive, message, num_bytes)

    def _post(self, tag: int, receive: Receive, message: int, num_bytes: int) -> None:
        """Receive a probed message into its slot (which must take exactly its bytes)."""
        try:
            region = region_for(receive, num_bytes)
        except InvalidArgument as exc:
            self._fail(tag, receive, str(exc))
            self.discard(message, num_bytes)
            return
        receive.num_bytes = num_bytes
        receive.posted = self.post_receive(message, region)
        self._matched[tag] = receive

    def _fail(self, tag: int, receive: Receive, why: str) -> None:
        self._expected.pop(tag, None)
        receive.future.set_exception(
            InvalidArgument(
                f"message with tag {tag:#x} {why}; size receive slots for the largest message"
            )
        )
        receive.released.set()

    def post_receive(self, message: int, region: Any) -> ucp.Receive:
        return self._ucp.receive(self._handle, message, region)

    def discard(self, message: int, num_bytes: int) -> None:
        """Receive an unwanted message into the tombstone: truncated, its bytes never read."""
        self._tombstones.append(self.post_receive(message, self._tombstone))

    def _reap(self) -> bool:
        """Resolve the futures of completed requests; True if any completed."""
        if not (self._matched or self._sends or self._tombstones or self._incoming or self._groups):
            return False
        num_before = self.num_pending
        for group in list(self._groups.values()):
            group.reap()
        if self._incoming:
            self._deliver_incoming()
        for tag, receive in list(self._matched.items()):
            assert receive.posted is not None
            status = receive.posted.status()
            if status != ucp.UCS_INPROGRESS:
                del self._matched[tag]
                resolve_receive(receive, status)
                receive.released.set()
        for send in [s for s in self._sends.values() if s.request.completed]:
            del self._sends[send.future]
            resolve_send(send.future, send.request)
        self._tombstones = [t for t in self._tombstones if t.status() == ucp.UCS_INPROGRESS]
        return self.num_pending < num_before

    def _deliver_incoming(self) -> None:
        """Hand each completely received listened message to its listener."""
        still = []
        for posted, buffer, listener in self._incoming:
            status = posted.status()
            if status == ucp.UCS_INPROGRESS:
                still.append((posted, buffer, listener))
                continue
            if status != ucp.UCS_OK:
                logger.warning("UCX message for a listener not received: status %d", status)
                continue
            try:
                listener.handler(buffer)
            except Exception:
                logger.exception("UCX listener failed on a %d-byte message", len(buffer))
        self._incoming = still

    def _forget_abandoned_send(self, future: asyncio.Future[None]) -> None:
        """Stop tracking a send whose caller gave up (a timeout): a send to a silent peer
        may never complete, and the worker must not progress for it forever."""
        if future.cancelled():
            self._sends.pop(future, None)

    def _fail_all(self, error: Unavailable) -> None:
        pending = [*self._expected.values(), *self._matched.values()]
        for future in [r.future for r in pending] + list(self._sends):
            if not future.done():
                future.set_exception(error)
        for receive in self._expected.values():
            receive.released.set()  # never posted: UCX holds no pointer into its buffer
        self._expected.clear()
        self._sends.clear()

    def _expire_abandoned(self, now_s: float) -> None:
        # Insertion order is deadline order (one grace period for all): stop at the first
        # tag still in its grace period instead of scanning them all.
        while self._abandoned:
            tag, deadline_s = next(iter(self._abandoned.items()))
            if deadline_s > now_s:
                return
            del self._abandoned[tag]


_TIMED_OUT = object()  # what the idle timer wakes a waiting progress loop with


def _set_once(future: asyncio.Future[object], result: object = None) -> None:
    if not future.done():
        future.set_result(result)
