"""Why a fetch stopped where it did: the first block that did not arrive, and whether a
deadline or a miss ended it (engine_adapter/connector.py ``_leading_run``)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from client.block_reads import Landing
from engine_adapter.connector import _leading_run


async def _done(landing: Landing) -> Landing:
    return landing


async def _never() -> Landing:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _chunks(*landings: Landing | None) -> list[asyncio.Task[Landing]]:
    tasks = [asyncio.create_task(_never() if x is None else _done(x)) for x in landings]
    await asyncio.sleep(0)
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return tasks


WHOLE = Landing([True, True], [False, False], [False, False])


async def test_a_block_cut_off_by_the_deadline_reads_as_the_deadline():
    cut = Landing([True, False], [False, False], [False, True])
    assert _leading_run(await _chunks(WHOLE, cut), [0, 2]) == (3, "deadline")


async def test_a_block_the_store_lacks_reads_as_a_miss_even_if_later_chunks_were_cut():
    missing = Landing([False, True], [False, False], [False, False])
    assert _leading_run(await _chunks(WHOLE, missing, None), [0, 2, 4]) == (2, "miss")


async def test_a_chunk_cancelled_at_the_deadline_ends_the_run_at_its_start():
    assert _leading_run(await _chunks(WHOLE, None), [0, 2]) == (2, "deadline")
    assert _leading_run(await _chunks(WHOLE, WHOLE), [0, 2]) == (4, None)
    assert Landing.nothing(3, timed_out=True).timed_out == [True] * 3
