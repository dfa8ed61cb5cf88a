"""The QuorumError text: arithmetic that adds up, every failed node named or counted."""

from __future__ import annotations

import re

from client.write_path import KeyOutcome, WritePolicy, quorum_message

POLICY = WritePolicy(quorum=11, min_shards=10, hedge_delay_s=0.1, k=10)
VERSION = b"\x01" * 16


def _outcome(num_stored: int, num_failed: int, num_pending: int) -> KeyOutcome:
    nodes = [f"n{i:02d}" for i in range(num_stored + num_failed + num_pending)]
    stored, failed = nodes[:num_stored], nodes[num_stored : num_stored + num_failed]
    return KeyOutcome(b"k" * 16, VERSION, stored, failed, nodes[num_stored + num_failed :])


def _message(*outcomes: KeyOutcome, errors: dict[str, str] | None = None) -> str:
    return quorum_message(outcomes, len(outcomes), POLICY, errors or {})


def test_a_key_that_pending_puts_could_still_make_readable_says_how_many() -> None:
    text = _message(_outcome(8, 1, 3))
    assert "stored 8 of 12 shards" in text
    assert "not readable unless 2 of the 3 puts still in flight (n09, n10, n11) land" in text
    assert "failed on n08" in text


def test_no_impossible_arithmetic_when_too_few_puts_are_pending() -> None:
    for stored, failed, pending in [(4, 3, 5), (0, 12, 0), (9, 3, 0), (0, 0, 12)]:
        text = _message(_outcome(stored, failed, pending))
        for needed, of in re.findall(r"unless (\d+) of the (\d+) puts", text):
            assert int(needed) <= int(of), f"impossible arithmetic: {text}"
        assert f"stored {stored} of {stored + failed + pending} shards" in text
    assert "cannot make it readable" in _message(_outcome(4, 3, 5))
    assert "so it is not readable" in _message(_outcome(0, 12, 0))


def test_every_failed_node_is_named_or_the_rest_counted() -> None:
    errors = {f"n{i:02d}": f"UNAVAILABLE: node n{i:02d} down" for i in range(15)}
    text = _message(_outcome(0, 12, 0), errors=errors)
    assert "Failed nodes (15)" in text
    assert all(f"n{i:02d}: UNAVAILABLE" in text for i in range(12))
    assert "and 3 more failed nodes not named" in text
    few = _message(_outcome(9, 3, 0), errors={"n09": "a", "n10": "b", "n11": "c"})
    assert "n09: a; n10: b; n11: c." in few and "more failed nodes" not in few


def test_many_failed_keys_are_counted_beyond_the_named_ones() -> None:
    text = quorum_message([_outcome(5, 7, 0)] * 6, 9, POLICY, {})
    assert text.startswith("6 of 9 blocks are below min_write_shards 10")
    assert "and 2 more keys" in text
