"""``kvstore bench index``: lmdb bytes per shard entry, and the planner's default stays near."""

from __future__ import annotations

import json
from pathlib import Path

from kvstore.cli.commands import main
from ttl.plan import DEFAULT_INDEX_BYTES_PER_SHARD


def test_index_bytes_per_entry_and_the_planner_default(tmp_path: Path, capsys) -> None:
    out = tmp_path / "made" / "index.json"
    assert main(["bench", "index", "--entries", "20000", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["entries"] == 20_000
    assert 300 < result["tree_bytes_per_entry"] < DEFAULT_INDEX_BYTES_PER_SHARD, (
        "an index entry outgrew the planner's default: measure again with kvstore bench index "
        "(200000 entries) and update ttl.plan.DEFAULT_INDEX_BYTES_PER_SHARD"
    )
    assert result["file_bytes_per_entry"] >= result["tree_bytes_per_entry"]
    assert "bytes each" in capsys.readouterr().out
