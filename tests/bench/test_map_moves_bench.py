"""``kvstore bench map-moves``: the figures it prints are the ones the note quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.map_moves_bench import measure_moves, measure_weight_moves


def test_moves_are_the_ideal_and_regeneration_is_an_order_worse() -> None:
    rows = {row["change"]: row for row in measure_moves(12, 5_000, seed=1)}
    assert (
        rows["drain"]["ratio_to_ideal"] == 1.0
        and rows["out (down past down_out_s)"]["ratio_to_ideal"] == 1.0
    ), "a drain or out moved shards other than the node's own"
    assert 0.9 <= rows["join"]["ratio_to_ideal"] <= 1.1
    assert rows["join by regenerating groups"]["ratio_to_ideal"] > 5


def test_moving_to_weights_hands_over_slots_near_the_ideal() -> None:
    """4 of 24 nodes get half the byte limit: handing slots over in the same change moves
    about the shards the new shares require; weighting the groups alone costs several times
    that (keys change group, all their shards with them)."""
    rows = measure_weight_moves(24, 5_000, seed=1)
    limits_only, handed_over = (row["ratio_to_ideal"] for row in rows)
    assert handed_over < 1.5, f"moving to weights moved {handed_over}x the ideal"
    assert limits_only > 3


def test_cli_writes_json_and_refuses_too_few_nodes(tmp_path: Path) -> None:
    out = tmp_path / "moves.json"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "map-moves", "--keys", "2000"]
    done = subprocess.run([*command, "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0 and "join by regenerating groups" in done.stdout, done.stderr
    assert len(json.loads(out.read_text())["rows"]) == 6
    refused = subprocess.run([*command, "--nodes", "5"], capture_output=True, text=True)
    assert refused.returncode == 2 and "at least k+m = 12" in refused.stderr
