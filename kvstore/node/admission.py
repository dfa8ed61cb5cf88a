"""Load shedding: a node refuses data requests it could not finish within their deadline.

Under overload a queue that keeps every request grows until requests wait past their
deadlines: the node then works only on requests whose callers gave up, every get turns into a
silent miss and a healthy cluster fails puts. So each data RPC is admitted or refused when its
handler starts, before it does any work::

    expected finish = (requests in flight ahead of it / PARALLELISM + 1) x mean service time
    refused (RESOURCE_EXHAUSTED, Overloaded) when
        its remaining deadline is under ``expected finish``, or
        MAX_IN_FLIGHT requests are in flight already

The mean service time is a moving average per RPC of the time admitted requests took (on a
loaded host it grows, and the node sheds sooner). So that an estimate from a bad moment cannot
shed an RPC forever, one request of it is admitted whatever the estimate once ``PROBE_S`` has
passed since the last one: its time corrects the average. The client backs off from a node that shed
(client/node_health.py): reads ask other nodes meanwhile, puts retry after a pause.
Health, Stats and the other control RPCs are never shed: ``cluster status`` must answer on a
loaded cluster. Pure code: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import Overloaded
from kvstore.grpc_errors import OVERLOADED_MARK

SHED_RPCS = frozenset(
    {"PutShards", "GetShards", "ReadBatch", "Contains", "TouchShards", "ListShards"}
)
MAX_IN_FLIGHT = 256
PARALLELISM = 4.0  # requests a node makes progress on at once (pool threads, the loop)
SERVICE_ALPHA = 0.1  # weight of the newest service time in the moving average
INITIAL_SERVICE_S = 0.005
PROBE_S = 1.0  # an RPC shed this long gets one request admitted to measure it again


@dataclass
class Admission:
    """In-flight data requests of one node, and their mean service time per RPC."""

    node_id: str
    max_in_flight: int = MAX_IN_FLIGHT
    in_flight: int = 0
    num_shed: int = 0
    mean_service_s: dict[str, float] = field(default_factory=dict)
    last_admitted_s: dict[str, float] = field(default_factory=dict)

    def admit(self, rpc: str, remaining_s: float | None, now_s: float) -> None:
        """Count the request in, or raise Overloaded (nothing was done for it). ``now_s``:
        monotonic seconds."""
        if rpc not in SHED_RPCS:
            return
        service_s = self.mean_service_s.get(rpc, INITIAL_SERVICE_S)
        expected_s = (self.in_flight / PARALLELISM + 1) * service_s
        late = remaining_s is not None and remaining_s < expected_s
        probe = now_s - self.last_admitted_s.get(rpc, now_s) >= PROBE_S
        if self.in_flight >= self.max_in_flight or (late and not probe):
            self.num_shed += 1
            raise Overloaded(
                f"{OVERLOADED_MARK} node {self.node_id} sheds {rpc}: {self.in_flight} requests "
                f"in flight, about {expected_s:.3f} s to serve it, "
                f"{'no' if remaining_s is None else f'{remaining_s:.3f} s'} deadline left; "
                "retry after a backoff"
            )
        self.in_flight += 1
        self.last_admitted_s[rpc] = now_s

    def finished(self, rpc: str, service_s: float) -> None:
        """An admitted request ended after ``service_s``."""
        if rpc not in SHED_RPCS:
            return
        self.in_flight -= 1
        mean = self.mean_service_s.get(rpc, service_s)
        self.mean_service_s[rpc] = mean + SERVICE_ALPHA * (service_s - mean)
