"""Replay a tiny trace against a real 12-node local cluster at a high time scale.

The cluster runs a virtual day every 4 real seconds with the default classes (chat 7d, agent
3d). Every reuse in the trace is at least a virtual day away from a TTL edge, so request latency
(lag behind the trace, reported by the replay) cannot flip a hit unless a loaded machine makes
the replay lag 4 real seconds (at 2 virtual days a second the margin was half a second, and a
suite running beside another one lagged past it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.local_cluster import LocalCluster
from kvstore.cli.commands import main

pytestmark = pytest.mark.timeout(240)

DAY_MS = 86_400_000
TIME_SCALE = 86_400.0 / 4  # a virtual day every 4 real seconds
MARGIN_S = 86_400.0  # the closest TTL edge to any reuse in TRACE

TRACE = [  # (day, class, hash ids); block_tokens 4
    (0.0, "chat", [1, 2, 3]),
    (0.0, "agent", [10, 11]),
    (1.0, "chat", [1, 2, 3, 4]),  # hits 3
    (1.0, "agent", [10, 11, 12]),  # hits 2
    (2.5, "agent", [10, 11, 12, 13]),  # hits 3
    (7.0, "agent", [10, 11]),  # expired at day 5.5: no hit
    (7.0, "chat", [1, 2, 3, 4, 5]),  # touched day 1, lives to day 8: hits 4
    (10.0, "chat", [1, 2]),  # touched day 7: hits 2
]
EXPECTED_HITS = {"chat": (9, 14), "agent": (5, 11), "all": (14, 25)}  # (hit blocks, blocks)


def _write_trace(path: Path) -> None:
    lines = [
        json.dumps(
            {
                "timestamp": round(day * DAY_MS),
                "input_length": 4 * len(ids),
                "output_length": 1,
                "class": cls,
                "hash_ids": ids,
            }
        )
        for day, cls, ids in TRACE
    ]
    path.write_text("\n".join(lines) + "\n")


def test_replay_measures_the_simulated_hit_ratio(tmp_path: Path, capsys) -> None:
    trace_path, out = tmp_path / "trace.jsonl", tmp_path / "replay.json"
    _write_trace(trace_path)
    with LocalCluster.start(tmp_path / "cluster", 12, TIME_SCALE, fsync=False) as cluster:
        rc = main(
            [
                "sim", "replay", "--trace", str(trace_path), "--block-tokens", "4",
                "--cluster", str(cluster.cluster_toml), "--block-bytes", "2048",
                "--json", str(out),
            ]
        )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["max_lag_s"] < MARGIN_S, "the replay lagged past a TTL edge: machine too busy"
    assert report["vanished_hits"] == 0, "a block reported present by match_prefix then missed"
    for record in report["results"]:
        name = record["traffic_class"]
        hits, blocks = EXPECTED_HITS[name]
        assert record["blocks"] == blocks
        assert record["simulated_hit_blocks"] == hits, f"{name}: simulator semantics changed"
        assert record["measured_hit_blocks"] == hits, (
            f"{name}: the cluster's TTLs disagree with the simulator (refresh on get, "
            "no refresh on match_prefix, expiry at last access + class TTL)"
        )
    assert "cluster block hit" in capsys.readouterr().out
