"""The simulator core on tiny hand-computed traces, and against a naive reference."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttl.errors import UnknownTrafficClass
from ttl.policy import EvictionOrder, TrafficClasses
from ttl.simulator import ALL, SimConfig, simulate
from ttl.traces import trace_from_records

from .sim_reference import reference_simulate

INF = math.inf


def _trace(requests, block_tokens=4, chain=False, partial_blocks="count"):
    """requests: (time_s, class, input_tokens, block ids); partial blocks count by default
    (the hand-computed cases weigh partial blocks)."""
    records = [(t, cls, num_in, 0, list(ids)) for t, cls, num_in, ids in requests]
    return trace_from_records(records, block_tokens, chain=chain, partial_blocks=partial_blocks)


def _run(requests, ttl=None, capacity=None, eviction=EvictionOrder.EXPIRY, warmup=0.0, **kw):
    classes = TrafficClasses(ttl or {"chat": INF})
    return simulate(_trace(requests, **kw), SimConfig(classes, capacity, eviction, warmup))


def test_prefix_hit_ends_at_first_miss_and_tokens_are_weighted():
    result = _run(
        [
            (0.0, "chat", 10, [1, 2, 3]),  # all miss; weights 4, 4, 2
            (1.0, "chat", 9, [1, 2, 7]),  # hits 1, 2; weights 4, 4, 1
            (2.0, "chat", 6, [9, 2]),  # 9 misses first: 2 is resident but does not count
        ]
    )
    s = result.by_class[ALL]
    assert (s.requests, s.blocks, s.hit_blocks) == (3, 8, 2), "prefix hit counted wrongly"
    assert (s.tokens, s.tokens_saved, s.input_tokens) == (25, 8, 25), "token weights wrong"
    assert s.block_hit_ratio == pytest.approx(2 / 8)
    assert s.token_hit_ratio == pytest.approx(8 / 25)
    assert (s.inserted_blocks, s.peak_blocks) == (5, 5)
    assert s.block_seconds == pytest.approx(3 * 1 + 4 * 1), "footprint integral wrong"
    assert result.mean_blocks() == pytest.approx(3.5)
    assert result.window_s == 2.0


def test_block_touched_exactly_at_expiry_is_a_miss():
    result = _run(
        [(0.0, "chat", 4, [1]), (10.0, "chat", 4, [1]), (19.5, "chat", 4, [1])],
        ttl={"chat": 10.0},
    )
    s = result.by_class["chat"]
    assert s.hit_blocks == 1, "expired means now >= expires_at: t=10 misses, t=19.5 hits"
    assert s.expired_blocks == 1
    assert s.block_seconds == pytest.approx(19.5), "expired block counted until its expiry"


def test_hits_refresh_the_ttl_from_last_access():
    result = _run(
        [(0.0, "chat", 4, [1]), (6.0, "chat", 4, [1]), (15.0, "chat", 4, [1])],
        ttl={"chat": 10.0},
    )
    assert result.by_class["chat"].hit_blocks == 2, "a hit at t=6 must extend life to t=16"


def test_blocks_after_the_first_miss_are_touched_too():
    result = _run(
        [(0.0, "chat", 8, [1, 2]), (8.0, "chat", 8, [3, 2]), (15.0, "chat", 8, [1, 2])],
        ttl={"chat": 10.0},
    )
    # t=8 touches block 2 although 3 missed; at 15 block 1 (t=0) is gone, 2 (t=8) is not,
    # but 1 misses first, so the request at 15 hits nothing.
    s = result.by_class["chat"]
    assert s.hit_blocks == 0
    assert s.expired_blocks == 1, "only block 1 expires by t=15; block 2 was refreshed at 8"


def test_expired_blocks_leave_the_footprint_at_their_expiry_instant():
    result = _run([(0.0, "chat", 8, [1, 2]), (100.0, "chat", 4, [3])], ttl={"chat": 30.0})
    s = result.by_class["chat"]
    assert s.block_seconds == pytest.approx(2 * 30.0)
    assert s.peak_blocks == 2
    assert result.mean_blocks("chat") == pytest.approx(60.0 / 100.0)


CAPACITY_TRACE = [
    (0.0, "chat", 4, [1]),
    (1.0, "agent", 4, [2]),
    (2.0, "chat", 4, [3]),  # over capacity 2: EXPIRY drops agent block 2, LRU drops block 1
    (3.0, "agent", 4, [2]),
    (4.0, "chat", 4, [1]),
]


def test_capacity_evicts_earliest_expiry_first():
    result = _run(CAPACITY_TRACE, {"chat": 100.0, "agent": 10.0}, capacity=2)
    assert result.by_class["agent"].hit_blocks == 0, "agent block (expires 11) goes first"
    assert result.by_class["chat"].hit_blocks == 1, "chat block 1 (expires 100) must survive"
    assert result.by_class[ALL].evicted_blocks == 2, "block 2 evicted at t=2 and again at t=3"
    assert result.by_class[ALL].peak_blocks == 2, "capacity exceeded after a request"


def test_capacity_lru_for_comparison():
    result = _run(CAPACITY_TRACE, {"chat": 100.0, "agent": 10.0}, 2, EvictionOrder.LRU)
    assert result.by_class["agent"].hit_blocks == 1, "LRU keeps the agent block touched at 1"
    assert result.by_class["chat"].hit_blocks == 0, "LRU drops block 1 (last access 0)"


def test_zero_capacity_caches_nothing():
    result = _run([(0.0, "chat", 4, [1]), (1.0, "chat", 4, [1])], capacity=0)
    assert result.by_class[ALL].hit_blocks == 0
    assert result.by_class[ALL].block_seconds == 0.0


def test_a_hit_from_another_class_keeps_the_block_class():
    result = _run(
        [(0.0, "agent", 4, [1]), (5.0, "chat", 4, [1]), (16.0, "chat", 4, [1])],
        ttl={"chat": 100.0, "agent": 10.0},
    )
    chat, agent = result.by_class["chat"], result.by_class["agent"]
    assert chat.hit_blocks == 1, "the t=5 hit refreshes with the agent TTL: gone at 15"
    assert agent.expired_blocks == 1
    assert agent.block_seconds == pytest.approx(15.0), "footprint goes to the block's class"
    assert chat.block_seconds == pytest.approx(0.0)


def test_warmup_requests_are_simulated_but_not_counted():
    requests = [(float(t), "chat", 4, [1]) for t in range(11)]
    result = _run(requests, warmup=0.5)
    s = result.by_class[ALL]
    assert s.requests == 6, "requests at t >= 5 are counted"
    assert s.hit_blocks == 6, "the warm-up request at t=0 inserted the block"
    assert s.inserted_blocks == 0
    assert result.window_s == 5.0
    assert s.block_seconds == pytest.approx(5.0)


def test_unknown_class_is_an_error():
    with pytest.raises(UnknownTrafficClass, match="batch"):
        _run([(0.0, "batch", 4, [1])], ttl={"chat": 10.0})


def test_empty_trace():
    result = simulate(trace_from_records([], 4, chain=False), SimConfig())
    assert result.by_class[ALL].requests == 0
    assert math.isnan(result.by_class[ALL].block_hit_ratio)


def test_progress_reports_every_access():
    seen = []
    trace = _trace([(float(t), "chat", 8, [t, t + 1]) for t in range(10)])
    simulate(trace, SimConfig(TrafficClasses({"chat": INF})), progress=seen.append)
    assert seen[-1] == trace.num_accesses


_requests = st.lists(
    st.tuples(
        st.integers(0, 3),  # time step
        st.sampled_from(["chat", "agent"]),
        st.integers(0, 20),  # input tokens
        st.lists(st.integers(0, 7), min_size=0, max_size=6),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(
    requests=_requests,
    chat_ttl=st.sampled_from([1.0, 2.0, 5.0, INF]),
    agent_ttl=st.sampled_from([1.0, 3.0, INF]),
    capacity=st.sampled_from([None, 0, 1, 2, 3, 5]),
    eviction=st.sampled_from(list(EvictionOrder)),
    warmup=st.sampled_from([0.0, 0.3]),
    chain=st.booleans(),
)
def test_matches_the_naive_reference(
    requests, chat_ttl, agent_ttl, capacity, eviction, warmup, chain
):
    time_s = 0.0
    timed = []
    for step, cls, num_in, ids in requests:
        time_s += step
        timed.append((time_s, cls, num_in, ids))
    trace = _trace(timed, block_tokens=4, chain=chain)
    ttl = {"chat": chat_ttl, "agent": agent_ttl}
    config = SimConfig(TrafficClasses(ttl), capacity, eviction, warmup)
    got = simulate(trace, config).by_class
    want = reference_simulate(trace, ttl, capacity, eviction, warmup)
    for name, expected in want.items():
        for key, value in expected.items():
            assert getattr(got[name], key) == pytest.approx(value), (
                f"{name}.{key}: the fast simulator disagrees with the reference "
                "(queue/lazy-deletion bookkeeping bug)"
            )


def test_written_blocks_and_peak_rates_per_window():
    requests = [(0.0, "chat", 8, [1, 2]), (10.0, "chat", 8, [1, 2]), (70.0, "chat", 8, [1, 3]),
                (125.0, "chat", 8, [1, 2])]  # fmt: skip
    config = SimConfig(TrafficClasses({"chat": INF}), rate_window_s=60.0)
    s = simulate(_trace(requests), config).by_class[ALL]
    assert s.written_blocks == 2 + 0 + 1 + 0, "blocks after the prefix hit are written back"
    assert s.peak_hit_blocks_per_s == pytest.approx(2 / 60), (
        "busiest whole minute: 2 hit blocks (the partial third minute is left out)"
    )
    assert s.peak_written_blocks_per_s == pytest.approx(2 / 60), "first minute writes 2"
    short = simulate(_trace(requests[:2]), SimConfig(TrafficClasses({"chat": INF})))
    assert short.by_class[ALL].peak_hit_blocks_per_s == pytest.approx(2 / 10), (
        "a window shorter than one bucket: its own mean rate, not diluted by the bucket"
    )
    with pytest.raises(ValueError, match="rate window"):
        SimConfig(rate_window_s=0.0)
