"""The router's pure parts: worker choice, request validation, replay checks, demo summary."""

from __future__ import annotations

import pytest

from engine_adapter.serving.demo import Row, summarize
from engine_adapter.serving.request import Request
from engine_adapter.serving.router import _check_replay
from engine_adapter.serving.worker_endpoint import WorkerEndpoint, WorkerSet
from kvstore.errors import InvalidArgument, Unavailable


def _workers(*loads: int) -> list[WorkerEndpoint]:
    return [
        WorkerEndpoint(f"127.0.0.1:{9000 + i}", "prefill", None, None, f"p{i}", num_active=n)
        for i, n in enumerate(loads)
    ]


def test_least_loaded_picks_the_idlest_and_rotates_ties():
    workers = WorkerSet(_workers(0, 0, 0))
    picked = [workers.pick(set()).worker_id for _ in range(6)]
    assert picked == ["p0", "p1", "p2", "p0", "p1", "p2"], "ties must rotate, not pile on p0"
    workers.workers[1].num_active = 0
    workers.workers[0].num_active = workers.workers[2].num_active = 3
    assert {workers.pick(set()).worker_id for _ in range(4)} == {"p1"}


def test_round_robin_ignores_load():
    workers = WorkerSet(_workers(5, 0), policy="round-robin")
    assert [workers.pick(set()).worker_id for _ in range(4)] == ["p0", "p1", "p0", "p1"]


def test_pick_skips_down_and_tried_workers():
    workers = WorkerSet(_workers(0, 0, 0))
    workers.workers[0].mark_down("connection refused")
    tried = {workers.workers[1].address}
    assert {workers.pick(tried).worker_id for _ in range(3)} == {"p2"}
    tried.add(workers.workers[2].address)
    assert workers.pick(tried) is None, "no worker left must be None, not a down worker"
    assert "p1" in workers.describe(tried)


def test_request_validates():
    with pytest.raises(InvalidArgument, match="either a non-empty"):
        Request()
    with pytest.raises(InvalidArgument, match="either a non-empty"):
        Request([{"role": "user", "content": "hi"}], token_ids=[1])
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        Request(token_ids=[1], max_new_tokens=0)
    with pytest.raises(InvalidArgument, match="either a non-empty"):
        Request(token_ids=[])
    with pytest.raises(InvalidArgument, match="tenant"):
        Request(token_ids=[1], tenant="")
    with pytest.raises(InvalidArgument, match="top_p"):
        Request(token_ids=[1], top_p=0)
    with pytest.raises(InvalidArgument, match="stop"):
        Request(token_ids=[1], stop=["a", ""])
    request = Request(token_ids=[1, 2], tenant="t", traffic_class="agent", seed=3, top_k=5)
    proto = request.to_proto()
    assert proto.request_id and list(proto.token_ids) == [1, 2]
    assert (proto.sampling.seed, proto.sampling.top_k) == (3, 5)
    assert Request.from_proto(proto) == request, "a request does not survive the wire"


def test_restarted_decode_must_repeat_streamed_tokens():
    worker = _workers(0)[0]
    assert _check_replay([7, 8], 0, 7, worker) == 1
    assert _check_replay([7, 8], 2, 9, worker) == 3
    with pytest.raises(Unavailable, match="not deterministic"):
        _check_replay([7, 8], 1, 5, worker)


def _row(cached: int, ttft_s: float, worker: str) -> Row:
    return Row(0, "c", "acme", "chat", 100, cached, 100 - cached, ttft_s, worker, "d0", cached, "")


def test_demo_summary():
    rows = [_row(0, 2.0, "p0"), _row(64, 0.5, "p1"), _row(64, 0.7, "p0"), _row(0, 1.0, "p1")]
    summary = summarize(rows, wall_s=10.0)
    assert summary["requests"] == 4 and summary["prompt_tokens"] == 400
    assert summary["cached_tokens"] == 128 and summary["token_hit_ratio"] == 0.32
    assert summary["ttft_cold_s"] == pytest.approx(1.5)
    assert summary["ttft_cached_s"] == pytest.approx(0.6)
    assert summary["hits_per_prefill_worker"] == {"p0": 1, "p1": 1}
