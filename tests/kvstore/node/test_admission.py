"""Load shedding (pure): a data request that would outlast its deadline is refused up front."""

from __future__ import annotations

import pytest

from kvstore.errors import CapacityExhausted, Overloaded
from kvstore.grpc_errors import from_grpc_status, to_grpc_status
from kvstore.node.admission import Admission


def test_requests_are_admitted_while_they_can_finish_in_time() -> None:
    admission = Admission("n0")
    admission.admit("ReadBatch", 5.0, 0.0)
    admission.admit("Health", 0.0, 0.0)  # control RPCs are never shed
    admission.admit("Stats", None, 0.0)
    assert admission.in_flight == 1
    admission.finished("ReadBatch", 0.01)
    admission.finished("Health", 0.01)
    assert admission.in_flight == 0


def test_a_request_whose_deadline_the_queue_would_outlast_is_shed() -> None:
    admission = Admission("n0")
    for _ in range(40):
        admission.admit("PutShards", 10.0, 0.0)
    admission.mean_service_s["PutShards"] = 0.5  # a loaded node: half a second each
    with pytest.raises(Overloaded, match="overloaded: node n0 sheds PutShards"):
        admission.admit("PutShards", 2.0, 0.5)  # 40 ahead / 4 at once x 0.5 s: about 5.5 s
    admission.admit("PutShards", None, 0.5)  # no deadline: only the hard cap applies
    assert admission.num_shed == 1
    admission.admit("PutShards", 2.0, 1.6)  # a second after the last: admitted to measure
    with pytest.raises(Overloaded):
        admission.admit("PutShards", 2.0, 1.7)


def test_the_in_flight_cap_holds_without_deadlines() -> None:
    admission = Admission("n0", max_in_flight=3)
    for _ in range(3):
        admission.admit("GetShards", None, 0.0)
    with pytest.raises(Overloaded):
        admission.admit("GetShards", None, 5.0)


def test_shed_requests_map_to_resource_exhausted_and_back_to_overloaded() -> None:
    shed = Overloaded("overloaded: node n0 sheds ReadBatch: ...")
    code, details = to_grpc_status(shed)
    assert code.name == "RESOURCE_EXHAUSTED"
    assert isinstance(from_grpc_status(code, details), Overloaded)
    full = from_grpc_status(code, "node n0: 100 more bytes do not fit")
    assert type(full) is CapacityExhausted, "a full disk is not an overload"
