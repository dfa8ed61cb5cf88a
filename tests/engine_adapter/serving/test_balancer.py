"""The prefill balancer's pure parts: cost-model fit, chunk size, buckets, earliest-finish
routing, and the offline reference assignments of ``kvstore bench serve``."""

from __future__ import annotations

import random

import pytest

from engine_adapter.serving.balancer import (
    BalancerConfig,
    PrefillBalancer,
    PrefillCostModel,
    PrefillSample,
    list_schedule_makespan_s,
    makespan_lower_bound_s,
)

A, B, C, D = 0.02, 2e-4, 3e-8, 1e-5  # s, s/token, s/token^2, s per cached token


def _true_s(num_new: int, num_cached: int) -> float:
    end = num_new + num_cached
    return A + B * num_new + C * (end * end - num_cached * num_cached) + D * num_cached


def _samples(num: int, seed: int = 0, noise: float = 0.0) -> list[PrefillSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        num_new, num_cached = rng.randrange(1, 8000), rng.choice([0, 0, rng.randrange(0, 30000)])
        seconds = _true_s(num_new, num_cached) * (1 + rng.uniform(-noise, noise))
        out.append(PrefillSample(num_new, num_cached, seconds))
    return out


def test_cost_model_recovers_the_quadratic():
    model = PrefillCostModel(_samples(64))
    for got, want in zip(model.coefficients, (A, B, C, D), strict=True):
        assert got == pytest.approx(want, rel=1e-6), f"fit {model.coefficients} != {A, B, C, D}"
    assert model.predict_s(100_000) == pytest.approx(A + B * 1e5 + C * 1e10, rel=1e-6), (
        "n^2 term wrong at long context: the features are not the issue's a + b*n + c*n^2"
    )


def test_cost_model_stays_non_negative_and_follows_recent_prefills():
    linear = [PrefillSample(n, 0, 0.01 + 1e-4 * n) for n in (64, 128, 256, 512)]
    model = PrefillCostModel(linear, window=8)
    assert all(k >= 0 for k in model.coefficients), f"negative coefficient {model.coefficients}"
    assert model.predict_s(1000) == pytest.approx(0.11, rel=1e-3)
    for _ in range(8):  # the worker got twice as slow: the window forgets the calibration
        for n in (64, 512):
            model.observe(PrefillSample(n, 0, 2 * (0.01 + 1e-4 * n)))
    assert model.predict_s(1000) == pytest.approx(0.22, rel=1e-3), (
        "the online fit did not follow the measured prefills"
    )


def test_noisy_samples_fit_close():
    model = PrefillCostModel(_samples(256, seed=1, noise=0.05))
    assert model.predict_s(4000) == pytest.approx(_true_s(4000, 0), rel=0.05)


def test_chunk_size_fits_the_step_budget_at_the_end_of_the_context():
    model = PrefillCostModel([PrefillSample(n, 0, 0.005 + 1e-4 * n) for n in (64, 256, 1024)])
    # step of k tokens at any position: 0.005 + 1e-4 k <= 0.030  ->  k <= 250  ->  192
    assert model.chunk_tokens_for(0.030, 64, 4096) == 192
    assert model.chunk_tokens_for(0.001, 64, 4096) == 64, "at least one block per chunk"
    quadratic = PrefillCostModel([PrefillSample(n, 0, 1e-6 * n * n) for n in (64, 512, 1024)])
    # the last step of k tokens ending at 4096 costs 1e-6 (4096^2 - (4096-k)^2)
    assert quadratic.chunk_tokens_for(1.0, 64, 4096) == 64
    assert quadratic.chunk_tokens_for(3.0, 64, 4096) == 384  # 2.998 s; 448 would be 3.47 s


def test_buckets():
    config = BalancerConfig()
    assert [config.bucket_of(n) for n in (1, 16383, 16384, 65535, 65536, 262144, 10**6)] == [
        0, 0, 1, 1, 2, 3, 3,
    ]  # fmt: skip
    assert config.bucket_names() == ["<16K", "16K-64K", "64K-256K", ">=256K"]
    with pytest.raises(ValueError, match="increasing"):
        BalancerConfig(bucket_bounds_tokens=(100, 50))


def _balancer(*rates: float) -> PrefillBalancer:
    """Workers w0, w1, ... whose calibration says t = rate * n seconds."""
    balancer = PrefillBalancer()
    for i, rate in enumerate(rates):
        balancer.add_worker(f"w{i}", [PrefillSample(n, 0, rate * n) for n in (64, 512, 2048)])
    return balancer


def test_a_request_goes_where_it_finishes_soonest():
    balancer = _balancer(1e-3, 1e-3)
    workers = ["w0", "w1"]
    assert balancer.assign("long", 10_000, 0.0, workers) == "w0"  # 10 s on w0
    assert balancer.assign("short-1", 500, 0.0, workers) == "w1"
    assert balancer.assign("short-2", 500, 0.0, workers) == "w1"  # w1 free at 1 s < 10 s
    assert balancer.finish_s("w1", 1000, 0.0) == pytest.approx(2.0)
    balancer.finish("w1", "short-1", 0.5)  # done early: the next one starts now
    assert balancer.finish_s("w1", 1000, 0.5) == pytest.approx(0.5 + 0.5 + 1.0)
    assert balancer.finish_s("w0", 1000, 4.0) == pytest.approx(4.0 + 6.0 + 1.0), (
        "the running request's elapsed time must come off the backlog"
    )


def test_faster_worker_gets_more_and_ties_spread_buckets():
    balancer = _balancer(1e-3, 3e-3)
    picks = [balancer.assign(f"r{i}", 1000, 0.0, ["w0", "w1"]) for i in range(8)]
    assert picks.count("w0") == 6, f"a 3x faster worker should take 3/4 of equal work: {picks}"
    even = _balancer(1e-3, 1e-3)
    first = [even.assign(f"a{i}", 100, 0.0, ["w0", "w1"]) for i in range(2)]
    assert sorted(first) == ["w0", "w1"], "idle equal workers must share, not pile on one"


def test_update_corrects_for_what_the_store_served():
    balancer = _balancer(1e-3, 1e-3)
    balancer.assign("cached", 10_000, 0.0, ["w0"])
    balancer.update("w0", "cached", num_new=500, num_cached=9_500)
    assert balancer.finish_s("w0", 0, 0.0) < 1.0, "a mostly cached prefill still counts 10 s"


def test_offline_references():
    durations = [3.0, 3.0, 2.0, 2.0, 2.0]
    assert list_schedule_makespan_s(durations, 2) == 7.0  # LPT: 3+2+2 | 3+2
    assert makespan_lower_bound_s(durations, 2) == 6.0
    assert makespan_lower_bound_s([5.0, 1.0], 2) == 5.0


def test_a_worker_holds_what_it_runs_plus_its_queue():
    balancer = _balancer(1e-3)
    assert balancer.has_room("w0")
    balancer.assign("a", 100, 0.0, ["w0"])
    assert balancer.has_room("w0"), "one running request leaves room for one queued"
    balancer.assign("b", 100, 0.0, ["w0"])
    assert not balancer.has_room("w0"), "late binding: the rest must wait at the router"
    balancer.finish("w0", "a", 0.1)
    assert balancer.has_room("w0")
