"""Transport assembly (client/transports.py): a transport the caller forces must reach a node."""

from __future__ import annotations

import pytest

from client.transports import _require_one_usable
from kvstore.errors import Unavailable


class _Reader:
    """A reader whose node answers Health (or not) once asked."""

    def __init__(self, answers: bool) -> None:
        self.answers, self.asked_s = answers, None

    async def observe(self, timeout_s: float) -> None:
        self.asked_s = timeout_s

    def usable(self) -> bool:
        return self.asked_s is not None and self.answers


async def test_a_forced_transport_needs_one_node_that_answers() -> None:
    readers = [_Reader(False), _Reader(True)]
    await _require_one_usable(readers, 5.0, "refused")  # type: ignore[arg-type]
    assert [r.asked_s for r in readers] == [5.0, 5.0], "every node is asked, with the timeout"


async def test_a_forced_transport_no_node_answers_is_unavailable_with_the_reason() -> None:
    with pytest.raises(Unavailable, match="no node offered"):
        await _require_one_usable([_Reader(False)], 1.0, "no node offered")  # type: ignore[arg-type]
