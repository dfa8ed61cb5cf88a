"""The UCX engine in one process: two real workers (sender and receiver) on one event loop.

Covers delivery into exact slots, too-long messages, cancellation with late messages, and
misuse. Cross-process behaviour (a real node-side process, restarts) is in
test_ucx_processes.py.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import numpy as np
import pytest

from client.ucx.transport import UcxTransport
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.node.ucx_server import UcxServer
from kvstore.wire import ucp
from kvstore.wire.ucx_worker import MAX_BATCH_MESSAGES, UcxWorker, batch_tag, ucx_available

if not ucx_available():
    pytest.skip("the optional ucx extra (ucxx) is not installed", allow_module_level=True)

# UCX's choice (shared memory + CMA here), forced TCP, and everything but TCP (what
# transport="auto" should require of a peer: TCP through UCX is slower than gRPC).
TRANSPORTS = [None, "tcp", "^tcp"]


@pytest.fixture(params=TRANSPORTS, ids=["default", "tcp", "no-tcp"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[UcxServer, UcxTransport]]:
    server = UcxServer(transports=request.param)
    client = UcxTransport(transports=request.param, seed=1)
    try:
        yield server, client
    finally:
        await client.close()
        await server.close()


def _payloads(sizes: list[int], seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


async def test_messages_land_in_their_own_slots(pair: tuple[UcxServer, UcxTransport]) -> None:
    server, client = pair
    payloads = _payloads([48, 100_000, 1 << 20, 7])
    slots = [bytearray(len(p) + 16) for p in payloads]
    batch = client.new_batch([memoryview(s) for s in slots])
    sent = await server.send(client.address, batch.tag_base, payloads, timeout_s=10)
    counts = await batch.wait(None, timeout_s=10)
    assert sent, "the server must report delivery once the client took every message"
    assert counts == [len(p) for p in payloads], "byte counts must be the message lengths"
    for payload, slot in zip(payloads, slots, strict=True):
        assert slot[: len(payload)] == payload, "a message landed in the wrong slot or torn"
        assert slot[len(payload) :] == bytes(16), "a receive wrote past its message"
    assert client.worker.num_pending == 0 and server.worker.num_pending == 0


async def test_skipped_messages_and_subset_waits(pair: tuple[UcxServer, UcxTransport]) -> None:
    server, client = pair
    payloads = _payloads([1000, 2000, 3000])
    slots = [bytearray(4000) for _ in payloads]
    batch = client.new_batch([memoryview(slots[0]), None, memoryview(slots[2])])
    sent = await server.send(client.address, batch.tag_base, [payloads[0], None, payloads[2]], 10)
    assert sent
    assert await batch.wait([2, 0], timeout_s=10) == [3000, 1000]
    with pytest.raises(InvalidArgument, match="no receive slot"):
        await batch.wait([1], timeout_s=1)


async def test_too_long_message_fails_its_slot_only(pair: tuple[UcxServer, UcxTransport]) -> None:
    server, client = pair
    small, big = bytearray(10), bytearray(100)
    batch = client.new_batch([memoryview(small), memoryview(big)])
    sent = await server.send(client.address, batch.tag_base, [b"x" * 50, b"y" * 60], 10)
    assert sent, "a too-long message must be discarded on the client, completing the send"
    assert await batch.wait(None, timeout_s=10) == [None, 60]
    assert small == bytes(10), "a too-long message must not write into the small slot"


async def test_allocate_on_arrival_gives_exact_sized_buffers(
    pair: tuple[UcxServer, UcxTransport],
) -> None:
    server, client = pair
    payloads = _payloads([10, 300_000])
    slot = bytearray(20)
    batch = client.new_batch([64, memoryview(slot), 1 << 20, 16])
    sent = await server.send(
        client.address, batch.tag_base, [payloads[0], b"in-place", payloads[1], b"x" * 17], 10
    )
    assert sent
    counts = await batch.wait(None, timeout_s=10)
    assert counts == [10, 8, 300_000, None], "a message over its max_bytes must fail alone"
    assert bytes(batch.received(0, 10)) == payloads[0]
    assert bytes(batch.received(2, 300_000)) == payloads[1]
    assert len(batch.received(2, 300_000).obj) == 300_000, "allocated to the message's size"
    assert bytes(batch.received(1, 8)) == b"in-place" and slot[:8] == b"in-place"


async def test_cancelled_receive_discards_the_late_message(
    pair: tuple[UcxServer, UcxTransport],
) -> None:
    server, client = pair
    slot = bytearray(1 << 20)
    batch = client.new_batch([memoryview(slot)])
    assert await batch.wait(None, timeout_s=0.01) == [None], "nothing was sent yet"
    late = b"L" * (1 << 20)
    sent = await server.send(client.address, batch.tag_base, [late], timeout_s=10)
    assert sent, "a late message to a cancelled tag must still complete the sender's send"
    assert slot == bytes(1 << 20), "a cancelled slot was written: buffer reuse is unsafe"


async def test_unknown_tags_are_discarded(pair: tuple[UcxServer, UcxTransport]) -> None:
    server, client = pair
    stray = client.new_batch([])  # a tag base nobody registered a slot for
    slot = bytearray(8)
    batch = client.new_batch([memoryview(slot)])
    assert await server.send(client.address, stray.tag_base, [b"stray"], 10)
    assert await server.send(client.address, batch.tag_base, [b"12345678"], 10)
    assert await batch.wait(None, 10) == [8] and slot == b"12345678"


async def test_server_reports_a_client_that_never_takes_its_message() -> None:
    server, client = UcxServer(), UcxTransport(seed=2)
    try:
        await client.worker.close()  # alive process, but nobody progresses its worker
        sent = await server.send(client.address, 0, [b"z" * (1 << 20)], timeout_s=0.2)
        assert not sent, "a send nobody takes must time out, not hang"
        assert server.num_endpoints == 0, "the endpoint of a silent client must be dropped"
        assert server.worker.num_pending == 0, "given-up sends must not be tracked forever"
    finally:
        await server.close()


async def test_a_request_cut_short_by_closing_the_client_is_no_stray_error() -> None:
    """A request's send is not awaited (its reader waits for the reply): when the client closes
    mid-send, the send's failure is retrieved, not reported by asyncio at exit."""
    server, client = UcxServer(), UcxTransport(transports="^tcp", seed=5)
    stray: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: stray.append(context))
    try:
        await server.worker.close()  # nobody progresses the node's side: the send cannot end
        client.observe_node("n00", server.address)
        assert client.reachable("n00")
        sent = client.send_request("n00", b"z" * (4 << 20))
        await client.close()
        assert sent.done(), "closing the worker must end its sends"
        del sent  # its exception unread here, as a reader leaves it
        gc.collect()
        await asyncio.sleep(0)
        assert not stray, f"asyncio reported a request's send: {stray}"
    finally:
        await client.close()
        await server.close()


