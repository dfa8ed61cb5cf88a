"""A Hypothesis state machine for the hedged read's tally (client/batch_read.py, whose per-key
counting is client/shard_tally.py and whose first wave is client/read_plan.py).

One key of one 12-node group (k=10, m=2) is read through the real ``BatchRead`` over in-memory
nodes: no processes, no sockets, and an event loop whose clock only moves when a rule moves
it, so the hedge delay and the deadline are steps of the machine. Each node behaves one way
for the whole read: it answers its shard of the block (``good``), a shard of the same key
written by another writer (``other``: a second valid version), a shard whose payload fails
its checksum (``corrupt``), a CORRUPT or MISS entry, an RPC error (``fail``), or never
(``silent``). Rules answer one asked node at a time, in any order, or move the clock.

The read verifies in one pass: it counts a shard by its header and checks only the block's
checksum; a shard whose payload is corrupt (its header intact) counts until its block fails,
then the shards' own checksums find it and the block is decoded again without it. So the
model counts two tallies: what the client counts (``counted``: a corrupt shard counts for the
version its header names) and what is valid (``valid``).

What must hold after every step, whatever the order (the model counts on its own, from what
it handed the client):

* a finished read returns None or exactly one version's bytes, and only a version of which
  at least k valid shards with distinct indexes reached the client: never a mix of versions,
  never a corrupt shard's bytes;
* a miss only when the client never counted k shards of one version, or a corrupt shard
  was among them (then the block failed its check: counted as a recheck); a decode fails
  only when a corrupt shard reached the client;
* k counted shards of one version end the read (after the short grace it gives data
  shards, batch_read.DATA_GRACE);
* an unfinished read can still complete: the best counted version's shards plus the
  requests still out reach k. So a read that cannot get k shards reports a miss as soon as it
  knows, and no read outlives its deadline;
* the reserve node (the 12th, or the node the plan put in reserve as slow) is asked exactly
  when the first wave became hopeless or the hedge delay passed undecided, never before.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from client.batch_read import DATA_GRACE, BatchRead, ReadCounters
from client.landing import NodeAnswer, Wanted
from client.node_health import NodeHealth
from erasure.codec import make_codec
from erasure.config import CodecConfig
from erasure.shard import HEADER_BYTES
from kvstore.errors import Unavailable
from kvstore.wire import batch_answer

K, M = 10, 2
NUM_NODES = K + M
FANOUT = 11
HEDGE_DELAY_S = 0.05
TIMEOUT_S = 5.0  # ClientConfig.timeout_s
MIN_GRACE_S = 0.0005  # batch_read._wait_for_data's floor
CODEC = make_codec(CodecConfig(k=K, m=M, backend="isal"))
KEY = bytes(range(16))
BLOCK_BYTES = 1000
BEHAVIOURS = ["good", "other", "corrupt", "corrupt_status", "miss", "fail", "silent"]
VALID = {"good": "a", "other": "b"}  # behaviour -> the version its shard belongs to
COUNTED = {**VALID, "corrupt": "a"}  # behaviour -> the version its header names
# Mostly short steps, so the deadline passes only in some cases.
DELAYS_S = [0.001, 0.001, 0.01, 0.01, 0.03, HEDGE_DELAY_S, 0.2, 1.0]


class ManualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time moves only when the test says: timers fire at ``advance``."""

    def __init__(self) -> None:
        super().__init__()
        self.now_s = 0.0

    def time(self) -> float:
        return self.now_s


class FakeConn:
    """What BatchRead asks of a NodeConn: an id, health, suspicion."""

    def __init__(self, node_id: str, health: NodeHealth) -> None:
        self.node_id = node_id
        self.health = health

    def is_suspect(self) -> bool:
        return False


