"""The Redis baseline of ``kvstore bench storage``: redis-py asyncio against a redis-server
this bench starts (bench/common.py), persistence off or ``appendfsync always``."""

from __future__ import annotations

import contextlib
import logging

from bench.common import redis_server
from bench.storage.targets import BaselineError

log = logging.getLogger(__name__)


class RedisTarget:
    """redis-py asyncio against a redis-server: "redis" (persistence off), or "redis/fsync"
    (``appendfsync always``, measured on PUTs only: reads do not touch the file)."""

    def __init__(self, port: int, pid: int, *, appendfsync_always: bool = False) -> None:
        import redis.asyncio

        self.redis = redis.asyncio.Redis(host="127.0.0.1", port=port, max_connections=256)
        self._pid = pid
        self.name = "redis/fsync" if appendfsync_always else "redis"
        self.fsync = "always" if appendfsync_always else "off"
        self.ops = ("put",) if appendfsync_always else ("put", "get")
        self._num_calls = 0

    async def put(self, keys: list[bytes], blocks: list[bytes]) -> None:
        """SET or MSET; a Redis error (a timeout on a loaded machine) is a failed PUT, as
        kvstore's errors are."""
        from redis.exceptions import RedisError

        self._num_calls += 1
        try:
            if len(keys) == 1:
                await self.redis.set(keys[0], blocks[0])
            else:
                await self.redis.mset(dict(zip(keys, blocks, strict=True)))
        except RedisError as exc:
            raise BaselineError(f"{self.name}: {exc}") from exc

    def buffers(self, count: int, block_bytes: int) -> list[memoryview]:
        """Unused: redis-py returns new bytes per value."""
        return [memoryview(bytearray(block_bytes)) for _ in range(count)]

    async def get_into(self, keys: list[bytes], outs: list[memoryview]) -> bool:
        """GET or MGET: True if every key was found; a Redis error counts as a failed GET."""
        from redis.exceptions import RedisError

        self._num_calls += 1
        try:
            if len(keys) == 1:
                return await self.redis.get(keys[0]) is not None
            return all(value is not None for value in await self.redis.mget(keys))
        except RedisError as exc:
            log.warning("%s get failed: %s", self.name, exc)
            return False

    def server_pids(self) -> list[int]:
        return [self._pid]

    def transport_counts(self, op: str) -> dict[str, int]:
        return {"resp/tcp": self._num_calls}

    async def close(self) -> None:
        await self.redis.aclose()  # the server, this run's own, is stopped with its data


def redis_target(stack: contextlib.ExitStack, appendfsync_always: bool) -> RedisTarget:
    """A redis-server started for the run (stopped by ``stack``) and its client."""
    port = stack.enter_context(redis_server(appendfsync_always=appendfsync_always))
    return RedisTarget(port, redis_pid(port), appendfsync_always=appendfsync_always)


def redis_pid(port: int) -> int:
    import redis

    return int(redis.Redis(host="127.0.0.1", port=port).info("server")["process_id"])


def redis_parser() -> str:
    """Which reply parser redis-py uses: hiredis (C) when it is installed, else Python's."""
    from redis.utils import HIREDIS_AVAILABLE

    return "hiredis" if HIREDIS_AVAILABLE else "python"
