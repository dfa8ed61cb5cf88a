"""The node's upkeep loop: the store's periodic work (expiry, refresh persistence, capacity
checks, queued erases) and the tenants' retention caps re-read from the credentials file, run
in the node's executor a few times per expiry window until the node stops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from concurrent.futures import Executor

from kvstore.auth import Authenticator
from kvstore.errors import IndexUnusable
from kvstore.node.store_holder import StoreHolder
from kvstore.store.shard_store import ShardStore

log = logging.getLogger(__name__)


def upkeep_period_s(time_scale: float, expiry_window_s: float) -> float:
    """Real seconds between upkeep ticks: a quarter window, at least once a second, >= 50 ms."""
    return min(1.0, max(0.05, expiry_window_s / 4 / time_scale))


async def upkeep_forever(
    holder: StoreHolder, auth: Authenticator, period_s: float, executor: Executor
) -> None:
    """Retention caps from the (re-read) credentials file, expiry, refresh persistence,
    capacity checks and queued erases, forever; errors are logged, not fatal (an unusable
    index is rebuilt)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(period_s)
        store = holder.store
        if store is None:
            continue
        try:
            caps = auth.current().tenant_to_max_ttl_s
            await loop.run_in_executor(executor, _tick, store, caps)
        except IndexUnusable as exc:
            holder.rebuild_after(exc)
        except Exception:
            log.exception("upkeep tick failed; retrying next period")


def _tick(store: ShardStore, caps: Mapping[str, Mapping[str, float]]) -> None:
    """One upkeep tick in one executor hop (two hops a second were a visible share of an
    idle node's CPU)."""
    store.set_retention_caps(caps)
    store.tick()