class FakeNode:
    """A NodeReader whose answers the state machine hands over one request at a time."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.requests: list[tuple[Wanted, asyncio.Future[NodeAnswer]]] = []

    async def read_batch(
        self,
        keys: list[bytes],
        wanted: Wanted,
        outs: Sequence[memoryview | None],
        timeout_s: float,
    ) -> NodeAnswer:
        future: asyncio.Future[NodeAnswer] = asyncio.get_running_loop().create_future()
        self.requests.append((wanted, future))
        return await future


def _answer(wanted: Wanted, behaviour: str, shards: dict[str, list[bytes]]) -> NodeAnswer:
    """The node's answer table and payloads for one request, as a transport lands them."""
    entries, payloads = [], []
    for key_index, index in enumerate(wanted.shard_indexes):
        if behaviour in ("good", "other", "corrupt"):
            shard = shards[VALID.get(behaviour, "a")][index]
            payload = bytearray(shard[HEADER_BYTES:])
            if behaviour == "corrupt":
                payload[len(payload) // 2] ^= 0x5A  # fails the shard checksum
            entries.append(
                batch_answer.Entry(key_index, batch_answer.HIT, shard[:HEADER_BYTES], len(payload))
            )
            payloads.append(memoryview(bytes(payload)))
        else:
            status = batch_answer.CORRUPT if behaviour == "corrupt_status" else batch_answer.MISS
            entries.append(batch_answer.Entry(key_index, status, b"", 0))
    table = batch_answer.encode_table(entries)
    decoded, _ = batch_answer.decode_table(table, len(wanted.positions))
    return NodeAnswer(decoded, payloads, [False] * len(payloads))


class ReadTally(RuleBasedStateMachine):
    """One hedged read of one key against nodes that answer late, wrong, or not at all."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = ManualClockLoop()
        self.counters = ReadCounters()

    def teardown(self) -> None:
        """Label the case for ``--hypothesis-show-statistics``, then stop the read."""
        if self.task.done():
            (block,) = self.task.result()
            outcome = "miss" if block is None else "hit"
        else:
            outcome = "unfinished"
        reserve = "reserve asked" if self.reserve_node in self._asked() else "no reserve"
        event(f"{outcome}, {reserve}")
        if not self.task.done():
            self.task.cancel()
            self._settle()
        self.loop.close()

    @initialize(
        # Most nodes hold one version (usually a; b when its writer reached most nodes), a
        # few behave otherwise: so reads hit, miss and hedge in about equal measure.
        usual=st.sampled_from(["good", "good", "good", "other"]),
        unusual=st.dictionaries(
            st.integers(0, NUM_NODES - 1), st.sampled_from(BEHAVIOURS), max_size=6
        ),
        slow_node=st.one_of(st.none(), st.integers(0, NUM_NODES - 1)),
        seed=st.integers(0, 2**32 - 1),
    )
    def start_read(
        self, usual: str, unusual: dict[int, str], slow_node: int | None, seed: int
    ) -> None:
        behaviours = [unusual.get(i, usual) for i in range(NUM_NODES)]
        rng = random.Random(seed)
        self.blocks = {v: rng.randbytes(BLOCK_BYTES) for v in ("a", "b")}
        self.shards = {v: CODEC.encode(block) for v, block in self.blocks.items()}
        self.behaviours = behaviours
        # A node the client already found slow goes to the reserve; else the 12th does.
        self.reserve_node = NUM_NODES - 1 if slow_node is None else slow_node
        healths = [NodeHealth(late_score=0.9 if i == slow_node else 0.0) for i in range(NUM_NODES)]
        self.nodes = [FakeNode(f"n{i:02d}") for i in range(NUM_NODES)]
        conns = [FakeConn(f"n{i:02d}", healths[i]) for i in range(NUM_NODES)]
        read = BatchRead(
            CODEC,
            conns,  # type: ignore[arg-type]
            self.nodes,
            [list(range(NUM_NODES))],
            FANOUT,
            1 << 20,
            self.counters,
            HEDGE_DELAY_S,
        )
        self.answered: set[int] = set()  # nodes whose request got its answer (or error)
        self.version_to_indexes: dict[str, set[int]] = {"a": set(), "b": set()}  # valid
        self.counted: dict[str, set[int]] = {"a": set(), "b": set()}  # as the client counts
        self.corrupt_seen = False  # a corrupt shard reached the client
        self.hopeless_seen = False  # the first wave could no longer give k shards
        self.hedge_passed_undecided = False
        self.complete_at_s: float | None = None  # when some version first had k shards
        self.task = self.loop.create_task(read.run([KEY], [0], [None], TIMEOUT_S))
        self._settle()
        self._observe()

    def _settle(self) -> None:
        """Run the loop until nothing is ready (the clock stands still meanwhile)."""
        for _ in range(200):
            self.loop.run_until_complete(asyncio.sleep(0))
            if not self.loop._ready:  # type: ignore[attr-defined]
                return
        raise AssertionError("the read never settles: a busy loop in BatchRead")

    # What the model sees of the client's requests.
    def _asked(self) -> set[int]:
        return {i for i, node in enumerate(self.nodes) if node.requests}

    def _outstanding(self) -> list[int]:
        return [
            i
            for i, node in enumerate(self.nodes)
            if node.requests and i not in self.answered and not node.requests[-1][1].done()
        ]

    def _best_count(self) -> int:
        """Shards of the best version as the client counts them (corrupt ones included)."""
        return max(len(indexes) for indexes in self.counted.values())

    def _best_valid(self) -> int:
        return max(len(indexes) for indexes in self.version_to_indexes.values())

    def _decided(self) -> bool:
        return self.complete_at_s is not None or self.task.done()

    def _observe(self) -> None:
        """Note what a step made true, before the invariants judge it."""
        if self.complete_at_s is None and self._best_count() >= K:
            self.complete_at_s = self.loop.now_s

    @rule(choices=st.lists(st.integers(0, NUM_NODES - 1), min_size=1, max_size=3))
    def answer(self, choices: list[int]) -> None:
        """Asked nodes that are not silent answer, one to three in the same turn, in any
        order (late nodes come last)."""
        for choice in choices:
            ready = [i for i in self._outstanding() if self.behaviours[i] != "silent"]
            if self.task.done() or not ready:
                break
            self._answer_one(ready[choice % len(ready)])
        # Judged as the client will judge it, before it reacts: can the first wave still
        # give k shards of one version?
        first_wave = [i for i in self._outstanding() if i != self.reserve_node]
        if self.reserve_node not in self._asked() and self._best_count() + len(first_wave) < K:
            self.hopeless_seen = True
        self._settle()
        self._observe()

    def _answer_one(self, node: int) -> None:
        wanted, future = self.nodes[node].requests[-1]
        behaviour = self.behaviours[node]
        self.answered.add(node)
        if behaviour == "fail":
            future.set_exception(Unavailable(f"node {node} is down"))
        else:
            future.set_result(_answer(wanted, behaviour, self.shards))
        if behaviour in VALID:
            self.version_to_indexes[VALID[behaviour]].update(wanted.shard_indexes)
        if behaviour == "corrupt":
            self.corrupt_seen = True
        if behaviour in COUNTED and self.complete_at_s is None:
            self.counted[COUNTED[behaviour]].update(wanted.shard_indexes)

    @rule(delay_s=st.sampled_from(DELAYS_S))
    def advance_clock(self, delay_s: float) -> None:
        """Time passes: the hedge delay, a data grace, or the deadline may go by."""
        if self.task.done():
            return
        undecided = not self._decided()
        self.loop.now_s += delay_s
        if undecided and self.loop.now_s >= HEDGE_DELAY_S:
            self.hedge_passed_undecided = True
        self._settle()
        self._observe()

    @invariant()
    def result_is_one_version_with_k_shards(self) -> None:
        if not self.task.done():
            return
        (block,) = self.task.result()
        assert self.counters.num_decode_failures == 0 or self.corrupt_seen, (
            "a complete tally failed to decode though no shard was corrupt: it mixed versions"
        )
        if block is None:
            assert self._best_count() < K or self.counters.num_rechecks, (
                f"{self._best_count()} shards of one version were counted, none failed its "
                "block check, yet a miss"
            )
            return
        matches = [v for v, data in self.blocks.items() if bytes(block) == data]
        assert matches, "the read returned bytes that are no version's block (mixed/corrupt)"
        assert len(self.version_to_indexes[matches[0]]) >= K, (
            f"version {matches[0]} returned from only "
            f"{len(self.version_to_indexes[matches[0]])} valid shards: the tally counted "
            "another version's or a corrupt shard"
        )

    @invariant()
    def k_valid_shards_end_the_read(self) -> None:
        if self.complete_at_s is None or self.task.done():
            return
        grace_s = max(self.complete_at_s * DATA_GRACE, MIN_GRACE_S)
        assert self.loop.now_s <= self.complete_at_s + grace_s + 1e-9, (
            "k valid shards of one version arrived and the data grace passed, but the read "
            "still waits: the tally does not see the version complete"
        )
        owed = [i for i in self._outstanding() if i < K]
        assert owed, "a complete read waits, yet no data shard request is out"

    @invariant()
    def an_unfinished_read_can_still_complete(self) -> None:
        if self.task.done():
            return
        assert self.loop.now_s < TIMEOUT_S, "the read outlived its deadline"
        if self.complete_at_s is not None:
            return
        assert self._best_count() + len(self._outstanding()) >= K, (
            f"best version {self._best_count()} + {len(self._outstanding())} requests out "
            "< k: the read should have reported a miss (it waits for shards that cannot come)"
        )

    @invariant()
    def reserve_is_asked_when_the_code_intends(self) -> None:
        first_wave = set(range(NUM_NODES)) - {self.reserve_node}
        asked = self._asked()
        assert first_wave <= asked, f"the first wave skipped nodes {first_wave - asked}"
        reserve_asked = self.reserve_node in asked
        if reserve_asked:
            assert self.hopeless_seen or self.hedge_passed_undecided, (
                "the reserve node was asked though the first wave could still give k shards "
                "and the hedge delay had not passed"
            )
        elif not self.task.done() and self.complete_at_s is None:
            assert not self.hopeless_seen, "the first wave is hopeless, yet no reserve asked"
            assert not self.hedge_passed_undecided, (
                "the hedge delay passed with the key undecided, yet the reserve was not asked"
            )


ReadTally.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_read_tally = ReadTally.TestCase
