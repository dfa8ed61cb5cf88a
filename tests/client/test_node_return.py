"""A node that comes back is used at once (issue 38), on a real 12-node local cluster.

n04 is down and n00 is killed while puts go on; n00 is restarted and serves, and n11 is killed
at once. From then on every put needs n00 (10 of 12 nodes up, 10 shards needed): the client's
channel to n00 is still in gRPC's reconnect backoff, and puts that gave up after 3 tries at
10/40 ms failed with QuorumError. Puts now redial a node they cannot reach and retry while a
key waits on it, so none fails. The test waits on conditions (puts done after each step),
never on the clock, so a loaded machine only makes it slower.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(300)

PUTS_PER_STEP = 40  # puts that must complete after each fault before the next
NUM_LOOPS = 4  # concurrent put loops


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster.start(tmp_path, num_nodes=12, fsync=False, scrub_bytes_per_s=0) as c:
        yield c


class _Writer:
    """Puts one block after another until stopped; records each outcome."""

    def __init__(self, kv: KVClient) -> None:
        self.kv = kv
        self.acked: dict[bytes, bytes] = {}
        self.failures: list[str] = []
        self.num_done = 0
        self._stop = False
        self._progress = asyncio.Condition()

    async def run(self, num_loops: int) -> None:
        """``num_loops`` put loops at once: more puts land in the moment n00 is back."""
        keys = block_keys(list(range(4 * 100_000)), 4, "node-return", "salt")
        await asyncio.gather(*(self._loop(keys[i::num_loops]) for i in range(num_loops)))

    async def _loop(self, keys: list[bytes]) -> None:
        for key in keys:
            if self._stop:
                return
            block = os.urandom(32 << 10)
            try:
                await self.kv.put(key, block)
                self.acked[key] = block
            except Exception as exc:  # any failure is what this test counts
                self.failures.append(f"{type(exc).__name__}: {exc}")
            async with self._progress:
                self.num_done += 1
                self._progress.notify_all()

    async def wait_puts(self, num_puts: int) -> list[bytes]:
        """Wait until ``num_puts`` more puts completed; the keys acked meanwhile."""
        start, before = self.num_done, set(self.acked)
        async with self._progress:
            await self._progress.wait_for(lambda: self.num_done >= start + num_puts)
        return [k for k in self.acked if k not in before]

    def stop(self) -> None:
        self._stop = True


async def test_a_restarted_node_takes_puts_at_once_with_two_others_down(
    cluster: LocalCluster,
) -> None:
    async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
        writer = _Writer(kv)
        task = asyncio.create_task(writer.run(NUM_LOOPS))
        try:
            await writer.wait_puts(PUTS_PER_STEP)
            await asyncio.to_thread(cluster.kill_node, "n04")
            await writer.wait_puts(PUTS_PER_STEP)
            await asyncio.to_thread(cluster.kill_node, "n00")
            await writer.wait_puts(PUTS_PER_STEP)  # the client's channel to n00 now fails
            await asyncio.to_thread(cluster.restart_node, "n00")  # returns once it serves
            await asyncio.to_thread(cluster.kill_node, "n11")
            after = await writer.wait_puts(4 * PUTS_PER_STEP)  # each needs n00's shard
        finally:
            writer.stop()
            await task
        assert not writer.failures, (
            f"{len(writer.failures)} of {writer.num_done} puts failed with 2 nodes down and "
            f"n00 back (a put did not wait for n00's connection): {writer.failures[:3]}"
        )
        assert kv.conns["n00"].num_redials > 0, "n00 was never dialed afresh"
        got = await kv.get_batch(after)
        wrong = [k for k, value in zip(after, got, strict=True) if value != writer.acked[k]]
        assert not wrong, f"{len(wrong)} of {len(after)} puts acked with n00 back read wrong"
