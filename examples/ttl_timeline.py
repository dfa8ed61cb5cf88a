"""TTL worked example: agent and chat blocks on a time-scaled cluster (1 real s = 1 virtual day).

kvstore cluster up --nodes 12 --dir /tmp/kv-ttl --time-scale 86400
python examples/ttl_timeline.py /tmp/kv-ttl/cluster.toml
kvstore cluster status --dir /tmp/kv-ttl
kvstore cluster down --dir /tmp/kv-ttl
"""

from __future__ import annotations

import asyncio
import os
import sys

from client import KVClient

DAY_S = 86_400.0


async def main(cluster_toml: str) -> None:
    async with KVClient.connect(cluster_toml, tenant="acme") as kv:
        clock = kv.clock
        start_s = clock.now()

        def day() -> float:
            return (clock.now() - start_s) / DAY_S

        async def sleep_until(target_day: float) -> None:
            await asyncio.sleep(max(0.0, (target_day - day()) * DAY_S / kv.config.ttl.time_scale))

        agent, chat, chat_read = os.urandom(16), os.urandom(16), os.urandom(16)
        await kv.put(agent, b"agent block" * 1000, traffic_class="agent")
        await kv.put(chat, b"chat block" * 1000, traffic_class="chat")
        await kv.put(chat_read, b"chat block, read on day 5" * 400, traffic_class="chat")
        print(f"day {day():4.1f}: put agent block A (TTL 3d), chat blocks C1 and C2 (TTL 7d)")
        await sleep_until(2.5)
        print(
            f"day {day():4.1f}: contains(A) = {(await kv.contains([agent]))[0]} "
            "(existence checks do not refresh the TTL)"
        )
        await sleep_until(3.2)
        print(
            f"day {day():4.1f}: get(A) -> {await kv.get(agent)!r:5}  "
            f"contains(C1) = {(await kv.contains([chat]))[0]}"
        )
        await sleep_until(5.0)
        print(
            f"day {day():4.1f}: get(C2) hit = {await kv.get(chat_read) is not None} "
            "(a read hit restarts its TTL: C2 now lives until day 12)"
        )
        await sleep_until(7.2)
        flags = await kv.contains([chat, chat_read])
        print(f"day {day():4.1f}: contains(C1) = {flags[0]}, contains(C2) = {flags[1]}")
        await sleep_until(12.2)
        print(f"day {day():4.1f}: contains(C2) = {(await kv.contains([chat_read]))[0]}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
