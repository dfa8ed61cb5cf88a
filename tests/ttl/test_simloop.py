"""The compiled loop (ttl/simloop.c) against the Python pass, its reference, on random traces."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttl import simloop
from ttl.policy import EvictionOrder, TrafficClasses
from ttl.simulator import SimConfig, SimCounts, simulate_counts
from ttl.traces import trace_from_records

INF = math.inf

pytestmark = pytest.mark.skipif(
    not simloop.NATIVE, reason="ttl/_simloop.so is not built (make native needs a C compiler)"
)

_requests = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0, 3.0]),  # gap to the previous request
        st.sampled_from(["chat", "agent", "batch"]),
        st.integers(0, 40),  # input tokens
        st.lists(st.integers(0, 12), min_size=0, max_size=10),
    ),
    min_size=0,
    max_size=60,
)


def _assert_same(got: SimCounts, want: SimCounts) -> None:
    for name in SimCounts.__dataclass_fields__:
        mine, theirs = getattr(got, name), getattr(want, name)
        if name == "deaths":
            for k, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                for field in ("expired_blocks", "evicted_blocks"):
                    assert getattr(a, field) == getattr(b, field), f"class {k} {field}"
                assert a.block_seconds == pytest.approx(b.block_seconds), f"class {k} footprint"
        elif isinstance(mine, np.ndarray):
            np.testing.assert_array_equal(
                mine, theirs, err_msg=f"{name}: the C loop and the Python pass disagree"
            )
        else:
            assert mine == theirs, name


@settings(max_examples=300, deadline=None)
@given(
    requests=_requests,
    ttls=st.tuples(*[st.sampled_from([0.5, 1.0, 2.0, 5.0, INF])] * 3),
    capacity=st.sampled_from([None, 0, 1, 2, 3, 5, 8]),
    eviction=st.sampled_from(list(EvictionOrder)),
    warmup=st.sampled_from([0.0, 0.3, 0.7]),
    chain=st.booleans(),
)
def test_compiled_loop_matches_the_python_pass(requests, ttls, capacity, eviction, warmup, chain):
    time_s, records = 0.0, []
    for gap, cls, num_in, ids in requests:
        time_s += gap
        records.append((time_s, cls, num_in, 0, ids))
    trace = trace_from_records(records, 4, chain=chain, partial_blocks="count")
    classes = TrafficClasses(dict(zip(("chat", "agent", "batch"), ttls, strict=True)))
    config = SimConfig(classes, capacity, eviction, warmup)
    want = simulate_counts(trace, config, compiled=False)
    _assert_same(simulate_counts(trace, config, compiled=True), want)


def test_progress_and_a_bigger_trace():
    rng = np.random.default_rng(0)
    records = [
        (float(t), ["chat", "agent"][t % 2], 64, 0, rng.integers(0, 300, 8).tolist())
        for t in range(2000)
    ]
    trace = trace_from_records(records, 8, chain=True)
    config = SimConfig(TrafficClasses({"chat": 50.0, "agent": 20.0}), 150, EvictionOrder.LRU)
    seen: list[int] = []
    got = simulate_counts(trace, config, progress=seen.append, compiled=True)
    assert seen[-1] == trace.num_accesses, "progress must reach every access"
    _assert_same(got, simulate_counts(trace, config, compiled=False))