async def test_misuse_raises_with_advice() -> None:
    worker = UcxWorker()
    try:
        with pytest.raises(InvalidArgument, match="writable"):
            worker.receive(1, memoryview(b"read only"))
        worker.receive(5, memoryview(bytearray(4)))
        with pytest.raises(InvalidArgument, match="single-use"):
            worker.receive(5, memoryview(bytearray(4)))
        with pytest.raises(InvalidArgument, match="64-bit"):
            worker.receive(1 << 64, memoryview(bytearray(4)))
        with pytest.raises(InvalidArgument, match="not a UCX worker address"):
            worker.connect(b"not a worker address")  # UCX itself would abort the process
        with pytest.raises(InvalidArgument, match="malformed"):
            worker.connect(worker.address[:1] + bytes(100))
        await worker.cancel(5)
    finally:
        await worker.close()
    with pytest.raises(Unavailable, match="closed"):
        worker.receive(6, memoryview(bytearray(4)))


async def test_post_refuses_bad_requests_at_once() -> None:
    server = UcxServer()
    try:
        with pytest.raises(InvalidArgument, match="UCX worker address"):
            server.post(b"\x0fgarbage", 0, [b"x"], timeout_s=1)
        with pytest.raises(InvalidArgument, match="low 20 bits"):
            server.post(server.address, 1, [b"x"], timeout_s=1)
        assert server.num_endpoints == 0 and server.worker.num_pending == 0
    finally:
        await server.close()


def test_unknown_transport_names_are_rejected() -> None:
    with pytest.raises(InvalidArgument, match="transports 'bogus'"):
        UcxWorker("bogus")


async def test_unreachable_worker_is_unavailable() -> None:
    tcp_only, shm_only = UcxWorker("tcp"), UcxWorker("sm")
    try:
        with pytest.raises(Unavailable, match="cannot reach"):
            tcp_only.connect(shm_only.address)  # no transport in common
    finally:
        await tcp_only.close()
        await shm_only.close()


async def test_reachability_is_checked_once_per_node_process() -> None:
    same_host = UcxServer()
    client = UcxTransport(transports="^tcp", seed=4)
    tcp_only = UcxServer(transports="tcp")
    try:
        assert not client.reachable("n00"), "a node that advertised nothing is not reachable"
        assert not client.observe_node("n00", same_host.address)
        assert client.reachable("n00")
        assert not client.observe_node("n01", tcp_only.address)
        assert not client.reachable("n01"), "without TCP this client must not reach a TCP node"
        assert client.observe_node("n01", same_host.address), "a new address is a restart"
        assert client.reachable("n01"), "a restarted node must be checked again"
        with pytest.raises(Unavailable, match="cannot reach"):
            tcp_only.post(client.address, 0, [b"x"], timeout_s=1)
        with pytest.raises(Unavailable, match="moments ago"):
            tcp_only.post(client.address, 0, [b"x"], timeout_s=1)  # cached: UCX not asked
    finally:
        await client.close()
        await same_host.close()
        await tcp_only.close()


def test_batch_tags_keep_index_and_base_apart() -> None:
    base = 3 * MAX_BATCH_MESSAGES
    assert batch_tag(base, 0) == base and batch_tag(base, 7) == base + 7
    with pytest.raises(InvalidArgument, match="low 20 bits"):
        batch_tag(base + 1, 0)
    with pytest.raises(InvalidArgument, match="split the request"):
        batch_tag(base, MAX_BATCH_MESSAGES)


