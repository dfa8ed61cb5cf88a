"""Honest overload (issue #25): a read whose deadline passes says so, apart from a miss, and a
node that cannot answer in time sheds requests instead of queueing them past their deadlines.

Three hung nodes (SIGSTOP) leave every key of a 12-node cluster undecided until the deadline: a
timeout, reported as one (``on_timeout="raise"``, ``outcomes=True``, ``num_timeouts``); three
dead nodes give clean misses at once, which are no timeouts. A node slower than the clients'
deadlines refuses reads that would wait for it up front (RESOURCE_EXHAUSTED), and gets still hit.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from client import BatchResult, KVClient, Outcome, block_keys
from client.read_outcome import check_on_timeout, raise_timeouts
from deploy.local_cluster import LocalCluster
from kvstore.errors import DeadlineExceeded, InvalidArgument, Overloaded, Timeout
from kvstore.proto import kvstore_pb2 as pb

pytestmark = pytest.mark.timeout(600)


def test_outcomes_tell_hits_misses_and_timeouts_apart() -> None:
    result = BatchResult.of([b"x", None, None], [False, False, True])
    assert result.outcomes == [Outcome.HIT, Outcome.MISS, Outcome.TIMEOUT]
    assert result.timed_out == [2]
    with pytest.raises(Timeout, match="1 of 3 keys were not decided within 5 s") as raised:
        raise_timeouts([b"a" * 16, b"b" * 16, b"c" * 16], result, 5.0)
    assert raised.value.keys == [b"c" * 16] and raised.value.blocks == [b"x", None, None]
    assert isinstance(raised.value, DeadlineExceeded)
    raise_timeouts([b"a" * 16], BatchResult.of([None], [False]), 5.0)  # a miss: no error
    with pytest.raises(InvalidArgument, match="on_timeout"):
        check_on_timeout("ignore")


@pytest.mark.slow
async def test_hung_nodes_give_timeouts_dead_nodes_give_misses(tmp_path: Path) -> None:
    keys = block_keys(list(range(4 * 6)), 4, "timeouts", "salt")
    with LocalCluster.start(tmp_path / "c", 12, fsync=False, repair_bytes_per_s=0) as cluster:
        async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
            for key in keys:
                await kv.put(key, key * 100, timeout_s=60.0)
            hung = [cluster.procs[n].pid for n in ("n01", "n04", "n08")]
            for pid in hung:
                os.kill(pid, signal.SIGSTOP)
            try:
                started_s = time.monotonic()
                assert await kv.get(keys[0], timeout_s=2.0) is None, "a timeout reads as None"
                get_s = time.monotonic() - started_s
                assert kv.read_counters.num_timeouts == 1 and kv.read_counters.num_misses == 0
                with pytest.raises(Timeout) as raised:
                    await kv.get(keys[1], timeout_s=2.0, on_timeout="raise")
                assert raised.value.keys == [keys[1]]
                result = await kv.get_batch(keys[2:5], timeout_s=2.0, outcomes=True)
                assert result.outcomes == [Outcome.TIMEOUT] * 3
            finally:
                for pid in hung:
                    os.kill(pid, signal.SIGCONT)
            for node_id in ("n01", "n04", "n08"):
                cluster.kill_node(node_id)
            result = await kv.get_batch(keys[5:], timeout_s=30.0, outcomes=True)
            assert result.outcomes == [Outcome.MISS] * len(keys[5:]), (
                "three dead nodes must give clean misses, decided before the deadline"
            )
            assert kv.read_counters.num_timeouts == 5
    assert get_s < 2.0 + 1.5, f"a get with a 2 s deadline took {get_s:.1f} s"


def _shed(metrics_port: int, rpc: str) -> float:
    """How many ``rpc`` requests the node refused as overloaded (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    pattern = rf'kvstore_requests_total{{code="RESOURCE_EXHAUSTED",rpc="{rpc}"}} ([0-9.e+]+)'
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
async def test_a_node_slower_than_the_deadlines_sheds_reads_and_they_still_hit(
    tmp_path: Path,
) -> None:
    # A client's gets do not wait for a straggler (they finish at k answers and cancel the
    # rest), so the node's queue is made by reads that do wait: GetShards with 2 s deadlines
    # straight to it. Once it has seen one take its whole deadline it refuses the next ones
    # up front (one probe a second aside) rather than queue them past their deadlines.
    keys = block_keys(list(range(4 * 30)), 4, "shedding", "salt")
    with LocalCluster.start(tmp_path / "c", 12, fsync=False, repair_bytes_per_s=0) as cluster:
        async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
            for key in keys:
                await kv.put(key, key * 100, timeout_s=60.0)
            cluster.restart_node("n03", ["--inject-delay-ms", "3000"])  # 3 s per request
            for key in keys:  # 2 s deadlines: n03 can never answer one in time
                assert await kv.get(key, timeout_s=2.0) == key * 100, "a read missed"
            slow = kv.conns["n03"]
            request = pb.GetShardsRequest(tenant="acme", keys=keys[:1])
            with pytest.raises(DeadlineExceeded):  # admitted: it teaches n03 its service time
                await slow.call("GetShards", request, 2.0)
            waves = await asyncio.gather(
                *(slow.call("GetShards", request, 2.0) for _ in range(8)),
                return_exceptions=True,
            )
            shed = _shed(cluster.config.node("n03").metrics_port, "GetShards")
    assert shed > 0, "a node 3 s slow admitted every 2 s read: its queue outgrows the deadlines"
    refused = [w for w in waves if isinstance(w, Overloaded)]
    assert len(refused) == shed, f"the client did not see each refusal as Overloaded: {waves}"
