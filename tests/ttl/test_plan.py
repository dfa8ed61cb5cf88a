"""Capacity planning arithmetic (ttl.plan) on hand-computed records."""

from __future__ import annotations

import math

import pytest

from ttl.plan import (
    MODEL_PRESETS,
    TierConfig,
    llama_kv_bytes_per_token,
    parse_bytes_per_token,
    plan_record,
    plan_records,
    scale_for_tokens_per_day,
)

TIER = TierConfig(index_bytes_per_shard=460.0)


def _record(**changes) -> dict:
    record = {
        "traffic_class": "chat", "policy": "lru", "ttl_s": 7 * 86400.0, "ttl_label": "chat=1w",
        "capacity_blocks": None, "capacity_label": "inf", "block_tokens": 128,
        "window_s": 36_000.0, "peak_blocks": 1000, "expired_blocks": 3600, "hit_blocks": 7200,
        "written_blocks": 3600, "tokens_saved": 921_600, "input_tokens": 1_000_000,
        "token_hit_ratio": 0.5, "block_hit_ratio": 0.5,
        "peak_hit_blocks_per_s": 2.0, "peak_written_blocks_per_s": 1.0,
    }  # fmt: skip
    return {**record, **changes}


def test_every_overhead_is_itemised_and_adds_up() -> None:
    # 128 tokens x 10 B = 1280 B per block; 10+2 shards of 128 B, each 128 + 48 + 72 on disk
    plan = plan_record(_record(), bytes_per_token=10.0, tier=TIER, scale=1.0)
    tb = 1e12
    assert plan["logical_tb"] * tb == pytest.approx(1000 * 1280)
    assert plan["erasure_tb"] / plan["logical_tb"] == pytest.approx(0.2), "10+2 is x1.2"
    assert plan["headers_tb"] * tb == pytest.approx(1000 * 12 * 120)
    assert plan["index_tb"] * tb == pytest.approx(1000 * 12 * 460)
    # 3600 expired in 36000 s = 0.1/s, waiting up to the 3600 s window: 360 blocks on disk
    assert plan["expiry_slack_tb"] * tb == pytest.approx(360 * 12 * 248)
    stored = sum(plan[k] for k in ("logical_tb", "erasure_tb", "headers_tb", "index_tb",
                                   "expiry_slack_tb"))  # fmt: skip
    assert plan["raw_tb"] == pytest.approx(stored / 0.95), "no capacity: high watermark"
    assert plan["raw_tb"] == pytest.approx(stored + plan["watermark_tb"])
    capped = plan_record(_record(capacity_blocks=1000), 10.0, TIER, 1.0)
    assert capped["raw_tb"] == pytest.approx(stored / 0.85), "capacity: evicts to low watermark"


def test_bandwidth_nodes_cost_and_tokens_saved() -> None:
    tier = TierConfig(node_read_bytes_per_s=100.0, node_write_bytes_per_s=100.0,
                      usd_per_tb_month=20.0)  # fmt: skip
    plan = plan_record(_record(), 10.0, tier, scale=1.0)
    # a hit reads 11 shards of 248 B; a written block writes 12
    assert plan["read_gb_per_s"] * 1e9 == pytest.approx(2.0 * 11 * 248), "peak reads"
    assert plan["mean_read_gb_per_s"] * 1e9 == pytest.approx(0.2 * 11 * 248)
    assert plan["write_gb_per_s"] * 1e9 == pytest.approx(1.0 * 12 * 248), "peak writes"
    assert plan["mean_write_gb_per_s"] * 1e9 == pytest.approx(0.1 * 12 * 248)
    assert plan["nodes_for_read"] == math.ceil(2.0 * 11 * 248 / 100.0)
    assert plan["nodes"] == plan["nodes_for_read"] and plan["nodes_bound_by"] == "read"
    assert plan["usd_per_month"] == pytest.approx(plan["raw_tb"] * 20.0)
    assert plan["prefill_tokens_saved_per_day"] == pytest.approx(921_600 / 36_000 * 86_400)
    small = plan_record(_record(), 10.0, TIER, 1.0)
    assert small["nodes"] == 12 and small["nodes_bound_by"] == "group", "one placement group"


def test_scale_multiplies_traffic_not_hit_ratios() -> None:
    one, three = (plan_record(_record(), 10.0, TIER, s) for s in (1.0, 3.0))
    for key in ("logical_tb", "raw_tb", "read_gb_per_s", "write_gb_per_s",
                "prefill_tokens_saved_per_day"):  # fmt: skip
        assert three[key] == pytest.approx(3 * one[key]), f"{key} must scale with traffic"
    assert three["token_hit_ratio"] == one["token_hit_ratio"]
    # 1e6 input tokens in 36000 s is 2.4e6 per day
    assert scale_for_tokens_per_day([_record(traffic_class="all")], 4.8e6) == pytest.approx(2.0)


def test_marginal_cost_follows_the_cost_frontier() -> None:
    rows = [
        _record(peak_blocks=1000, token_hit_ratio=0.50),
        _record(peak_blocks=2000, token_hit_ratio=0.60),
        _record(peak_blocks=3000, token_hit_ratio=0.55),  # costs more, hits less: dominated
    ]
    cheap, better, worse = plan_records(rows, 10.0, TierConfig(usd_per_tb_month=10.0))
    assert cheap["marginal_usd_per_point"] is None and not cheap["dominated"]
    assert worse["dominated"] and worse["marginal_raw_tb_per_point"] is None
    extra_tb = better["raw_tb"] - cheap["raw_tb"]
    assert better["marginal_raw_tb_per_point"] == pytest.approx(extra_tb / 10.0)
    assert better["marginal_usd_per_point"] == pytest.approx(extra_tb * 10.0 / 10.0)


def test_bytes_per_token_numbers_presets_and_layouts() -> None:
    assert parse_bytes_per_token("890") == 890.0
    assert parse_bytes_per_token("deepseek-v4.1-flash") == 890.0 == MODEL_PRESETS[
        "deepseek-v4.1-flash"]  # fmt: skip
    assert parse_bytes_per_token("32x8x128xbf16") == 2 * 32 * 8 * 128 * 2
    assert MODEL_PRESETS["llama-3.1-8b-bf16"] == llama_kv_bytes_per_token(32, 8, 128, "bf16")
    for bad in ("0", "-3", "nan", "llama", "32x8x128xfp7"):
        with pytest.raises(ValueError, match=r"bytes-per-token|dtype"):
            parse_bytes_per_token(bad)


def test_bad_tier_and_old_records_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="low_watermark"):
        TierConfig(low_watermark=0.95, high_watermark=0.9)
    with pytest.raises(ValueError, match="drives per node"):
        TierConfig(drives_per_node=0)
    old = _record()
    del old["written_blocks"]
    with pytest.raises(ValueError, match="run kvstore sim again"):
        plan_record(old, 10.0, TIER, 1.0)


def test_counts_read_fanout_and_its_bounds() -> None:
    from ttl.plan import parse_count

    assert parse_count("155T") == 155e12 and parse_count("2.5k") == 2500 and parse_count("7") == 7
    with pytest.raises(ValueError, match="155T"):
        parse_count("lots")
    wide = plan_record(_record(), 10.0, TierConfig(read_fanout=12), 1.0)
    assert wide["read_gb_per_s"] * 1e9 == pytest.approx(2.0 * 12 * 248), "reads all 12 shards"
    with pytest.raises(ValueError, match="read fanout"):
        TierConfig(read_fanout=9)
