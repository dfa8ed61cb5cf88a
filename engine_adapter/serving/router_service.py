"""The router's gRPC face (``kvstore serve --grpc-port``) and the Python client of it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving import serving_pb2_grpc as pb_grpc
from engine_adapter.serving.admission import DEFAULT_TIMEOUT_S
from engine_adapter.serving.request_api import RequestAPI
from engine_adapter.serving.worker_endpoint import CHANNEL_OPTIONS
from kvstore.errors import ERRORS
from kvstore.grpc_errors import from_grpc_status, to_grpc_status
from kvstore.tls import aio_channel

if TYPE_CHECKING:
    from engine_adapter.serving.router import Router


class RouterService(pb_grpc.RouterServicer):
    """The router's gRPC face (``kvstore serve --grpc-port``): Generate streams events."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(  # gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        try:
            async for event in self.router.stream_request(request):
                yield event
        except ERRORS as exc:
            await context.abort(*to_grpc_status(exc))

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthReply:
        num_active = self.router.num_waiting + self.router.num_running
        return pb.HealthReply(worker_id="router", role="router", num_active=num_active)


class ServingClient(RequestAPI):
    """Python client of a running router's gRPC face (``kvstore serve --grpc-port P``)."""

    def __init__(
        self,
        address: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """``credentials``: TLS, for a router whose cluster runs TLS (its CA verifies it)."""
        self.address = address
        self.timeout_s = timeout_s
        self.channel = aio_channel(address, credentials, CHANNEL_OPTIONS)
        self.stub = pb_grpc.RouterStub(self.channel)

    async def __aenter__(self) -> ServingClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def stream_request(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateEvent]:
        timeout_s = (request.timeout_s or self.timeout_s) + 5.0  # the router enforces the deadline
        call = self.stub.Generate(request, timeout=timeout_s)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise from_grpc_status(exc.code(), exc.details()) from None
