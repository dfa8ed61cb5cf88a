"""The node's UCX session table (kvstore/node/ucx_sessions.py): pure code, a fake clock."""

from __future__ import annotations

from kvstore.auth import OPEN_PRINCIPAL
from kvstore.node.ucx_sessions import UcxSessions


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_sessions_are_found_until_they_expire() -> None:
    clock = Clock()
    sessions = UcxSessions(ttl_s=10.0, clock=clock)
    first_id, first = sessions.open("token-a")
    clock.now_s = 5.0
    second_id, second = sessions.open(OPEN_PRINCIPAL)
    assert first_id != second_id and first.key != second.key and len(first.key) == 32
    assert sessions.find(first_id) == first and sessions.find(second_id) == second
    assert sessions.find(b"x" * 16) is None
    clock.now_s = 10.0
    assert sessions.find(first_id) is None, "an expired session was still found"
    assert sessions.find(second_id) == second and len(sessions) == 1, "expired not forgotten"


def test_a_client_opening_sessions_in_a_loop_costs_bounded_memory() -> None:
    sessions = UcxSessions(max_sessions=3, clock=Clock())
    ids = [sessions.open(f"token-{i}")[0] for i in range(5)]
    assert len(sessions) == 3
    assert [sessions.find(i) is not None for i in ids] == [False, False, True, True, True]