def test_tag_bases_are_unique_per_client() -> None:
    async def bases() -> list[int]:
        client = UcxTransport(seed=3)
        try:
            return [client.new_batch([]).tag_base for _ in range(1000)]
        finally:
            await client.close()

    tag_bases = asyncio.run(bases())
    assert len(set(tag_bases)) == len(tag_bases), "tag bases repeat: replies could cross"
    assert all(b % MAX_BATCH_MESSAGES == 0 for b in tag_bases)


class _TransferInProgress:
    """Stands in for a posted receive that UCX is still writing into its buffer."""

    done = False

    def status(self) -> int:
        return ucp.UCS_OK if self.done else ucp.UCS_INPROGRESS


async def test_cancel_returns_only_once_no_transfer_can_write_into_the_buffer() -> None:
    """A buffer must not be handed back while UCX may still write into it: a cancel of a
    receive in transfer waits for its end, even when a first cancel was itself cut short."""
    client = UcxTransport(seed=3)
    try:
        out = bytearray(100)
        tag = batch_tag(client.next_tag_base(), 0)
        client.worker.receive(tag, memoryview(out))
        receive = client.worker._expected.pop(tag)  # as _post does when it arrives
        receive.posted, receive.num_bytes = _TransferInProgress(), 50
        client.worker._matched[tag] = receive
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.worker.cancel(tag), 0.05)
        with pytest.raises(TimeoutError):  # the transfer is still writing into `out`
            await asyncio.wait_for(client.worker.cancel(tag), 0.1)
        receive.posted.done = True  # the transfer ends; the worker reaps it
        await asyncio.wait_for(client.worker.cancel(tag), 5)
        assert tag not in client.worker._matched, "receive still live after its cancel"
    finally:
        await client.close()


@pytest.mark.parametrize("transports", [None, "tcp"], ids=["default", "tcp"])
async def test_a_group_receive_holds_early_messages_until_it_lands_or_is_cancelled(
    transports: str | None,
) -> None:
    server = UcxServer(transports=transports)
    client = UcxTransport(transports=transports, seed=5)
    try:
        payloads = _payloads([300_000, 1000, 200_000])
        tag_base = client.next_tag_base()
        group = client.worker.receive_group(tag_base, 1)
        sent = server.post(client.address, tag_base, [None, *payloads], 5.0)
        await asyncio.sleep(0.2)
        assert not group.future.done(), "a group receive completed before its regions existed"
        regions = [bytearray(len(p)) for p in payloads]
        group.land([memoryview(r) for r in regions])
        assert await asyncio.wait_for(group.future, 5) == sum(map(len, payloads))
        assert [bytes(r) for r in regions] == payloads, "messages landed in the wrong regions"
        assert await sent
        assert client.worker.num_pending == 0, "a landed group left receives behind"

        dropped_base = client.next_tag_base()
        dropped = client.worker.receive_group(dropped_base, 1)
        sent = server.post(client.address, dropped_base, [None, *payloads], 5.0)
        await asyncio.sleep(0.2)
        await client.worker.cancel_group(dropped)
        assert await asyncio.wait_for(sent, 5), "cancelled held messages kept their sender waiting"
        assert dropped.future.cancelled()

        wrong_base = client.next_tag_base()
        wrong = client.worker.receive_group(wrong_base, 1)
        wrong.land([memoryview(bytearray(10))] * len(payloads))
        server.post(client.address, wrong_base, [None, *payloads], 5.0)
        with pytest.raises(InvalidArgument, match="not the size of its region"):
            await asyncio.wait_for(wrong.future, 5)
    finally:
        await client.close()
        await server.close()


async def test_an_idle_listener_backs_off_its_timer_and_still_wakes_on_a_message() -> None:
    """An idle node's worker must not wake every 50 ms (twelve idle nodes burned most of
    their CPU that way), yet a request arriving after a long idle must wake it at once: by
    the epoll event, not the backed-off timer (which only guards against a missed event)."""
    node = UcxWorker(idle_wait_s=5.0, max_idle_wait_s=3600.0)
    client = UcxWorker()
    try:
        loop = asyncio.get_running_loop()
        arrived: asyncio.Future[float] = loop.create_future()
        node.listen(77, lambda message: arrived.set_result(loop.time()), 1024)
        deadline_s = loop.time() + 120
        while node._next_idle_wait_s < 10.0 and loop.time() < deadline_s:
            await asyncio.sleep(0.05)
        assert node._next_idle_wait_s >= 10.0, "the idle worker's timer did not back off"
        sent_s = loop.time()  # the node's timer started a 10 s wait just now
        await client.send(client.connect(node.address), 77, b"request")
        arrived_s = await asyncio.wait_for(arrived, 60)
        assert arrived_s - sent_s < 8.0, "the request waited for the idle timer, not its event"
        assert node._next_idle_wait_s == 5.0, "activity must reset the idle backoff"
    finally:
        await client.close()
        await node.close()
