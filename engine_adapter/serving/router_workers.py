"""The router's workers: the prefill and decode worker sets, their health (waited for at
start, then probed in the background: a down worker comes back once its Health answers, a
wedged one goes) and the draining of a decode worker. Which worker gets a request is the
router's (router.py) and the balancer's (balancer.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc

from engine_adapter.serving import serving_pb2 as pb
from engine_adapter.serving.worker_endpoint import HEALTH_TIMEOUT_S, WorkerEndpoint, WorkerSet
from kvstore.errors import InvalidArgument, Unavailable

PROBE_INTERVAL_S = 1.0


class RouterWorkers:
    """The prefill and decode workers of one router, and their health."""

    def __init__(
        self,
        prefill_addresses: Sequence[str],
        decode_addresses: Sequence[str],
        credentials: grpc.ChannelCredentials | None,
        policy: str,
    ) -> None:
        self.prefill = WorkerSet(
            [WorkerEndpoint.open(a, "prefill", credentials) for a in prefill_addresses]
        )
        self.decode = WorkerSet(
            [WorkerEndpoint.open(a, "decode", credentials) for a in decode_addresses]
        )
        if policy == "round-robin":
            self.prefill.policy = policy
        self._probe_task: asyncio.Task[None] | None = None

    @property
    def endpoints(self) -> list[WorkerEndpoint]:
        return self.prefill.workers + self.decode.workers

    @property
    def max_model_len(self) -> int:
        """The smallest ``max_model_len`` any worker reported (0 before it answered)."""
        lengths = [w.health.max_model_len for w in self.endpoints if w.health.max_model_len]
        return min(lengths, default=0)

    async def wait_healthy(self, timeout_s: float) -> None:
        """Until every worker answers Health; Unavailable naming the first that did not."""
        deadline_s = time.monotonic() + timeout_s
        for worker in self.endpoints:
            while await worker.probe() is None:
                if time.monotonic() > deadline_s:
                    raise Unavailable(
                        f"{worker.role} worker at {worker.address} did not answer Health "
                        f"within {timeout_s} s; is it running (see its log)?"
                    )
                await asyncio.sleep(0.1)

    def start_probing(self) -> None:
        self._probe_task = asyncio.create_task(self._probe_workers())

    async def _probe_workers(self) -> None:
        """Every worker's Health now and then: a down one comes back, a wedged one goes."""
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(w.probe() for w in self.endpoints), return_exceptions=True)

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.endpoints))

    async def drain(self, worker_id: str, grace_s: float) -> int:
        """:meth:`Router.drain <engine_adapter.serving.router.Router.drain>`."""
        worker = next((w for w in self.decode.workers if w.worker_id == worker_id), None)
        if worker is None:
            known = [w.worker_id for w in self.decode.workers]
            raise InvalidArgument(f"no decode worker {worker_id!r}; decode workers: {known}")
        if not self.decode.candidates({worker.address}):
            raise InvalidArgument(
                f"{worker_id} is the only decode worker taking requests: its requests would "
                "have nowhere to go; start another decode worker first"
            )
        worker.draining = True
        reply = await worker.stub.Drain(pb.DrainRequest(grace_s=grace_s), timeout=HEALTH_TIMEOUT_S)
        return reply.num_active
