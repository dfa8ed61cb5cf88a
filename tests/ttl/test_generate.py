"""The synthetic workload generator: seeded, chained ids, shared prompts, loadable."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvstore.cli.commands import main
from ttl.generate import WorkloadParams, generate_requests, request_hash_ids, write_workload
from ttl.policy import TrafficClasses
from ttl.simulator import SimConfig, simulate
from ttl.traces import LoadOptions, load_trace

SMALL = WorkloadParams(
    days=1.0, chat_sessions_per_day=150, agent_sessions_per_day=15, agent_turns=5, seed=7
)


def test_same_seed_gives_a_byte_identical_trace(tmp_path: Path) -> None:
    write_workload(SMALL, tmp_path / "a.jsonl")
    write_workload(SMALL, tmp_path / "b.jsonl")
    other = WorkloadParams(**{**SMALL.__dict__, "seed": 8})
    write_workload(other, tmp_path / "c.jsonl")
    a = (tmp_path / "a.jsonl").read_bytes()
    assert a == (tmp_path / "b.jsonl").read_bytes(), "the generator is not deterministic"
    assert a != (tmp_path / "c.jsonl").read_bytes(), "the seed is ignored"


def test_ids_are_prefix_chained_and_prompts_shared() -> None:
    requests = generate_requests(SMALL)
    times = [r[0] for r in requests]
    assert times == sorted(times), "requests must come out in time order"
    id_to_position: dict[int, int] = {}
    first_ids = set()
    for request in requests:
        ids = list(request_hash_ids(request))
        assert len(ids) == request[2] // SMALL.block_tokens, "hash_ids cover full blocks only"
        for position, block_id in enumerate(ids):
            assert id_to_position.setdefault(block_id, position) == position, (
                "a chained id must always sit at the same position"
            )
        if ids:
            first_ids.add(ids[0])
    num_sessions = len({r[6] for r in requests})
    assert len(first_ids) < num_sessions / 2, "system prompts are not shared across sessions"


def test_trace_loads_and_longer_ttl_hits_more(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    write_workload(SMALL, path)
    trace = load_trace(path, "mooncake", LoadOptions(block_tokens=SMALL.block_tokens))
    assert trace.class_names == ("agent", "chat")
    assert trace.span_s < SMALL.days * 86_400

    def hit_ratio(ttl_s: float) -> float:
        config = SimConfig(TrafficClasses({"chat": ttl_s, "agent": ttl_s}))
        return simulate(trace, config).by_class["chat"].token_hit_ratio

    assert hit_ratio(60.0) < hit_ratio(6 * 3600.0) < hit_ratio(math.inf), (
        "chat users return over hours: longer TTLs must hit more"
    )


def test_cli_writes_the_trace(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("KVSTORE_PROGRESS_INTERVAL_S", "0")  # a line at every report
    out = tmp_path / "g.jsonl"
    rc = main(["sim", "generate", "--out", str(out), "--days", "0.2", "--seed", "1",
               "--chat-sessions-per-day", "50", "--agent-sessions-per-day", "5"])  # fmt: skip
    assert rc == 0
    assert out.stat().st_size > 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out
    assert "[kvstore] generating sessions:" in captured.err, "sim generate must say it is alive"
    assert "[kvstore] generating sessions: done" in captured.err


def test_bad_parameters_are_explained() -> None:
    with pytest.raises(ValueError, match="diurnal_amplitude"):
        WorkloadParams(diurnal_amplitude=2.0)
    with pytest.raises(ValueError, match="means >= 1"):
        WorkloadParams(chat_turns=0.5)
