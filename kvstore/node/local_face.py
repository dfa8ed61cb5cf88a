"""The node's local face: what a read over the local channel means.

kvstore/node/local_server.py does the channel's sockets, threads and memory and calls back
here; what a read means (the tenant from the token, the reply-size check, the store call) is
kvstore/node/reads.py's, as for the other faces. The payloads go straight into the client's
memory: data shards to the places the request names in its landing pool (under the request's
permit, kvstore/wire/landing.py), the rest into the region of its arena that the request names;
only the table comes back in the ANSWER.
The credential is checked again on every request (a revoked token stops at once), and the
tenant is the one the connection was opened for: its arena never holds another tenant's bytes.
"""

from __future__ import annotations

import time

import grpc

from kvstore.byte_arena import Region
from kvstore.errors import InvalidArgument
from kvstore.grpc_errors import status_code
from kvstore.node.local_server import LocalSession, RegionTooSmall
from kvstore.node.metrics import NodeMetrics
from kvstore.node.reads import NodeReads
from kvstore.wire import batch_answer, landing, local_frames

RPC_LABEL = "ReadBatchLocal"  # the rpc label of these reads' metrics


class LocalFace:
    """The local server's two callbacks: a connection's HELLO and each of its READs."""

    def __init__(self, reads: NodeReads, metrics: NodeMetrics) -> None:
        self._reads = reads
        self._metrics = metrics

    def open_session(self, token: str, tenant: str) -> LocalSession:
        """A local connection's HELLO: its principal must be allowed the tenant it names."""
        return LocalSession(token, self._reads.tenant_of(token, tenant))

    def read(
        self, session: LocalSession, request: local_frames.ReadRequest, region: memoryview
    ) -> bytes:
        """One local READ (in a connection thread): the payloads go to ``region`` of the
        client's arena, the table is returned."""
        start_s = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            return self._read_into(session, request, region)
        except RegionTooSmall:
            raise
        except Exception as exc:
            code = status_code(exc)
            raise
        finally:
            self._metrics.observe(RPC_LABEL, code, time.perf_counter() - start_s)

    def _read_into(
        self, session: LocalSession, request: local_frames.ReadRequest, region: memoryview
    ) -> bytes:
        staging = Region(None, 0, region)

        def take(num_bytes: int) -> Region:
            if num_bytes > len(region):
                raise RegionTooSmall(num_bytes)
            return staging

        read = self._reads.read_batch(
            session.token,
            session.tenant,
            request.keys,
            request.version,
            take,
            shared=True,
            pool=_pool_landing(session, request),
        )
        if read.staging is not staging:  # a retry outgrew the first guess: copy it over
            if read.payload_bytes > len(region):
                raise RegionTooSmall(read.payload_bytes)
            region[: read.payload_bytes] = read.payloads
        return batch_answer.encode_table(read.entries)


def _pool_landing(
    session: LocalSession, request: local_frames.ReadRequest
) -> landing.PoolLanding | None:
    """Where the READ's payloads may go in the client's landing pool, or None (all through
    the arena: no pool, no places, or no native loop to hold the permit)."""
    if session.pool is None or request.places is None or not landing.NATIVE:
        return None
    if len(request.places) != len(request.keys):
        raise InvalidArgument(f"{len(request.places)} places for {len(request.keys)} keys")
    permit = landing.Permit(session.permit_address(request.permit_index), request.permit_armed)
    return landing.PoolLanding(session.pool, session.pool_address, request.places, permit)
