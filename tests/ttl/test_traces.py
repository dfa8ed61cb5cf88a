"""Trace loaders: every format on tiny hand-made files, bad lines, chaining, streaming."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ttl import simloop
from ttl.errors import TraceFormatError
from ttl.policy import TrafficClasses
from ttl.simulator import ALL, SimConfig, simulate
from ttl.traces import LoadOptions, chain_identities, load_trace, parse_type_map


def _jsonl(path: Path, records: list[dict | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def _mooncake(t_ms: int, ids: list[int], **extra) -> dict:
    return {"timestamp": t_ms, "input_length": 4 * len(ids), "output_length": 2,
            "hash_ids": ids, **extra}  # fmt: skip


def _bailian(t_s: float, ids: list[int], type_: str = "text") -> dict:
    return {"chat_id": 1, "parent_chat_id": -1, "timestamp": t_s, "input_length": 16 * len(ids),
            "output_length": 3, "type": type_, "turn": 1, "hash_ids": ids}  # fmt: skip


def _hits(trace, ttl_s: float = math.inf) -> int:
    classes = TrafficClasses(dict.fromkeys(trace.class_names, ttl_s))
    return simulate(trace, SimConfig(classes)).by_class[ALL].hit_blocks


def test_mooncake_fields_units_and_classes(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "t.jsonl",
        [_mooncake(1500, [7, 8]), "", _mooncake(500, [7], **{"class": "agent"})],
    )
    trace = load_trace(path, "mooncake", LoadOptions(block_tokens=4))
    assert trace.time_s.tolist() == [0.5, 1.5], "ms -> s, and requests sorted by time"
    assert trace.class_names == ("agent", "chat"), "records without a class get --class"
    assert [trace.class_names[c] for c in trace.class_ids] == ["agent", "chat"]
    assert trace.input_tokens.tolist() == [4, 8] and trace.output_tokens.tolist() == [2, 2]
    assert trace.blocks(0).tolist() == [0] and trace.blocks(1).tolist() == [0, 1]
    assert (trace.num_blocks, trace.num_accesses, trace.block_tokens) == (2, 3, 4)


def test_mooncake_default_block_tokens_and_missing_output_length(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 3, "hash_ids": [1]}])
    trace = load_trace(path, "mooncake")
    assert trace.block_tokens == 512
    assert trace.output_tokens.tolist() == [0]


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ('{"timestamp": 1, "input_length": 4, "hash_ids": [1', "Expecting|delimiter"),
        ('{"timestamp": "x", "input_length": 4, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 1, "input_length": -4, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 1, "input_length": 4, "hash_ids": [1, null]}', "hash_ids"),
        ('{"timestamp": 1, "hash_ids": [1]}', "input_length"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, bad_line: str, reason: str) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [_mooncake(0, [1]), "", bad_line, _mooncake(9, [2])])
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:3: .*({reason})"):
        load_trace(path, "mooncake")


def test_skip_bad_lines_counts_them(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [_mooncake(0, [1]), "not json", _mooncake(9, [1]), "{}"])
    trace = load_trace(path, "mooncake", LoadOptions(skip_bad=True))
    assert trace.num_skipped == 2, "skipped lines must be counted, not dropped silently"
    assert trace.num_requests == 2


def test_small_chunks_stream_and_keep_line_numbers(tmp_path: Path) -> None:
    records = [_mooncake(t, [t % 5, t % 7]) for t in range(300)]
    path = _jsonl(tmp_path / "t.jsonl", [*records, '{"oops": 1}'])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:301:"):
        load_trace(path, "mooncake", LoadOptions(chunk_bytes=256))
    streamed = load_trace(path, "mooncake", LoadOptions(chunk_bytes=256, skip_bad=True))
    whole = load_trace(path, "mooncake", LoadOptions(skip_bad=True))
    assert streamed.num_requests == 300 and streamed.num_skipped == 1
    np.testing.assert_array_equal(streamed.block_ids, whole.block_ids)
    np.testing.assert_array_equal(streamed.time_s, whole.time_s)


def test_bailian_types_map_to_classes(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "b.jsonl", [_bailian(0, [1]), _bailian(1, [2], "search")])
    options = LoadOptions(type_to_class=parse_type_map(["search=agent"]))
    trace = load_trace(path, "bailian", options)
    assert trace.block_tokens == 16
    assert [trace.class_names[c] for c in trace.class_ids] == ["chat", "agent"]
    assert trace.time_s.tolist() == [0.0, 1.0], "bailian timestamps are seconds"


def test_bailian_ids_are_chained_mooncake_ids_are_not(tmp_path: Path) -> None:
    # Block 2 at position 0 is not block 2 after block 1 for per-block ids (Bailian), but an
    # id names its whole prefix in Mooncake traces.
    requests = [[1, 2], [2], [1, 3], [1, 3, 2]]
    bailian = _jsonl(tmp_path / "b.jsonl", [_bailian(t, ids) for t, ids in enumerate(requests)])
    mooncake = _jsonl(tmp_path / "m.jsonl", [_mooncake(t, ids) for t, ids in enumerate(requests)])
    assert _hits(load_trace(bailian, "bailian")) == 1 + 2, "per-block ids need chaining"
    full_blocks = LoadOptions(block_tokens=4)  # _mooncake's input covers 4 tokens per id
    assert _hits(load_trace(mooncake, "mooncake", full_blocks)) == 1 + 1 + 3, (
        "chained ids are taken as-is"
    )
    assert load_trace(bailian, "bailian").num_blocks == 5, "1, 1-2, 2, 1-3, 1-3-2"


def test_partial_tail_blocks_drop_by_default_and_count_on_request(tmp_path: Path) -> None:
    # 10 tokens in blocks of 4: two full blocks and a partial one of 2 tokens, as Mooncake's
    # hash ids name it. The store caches full blocks only.
    records = [{"timestamp": t, "input_length": 10, "hash_ids": [1, 2, 3]} for t in (0, 1)]
    path = _jsonl(tmp_path / "p.jsonl", records)
    dropped = load_trace(path, "mooncake", LoadOptions(block_tokens=4))
    counted = load_trace(path, "mooncake", LoadOptions(block_tokens=4, partial_blocks="count"))
    assert dropped.blocks(0).tolist() == [0, 1] and dropped.num_blocks == 2, (
        "drop must cut the partial tail block (the store never caches it)"
    )
    assert counted.blocks(0).tolist() == [0, 1, 2] and counted.num_blocks == 3
    assert dropped.hashed_tokens.tolist() == counted.hashed_tokens.tolist() == [10, 10]
    classes = TrafficClasses({"chat": math.inf})
    drop_stats = simulate(dropped, SimConfig(classes)).by_class[ALL]
    count_stats = simulate(counted, SimConfig(classes)).by_class[ALL]
    assert (drop_stats.tokens_saved, drop_stats.tokens) == (8, 20), "the tail is recomputed"
    assert (count_stats.tokens_saved, count_stats.tokens) == (10, 20)
    with pytest.raises(ValueError, match="drop or count"):
        LoadOptions(partial_blocks="keep")


def test_chain_identities_name_each_prefix_once(monkeypatch) -> None:
    offsets = np.array([0, 3, 5, 5, 8, 10])
    ids = np.array([1, 2, 3, 1, 2, 2, 2, 2, 1, 2])
    roots = np.array([0, 0, 0, 0, 7])
    compiled = chain_identities(offsets, ids, roots).tolist()
    monkeypatch.setattr(simloop, "NATIVE", False)
    chained = chain_identities(offsets, ids, roots).tolist()
    assert compiled == chained, "the C chain and the numpy chain must give the same identities"
    # request 1 repeats the prefix of request 0; request 3 is [2, 2, 2]: three new blocks;
    # request 4 has request 0's ids under another root (another session file): new blocks
    assert chained[3:5] == chained[0:2]
    assert len(set(chained[5:8])) == 3
    assert len(set(chained)) == 8


def _session(tmp_path: Path, name: str, doc: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_sessions_nested_subagents_and_local_ids(tmp_path: Path) -> None:
    folder = tmp_path / "sessions"
    folder.mkdir()
    _session(folder, "a.json", {
        "block_size": 8, "t": 100.0, "class": "agent",
        "requests": [
            {"t": 0, "in": 16, "out": 5, "hash_ids": [0, 1]},
            {"t": 10, "requests": [{"t": 2.5, "in": 8, "out": 1, "hash_ids": [0]}]},
            {"t": 20, "in": 24, "out": 5, "hash_ids": [0, 1, 2], "class": "chat"},
        ],
    })  # fmt: skip
    _session(folder, "b.json", {"block_size": 8, "requests": [
        {"t": 0, "in": 16, "out": 5, "hash_ids": [0, 1]}]})  # fmt: skip
    trace = load_trace(folder, "sessions")
    assert trace.time_s.tolist() == [0.0, 100.0, 112.5, 120.0], "sub-agent t is relative"
    assert [trace.class_names[c] for c in trace.class_ids] == ["chat", "agent", "agent", "chat"]
    assert trace.block_tokens == 8
    assert trace.blocks(0).tolist() != trace.blocks(1).tolist(), "ids are local to a file"
    assert _hits(trace) == 1 + 2, "sub-agent hits the parent's block 0; last request 2 of 3"


def test_sessions_errors_name_the_file_and_field(tmp_path: Path) -> None:
    subagent = {"t": 1, "requests": [{"t": 0, "in": "x"}]}
    first = {"t": 0, "in": 16, "hash_ids": [0]}
    bad = _session(tmp_path, "s.json", {"block_size": 8, "requests": [first, subagent]})
    with pytest.raises(TraceFormatError, match=r"s\.json: requests\[1\]\.requests\[0\]: 'in'"):
        load_trace(bad, "sessions")
    broken = tmp_path / "broken.json"
    broken.write_text('{"block_size": 8,\n "requests": [}')
    with pytest.raises(TraceFormatError, match=r"broken\.json:2:"):
        load_trace(broken, "sessions")


def test_sessions_block_size_conflict(tmp_path: Path) -> None:
    path = _session(tmp_path, "s.json", {"block_size": 8, "requests": []})
    with pytest.raises(TraceFormatError, match="block_size=8 but --block-tokens is 16"):
        load_trace(path, "sessions", LoadOptions(block_tokens=16))


def test_time_scale_stretches_gaps(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [_mooncake(1000, [1]), _mooncake(3000, [1])])
    trace = load_trace(path, "mooncake").with_time_scale(10.0)
    assert trace.time_s.tolist() == [1.0, 21.0]


def test_misuse_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(tmp_path, "csv")
    with pytest.raises(TraceFormatError, match="only --format sessions reads a folder"):
        load_trace(tmp_path, "mooncake")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl", "mooncake")
    with pytest.raises(ValueError, match="TYPE=CLASS"):
        parse_type_map(["text"])


@pytest.mark.parametrize(
    "ids", [[1, 2.5], [1, "2"], [[1], [2]], [1, [2]], [2**64], [None], [True, 2], [1, False]]
)
def test_session_hash_ids_must_be_64_bit_integers(tmp_path: Path, ids: list) -> None:
    path = _session(tmp_path, "s.json", {"block_size": 4, "requests": [
        {"t": 0, "in": 8, "hash_ids": ids}]})  # fmt: skip
    with pytest.raises(TraceFormatError, match="64-bit integers"):
        load_trace(path, "sessions")
