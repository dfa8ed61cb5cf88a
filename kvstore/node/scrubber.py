"""The node's scrub loop: the store's scrub steps (kvstore/store/scrub.py) run in the node's
executor, paced at ``NodeConfig.scrub_bytes_per_s``, until the node stops. A step that finds
the index damaged hands it to ``on_unusable`` (the node rebuilds the index from its segments,
kvstore/node/store_holder.py) and the scrub starts again on the rebuilt store."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor

from kvstore.config import NodeConfig
from kvstore.errors import IndexUnusable
from kvstore.store.scrub import STEP_S, ScrubStep, pause_s

log = logging.getLogger(__name__)

ERROR_PAUSE_S = 5.0


async def scrub_forever(
    step: Callable[[int], ScrubStep],
    node: NodeConfig,
    executor: Executor,
    on_unusable: Callable[[IndexUnusable], None] = lambda exc: None,
) -> None:
    """Run ``step(max_bytes)`` paced at ``node.scrub_bytes_per_s`` until cancelled (0: return).

    A damaged index goes to ``on_unusable``; other errors are logged, not fatal: the scrub
    retries after ``ERROR_PAUSE_S``.
    """
    if not node.scrub_bytes_per_s:
        return
    loop = asyncio.get_running_loop()
    step_bytes = max(1, int(node.scrub_bytes_per_s * STEP_S))
    pass_start_s = loop.time()
    while True:
        try:
            done = await loop.run_in_executor(executor, step, step_bytes)
        except IndexUnusable as exc:
            on_unusable(exc)
            await asyncio.sleep(ERROR_PAUSE_S)
            continue
        except Exception:
            log.exception("scrub step failed; retrying in %.0f s", ERROR_PAUSE_S)
            await asyncio.sleep(ERROR_PAUSE_S)
            continue
        await asyncio.sleep(pause_s(done, node, pass_start_s, loop.time()))
        if done.pass_done:
            pass_start_s = loop.time()
