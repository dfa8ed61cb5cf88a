"""``kvstore plan`` end to end: sim results in (JSON, Parquet, or a trace), plans out."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvstore.cli.commands import main
from ttl.generate import WorkloadParams, write_workload

CONTRACT = ("traffic_class", "ttl_s", "capacity_blocks", "logical_tb", "raw_tb", "nodes",
            "read_gb_per_s", "write_gb_per_s", "usd_per_month")  # fmt: skip

_CLUSTER_TOML = """
epoch = 1
[codec]
k = 4
m = 2
backend = "zfec"
[client]
read_fanout = 5
write_quorum = 5
[ttl]
expiry_window_s = 600.0
{nodes}
[[groups]]
nodes = ["n0", "n1", "n2", "n3", "n4", "n5"]
"""
_NODE = """[[nodes]]
id = "n{i}"
address = "127.0.0.1:{port}"
metrics_port = 0
failure_domain = "d{i}"
data_dir = "/tmp/unused"
high_watermark = 0.9
low_watermark = 0.8
"""


@pytest.fixture(scope="module")
def sim_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plan")
    trace = folder / "w.jsonl"
    write_workload(WorkloadParams(days=2.0, chat_sessions_per_day=60, agent_sessions_per_day=6,
                                  agent_turns=4, seed=2), trace)  # fmt: skip
    out = folder / "sim.json"
    assert main(["sim", "--trace", str(trace), "--block-tokens", "128", "--ttl", "chat=1d,7d",
                 "--ttl", "agent=3d", "--capacity", "30%,inf", "--warmup", "0.3",
                 "--json", str(out), "--no-progress"]) == 0  # fmt: skip
    return out


def _plan(out: Path, *args: str) -> dict:
    assert main(["plan", *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_minimal_call_writes_the_contract(sim_json: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "folder" / "plan.json"  # parents are made
    document = _plan(out, "--sim", str(sim_json), "--bytes-per-token", "890")
    results = document["results"]
    assert len(results) == len(json.loads(sim_json.read_text())["results"])
    for record in results:
        missing = [key for key in CONTRACT if key not in record]
        assert not missing, f"plan JSON contract fields {missing} missing"
        assert record["raw_tb"] > record["logical_tb"] > 0
        assert record["erasure_tb"] == pytest.approx(0.2 * record["logical_tb"], rel=0.01)
        assert record["usd_per_month"] is None, "no price given: no cost"
    assert {r["traffic_class"] for r in results} == {"agent", "chat", "all"}
    assert document["inputs"]["bytes_per_token"] == 890.0


def test_parquet_input_plans_like_json(sim_json: Path, tmp_path: Path) -> None:
    by_json = _plan(tmp_path / "a.json", "--sim", str(sim_json))["results"]
    by_parquet = _plan(tmp_path / "b.json", "--sim", str(sim_json.with_suffix(".parquet")))
    assert [r["raw_tb"] for r in by_parquet["results"]] == [r["raw_tb"] for r in by_json]


def test_cluster_config_scale_price_and_plot(sim_json: Path, tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.toml"
    nodes = "".join(_NODE.format(i=i, port=10_000 + i) for i in range(6))
    cluster.write_text(_CLUSTER_TOML.format(nodes=nodes))
    base = _plan(tmp_path / "base.json", "--sim", str(sim_json), "--cluster", str(cluster),
                 "--usd-per-tb-month", "10")  # fmt: skip
    tier = base["inputs"]["tier"]
    assert (tier["data_shards"], tier["parity_shards"], tier["read_fanout"]) == (4, 2, 5)
    assert (tier["expiry_window_s"], tier["low_watermark"]) == (600.0, 0.8)
    record = base["results"][0]
    assert record["erasure_tb"] == pytest.approx(0.5 * record["logical_tb"], rel=0.01), "4+2"
    assert record["usd_per_month"] == pytest.approx(10 * record["raw_tb"])
    plots = tmp_path / "plots"
    one = _plan(tmp_path / "one.json", "--sim", str(sim_json))["results"]
    scaled = _plan(tmp_path / "scaled.json", "--sim", str(sim_json), "--scale", "1000",
                   "--plot-dir", str(plots), "--y-range", "50,100")["results"]  # fmt: skip
    for a, b in zip(one, scaled, strict=True):
        for key in ("raw_tb", "read_gb_per_s", "write_gb_per_s", "prefill_tokens_saved_per_day"):
            assert b[key] == pytest.approx(1000 * a[key]), f"--scale must multiply {key}"
        assert b["token_hit_ratio"] == a["token_hit_ratio"]
    assert (plots / "hit_ratio_vs_raw_tb.png").stat().st_size > 0


def test_trace_and_grid_input_and_model_figures(tmp_path: Path) -> None:
    trace = tmp_path / "w.jsonl"
    write_workload(WorkloadParams(days=1.0, chat_sessions_per_day=30, agent_sessions_per_day=3,
                                  agent_turns=3, seed=4), trace)  # fmt: skip
    document = _plan(tmp_path / "p.json", "--trace", str(trace), "--block-tokens", "128",
                     "--ttl", "chat=3d,7d", "--ttl", "agent=3d", "--model", "random:tiny",
                     "--kv-dtype", "bfloat16", "--parquet", str(tmp_path / "p.parquet"),
                     "--no-progress")  # fmt: skip
    assert document["inputs"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 2, "tiny: 2 layers, 2 KV "
    assert pq.read_table(tmp_path / "p.parquet").num_rows == len(document["results"])


def test_bad_input_is_a_clear_error(sim_json: Path, tmp_path: Path, capsys) -> None:
    assert main(["plan", "--sim", str(sim_json), "--trace", str(sim_json)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["plan", "--sim", str(tmp_path / "missing.json")]) == 2
    assert "no simulation result" in capsys.readouterr().err
    assert main(["plan", "--sim", str(sim_json), "--erasure", "ten"]) == 2
    assert "k+m" in capsys.readouterr().err
    (tmp_path / "old.json").write_text(json.dumps({"results": [{"traffic_class": "all"}]}))
    assert main(["plan", "--sim", str(tmp_path / "old.json"), "--bytes-per-token", "1"]) == 2
    assert "run kvstore sim again" in capsys.readouterr().err
