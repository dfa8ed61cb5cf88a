"""``kvstore bench map-moves``: the figures it prints are the ones the note quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.map_moves_bench import measure_moves, measure_weight_moves, measure_weighted_changes


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
    limits_only, handed_over, groups_equal = (row["ratio_to_ideal"] for row in rows)
    assert handed_over < 1.5, f"moving to weights moved {handed_over}x the ideal"
    assert limits_only > 3
    # Slots alone move less than the full change, and leave the small nodes a little over.
    assert groups_equal < 1.0 and 1.0 < rows[2]["worst_share_over_weight"] < 1.15, rows[2]
    assert rows[1]["worst_share_over_weight"] < 1.01, rows[1]


def test_changes_of_a_weighted_map_move_only_their_slots() -> None:
    rows = {row["change"]: row["ratio_to_ideal"] for row in measure_weighted_changes(24, 5_000, 1)}
    for change in ("join", "drain", "out"):
        assert rows[f"weighted map: {change}, weights kept"] == 1.0, rows
        assert rows[f"weighted map: {change}, weights refitted"] > 3, rows


def test_cli_writes_json_and_refuses_too_few_nodes(tmp_path: Path) -> None:
    out = tmp_path / "moves.json"
    command = [sys.executable, "-m", "kvstore.cli", "bench", "map-moves", "--keys", "2000"]
    done = subprocess.run([*command, "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0 and "join by regenerating groups" in done.stdout, done.stderr
    assert len(json.loads(out.read_text())["rows"]) == 13
    refused = subprocess.run([*command, "--nodes", "5"], capture_output=True, text=True)
    assert refused.returncode == 2 and "at least k+m = 12" in refused.stderr
