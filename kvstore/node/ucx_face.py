"""The node's UCX face: batch reads that come over UCX, answered over UCX.

The request and reply frames are kvstore/wire/ucx_frames.py's; the sends are
:class:`~kvstore.node.ucx_server.UcxServer`'s; what a read means (the tenant from the token,
the reply-size check, the store call) is kvstore/node/reads.py's, as for the other faces.
Requests arrive in the UCX worker's progress loop. As over gRPC, a read of a few keys is done
right there; the straggler delay and larger batches (read in the pool) run in a task. UCX has
no TLS: a request is answered only if its session's key signed it, and acts as the
credential the session was opened with over gRPC (kvstore/node/ucx_sessions.py). Every
failure is answered at once (as over gRPC) except a malformed request, which names no reply
address to refuse it to.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvstore.errors import InvalidArgument, KVStoreError, PermissionDenied, Unavailable
from kvstore.grpc_errors import status_code
from kvstore.node import ucx_server
from kvstore.node.metrics import NodeMetrics
from kvstore.node.reads import NodeReads
from kvstore.node.ucx_server import UcxServer
from kvstore.node.ucx_sessions import UcxSession, UcxSessions
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.shard_store import BatchRead
from kvstore.wire import ucx_frames
from kvstore.wire.ucx_worker import REQUEST_TAG

log = logging.getLogger(__name__)

RPC_LABEL = "ReadBatchUcx"  # the rpc label of these reads' metrics


class UcxFace:
    """Answers the batch read requests that ``ucx``'s worker receives (see the module doc)."""

    def __init__(
        self, ucx: UcxServer, reads: NodeReads, metrics: NodeMetrics, delay_s: float
    ) -> None:
        self._ucx = ucx
        self.sessions = UcxSessions()  # opened over gRPC (OpenUcxSession)
        self._reads = reads
        self._metrics = metrics
        self._delay_s = delay_s
        self._tasks: set[asyncio.Task[None]] = set()
        ucx.worker.listen(REQUEST_TAG, self._on_request, ucx_frames.MAX_REQUEST_BYTES)

    async def close(self) -> None:
        """Take no more requests, then stop those still being answered (their clients fall
        back to gRPC): before the store closes under them."""
        await self._ucx.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _on_request(self, frame: memoryview) -> None:
        """One request from the worker's progress loop: answered inline or from a task."""
        start_s = time.perf_counter()
        try:
            decoded = ucx_frames.decode_request(frame)
        except InvalidArgument as exc:  # no reply address to refuse it to, unless an old client
            self._refuse_malformed(frame, exc)
            self._metrics.observe(RPC_LABEL, status_code(exc), time.perf_counter() - start_s)
            return
        request = decoded.request
        session = self.sessions.find(decoded.session_id)
        if session is None or not decoded.signed_with(session.key):
            error = PermissionDenied(
                "unknown or expired UCX session, or a request its key did not sign: open a "
                "session over gRPC (OpenUcxSession)"
            )
            ucx_server.refuse(self._ucx, request.ucx, error, None)
            self._metrics.observe(RPC_LABEL, status_code(error), time.perf_counter() - start_s)
        elif self._delay_s or not self._reads.runs_inline(len(request.keys)):
            task = asyncio.ensure_future(self._serve_later(session, request, start_s))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._answer(session, request, None, start_s)

    def _refuse_malformed(self, frame: memoryview, error: InvalidArgument) -> None:
        """An earlier release's request (a token frame) is refused at once in its format, so
        that client reads over gRPC without waiting out its UCX timeout; anything else is
        dropped (no reply address)."""
        delivery = ucx_frames.legacy_reply_address(frame)
        if delivery is None:
            log.warning("dropping a malformed UCX read request: %s", error)
            return
        refusal = Unavailable(
            "this node reads over UCX only in sessions (OpenUcxSession): upgrade the client; "
            "read over gRPC meanwhile"
        )
        ucx_server.refuse(self._ucx, delivery, refusal, None, legacy=True)

    async def _serve_later(
        self, session: UcxSession, request: pb.GetShardsRequest, start_s: float
    ) -> None:
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        read: BatchRead | Exception
        try:
            read = await self._reads.in_pool(self._read, session, request)
        except Exception as exc:  # answered below, like a failure of an inline read
            read = exc
        self._answer(session, request, read, start_s)

    def _read(self, session: UcxSession, request: pb.GetShardsRequest) -> BatchRead:
        return self._reads.read_batch(
            session.credential, request.tenant, list(request.keys), request.version
        )

    def _answer(
        self,
        session: UcxSession,
        request: pb.GetShardsRequest,
        read: BatchRead | Exception | None,
        start_s: float,
    ) -> None:
        """Read (unless ``read`` holds the read's outcome), then answer over UCX; the staging
        is released once the client took the payloads."""
        code = grpc.StatusCode.OK
        try:
            if isinstance(read, Exception):
                raise read
            if read is None:
                read = self._read(session, request)
            self._send(request.ucx, read, session.key)
        except Exception as exc:  # the client hears of every failure at once, as over gRPC
            error = exc if isinstance(exc, KVStoreError) else None
            if error is None:
                log.exception("UCX read request failed")
                error = KVStoreError(f"{type(exc).__name__}: {exc}")  # INTERNAL
            code = status_code(error)
            ucx_server.refuse(self._ucx, request.ucx, error, session.key)
        self._metrics.observe(RPC_LABEL, code, time.perf_counter() - start_s)

    def _send(self, delivery: pb.UcxDelivery, read: BatchRead, key: bytes) -> None:
        try:
            sent = ucx_server.answer(self._ucx, delivery, read, key)
        except BaseException:
            read.release()
            raise
        sent.add_done_callback(lambda _, done=read: done.release())
