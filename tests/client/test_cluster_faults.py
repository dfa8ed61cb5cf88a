"""Fault tests on a real 12-node local cluster (node processes, real files, real sockets).

One cluster serves the whole module; every test leaves all nodes running and unmodified.
The blocks written once by ``stored`` (200 blocks, 1 KiB to 4 MiB, about 40 MB) must read back
byte-identical whenever at most 2 nodes are lost or corrupt.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import KVClient, block_keys
from deploy.local_cluster import LocalCluster
from kvstore.errors import InvalidArgument, QuorumError, UnknownTrafficClass
from kvstore.wire.ucx_worker import ucx_available
from tests.client.shard_presence import every_node_holds

pytestmark = pytest.mark.timeout(240)

KiB, MiB = 1 << 10, 1 << 20
# Below the client's 5 s deadline (the straggler is slow, not lost); a read that waited for it
# takes this long, one that did not takes well under half of it even on a loaded machine.
STRAGGLER_DELAY_MS = 4000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Scrub off: only reads may find the shards a test corrupts (a scrub pass finding and
    dropping them first would make what a read sees depend on timing)."""
    root = tmp_path_factory.mktemp("cluster")
    with LocalCluster.start(root, num_nodes=12, fsync=False, scrub_bytes_per_s=0) as c:
        yield c


@pytest.fixture(
    params=[
        "grpc",
        pytest.param(
            "ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
        ),
        "local",
    ]
)
def transport(request: pytest.FixtureRequest) -> str:
    """The read transport under test: every read-side fault test runs over each."""
    return request.param


def _assert_transport_used(kv: KVClient, transport: str) -> None:
    if transport == "ucx":
        assert kv.ucx is not None and kv.ucx.counters.num_ucx_replies > 0, (
            "transport='ucx' but no read was answered over UCX: the UCX read path is unused"
        )
    if transport == "local":
        assert kv.local is not None and kv.local.counters.num_local_replies > 0, (
            "transport='local' but no read was answered over the local channel: it is unused"
        )


def _block_sizes(rng: random.Random) -> list[int]:
    small = [rng.randint(1 * KiB, 64 * KiB) for _ in range(180)]
    medium = [rng.randint(64 * KiB, 1 * MiB) for _ in range(15)]
    return [*small, *medium, *[4 * MiB] * 4, 4 * MiB - 7]


@pytest.fixture(scope="module")
def stored(cluster: LocalCluster) -> dict[bytes, bytes]:
    """Key -> bytes of 200 random blocks, written once for the module."""
    rng = random.Random(1234)
    sizes = _block_sizes(rng)
    keys = block_keys(list(range(len(sizes) * 4)), 4, "faults", "tenant-salt")
    key_to_block = {key: rng.randbytes(size) for key, size in zip(keys, sizes, strict=True)}

    async def put_all() -> None:
        async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
            for batch in _batches(list(key_to_block.items()), 16):
                keys, blocks = zip(*batch, strict=True)
                await kv.put_batch(keys, blocks, traffic_class="chat")

    asyncio.run(put_all())
    # Tests here take two nodes away and expect every block: all 12 shards first.
    asyncio.run(every_node_holds(cluster.cluster_toml, key_to_block, timeout_s=600.0))
    return key_to_block


READ_TIMEOUT_S = 60.0


def _batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


async def _read_all(kv: KVClient, key_to_block: dict[bytes, bytes]) -> dict[bytes, bytes | None]:
    """Read every key 16 at a time, each batch another way: get_batch_into, get_batch, and
    16 concurrent single-key calls (get and get_into, each a batch of one).

    These tests claim which blocks read back, not how fast: a read may take READ_TIMEOUT_S,
    and a timeout raises instead of reading as a miss (the client's default 5 s read as
    misses for a whole batch of 16 once, at load 40)."""
    late = {"timeout_s": READ_TIMEOUT_S, "on_timeout": "raise"}

    async def read(position: int, key: bytes) -> bytes | None:
        if position % 2:
            return await kv.get(key, **late)
        out = bytearray(len(key_to_block[key]))
        return bytes(out) if await kv.get_into(key, out, **late) else None

    got: dict[bytes, bytes | None] = {}
    for number, batch in enumerate(_batches(list(enumerate(key_to_block)), 16)):
        keys = [k for _, k in batch]
        if number % 3 == 0:
            outs = [bytearray(len(key_to_block[k])) for k in keys]
            landed = await kv.get_batch_into(keys, outs, **late)
            values: list[bytes | None] = [
                bytes(o) if ok else None for o, ok in zip(outs, landed, strict=True)
            ]
        elif number % 3 == 1:
            values = await kv.get_batch(keys, **late)
        else:
            values = await asyncio.gather(*(read(p, k) for p, k in batch))
        got.update(zip(keys, values, strict=True))
    return got


def _assert_all_identical(got: dict, key_to_block: dict, why: str) -> None:
    wrong = [k for k, block in key_to_block.items() if got[k] != block]
    missing = [k for k in wrong if got[k] is None]
    assert not wrong, (
        f"{len(wrong)} of {len(key_to_block)} blocks read wrong ({len(missing)} as misses, "
        f"{len(wrong) - len(missing)} with WRONG BYTES) {why}"
    )


async def _wait_reachable(kv: KVClient, timeout_s: float = 15.0) -> None:
    """Poll Stats through the client until every node answers (its channels reconnected)."""
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        if all(reply is not None for reply in (await kv.node_stats(timeout_s=1.0)).values()):
            return
        await asyncio.sleep(0.1)
    raise AssertionError("restarted nodes never became reachable through the client")


async def test_every_block_survives_two_dead_nodes(
    cluster: LocalCluster, stored: dict, transport: str
) -> None:
    victims = random.Random(7).sample([n.id for n in cluster.config.nodes], 2)
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as kv:
        try:
            for node_id in victims:
                cluster.kill_node(node_id)
            got = await _read_all(kv, stored)
            _assert_all_identical(got, stored, f"with nodes {victims} dead (10 of 12 remain)")
            _assert_transport_used(kv, transport)
        finally:
            for node_id in victims:
                cluster.restart_node(node_id)


@pytest.mark.slow
async def test_three_dead_nodes_give_clean_misses_then_restart_heals(
    cluster: LocalCluster, stored: dict, transport: str
) -> None:
    # With 12 nodes every group holds all 12, so 3 dead nodes are 3 of every group.
    victims = ["n01", "n05", "n10"]
    sample = dict(list(stored.items())[:40])
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as kv:
        try:
            for node_id in victims:
                cluster.kill_node(node_id)
            start_s = time.monotonic()
            got = await _read_all(kv, sample)
            assert all(v is None for v in got.values()), "9 of 12 shards must read as a miss"
            assert time.monotonic() - start_s < 10, "misses should not wait for the deadline"
            assert await kv.contains(list(sample)) == [False] * len(sample)
            with pytest.raises(QuorumError, match="below min_write_shards"):
                await kv.put(b"q" * 16, b"x" * 1000)
            batch = [bytes([7, i]) * 8 for i in range(5)]
            with pytest.raises(QuorumError, match="5 of 5 blocks") as failed:
                await kv.put_batch(batch, [b"y" * 5000] * 5, traffic_class="chat")
            assert failed.value.keys == batch, "QuorumError must name every key below quorum"
        finally:
            for node_id in victims:
                cluster.restart_node(node_id)
        await _wait_reachable(kv)
        got = await _read_all(kv, stored)
        _assert_all_identical(got, stored, "after restarting the 3 killed nodes (same client)")
        _assert_transport_used(kv, transport)
        assert await kv.match_prefix(list(stored)) == len(stored)


@pytest.mark.slow
async def test_reads_and_writes_do_not_wait_for_a_straggler(
    cluster: LocalCluster, stored: dict, transport: str
) -> None:
    straggler = "n04"
    sample = dict(list(stored.items())[150:])  # the medium and 4 MiB blocks, and some small
    cluster.restart_node(straggler, ["--inject-delay-ms", str(STRAGGLER_DELAY_MS)])
    try:
        async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as kv:
            slowest_s = 0.0
            key_to_out: dict[bytes, bytearray] = {}
            for position, (key, block) in enumerate(sample.items()):
                start_s = time.monotonic()
                if position % 2:
                    assert await kv.get(key) == block, "wrong bytes with a straggler"
                else:
                    key_to_out[key] = bytearray(len(block))
                    assert await kv.get_into(key, key_to_out[key]), "a miss with a straggler"
                    assert key_to_out[key] == block, "wrong bytes in get_into with a straggler"
                slowest_s = max(slowest_s, time.monotonic() - start_s)
            keys = list(sample)
            outs = [bytearray(len(sample[k])) for k in keys]
            start_s = time.monotonic()
            assert all(await kv.get_batch_into(keys, outs)), "a batch missed with a straggler"
            batch_s = time.monotonic() - start_s
            assert [bytes(o) for o in outs] == list(sample.values()), "wrong bytes in a batch"
            key_to_out.update({f"batch {i}".encode(): o for i, o in enumerate(outs)})
            start_s = time.monotonic()
            await kv.put(b"s" * 16, b"y" * 100_000)
            await kv.put_batch([b"t" * 16, b"u" * 16], [b"z" * 70_000] * 2, traffic_class="chat")
            put_s = time.monotonic() - start_s
            assert kv.counters()["num_hedged"] > 0, "no read finished before all asked nodes"
        delay_s = STRAGGLER_DELAY_MS / 1000
        assert slowest_s < delay_s / 2, (
            f"slowest read took {slowest_s:.2f} s with a {delay_s} s straggler: "
            "the read waited for the slow node instead of finishing at k shards"
        )
        assert batch_s < delay_s / 2, f"a batch took {batch_s:.2f} s: it waited for the straggler"
        assert put_s < delay_s / 2, f"puts took {put_s:.2f} s: they waited past the write quorum"
        # The straggler's payloads arrive after the reads returned: none may land in `out`.
        await asyncio.sleep(delay_s + 0.5)
        expected = {**sample, **{f"batch {i}".encode(): sample[k] for i, k in enumerate(keys)}}
        changed = [k for k, out in key_to_out.items() if out != expected[k]]
        assert not changed, f"{len(changed)} get_into buffers were written after get_into returned"
    finally:
        cluster.restart_node(straggler)


async def test_reads_touch_unheard_nodes_and_hedge_past_hung_ones(
    cluster: LocalCluster, stored: dict, transport: str
) -> None:
    """#13's follow-ups and hedge hold on every transport: a healthy read touches the
    group's node it did not ask (the 12th), and two SIGSTOPped nodes cost the hedge delay,
    not the deadline (the 60 s deadline keeps a loaded machine's slow call apart from it)."""
    timeout_s = 60.0
    sample = dict(list(stored.items())[:48])
    keys = list(sample)
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as kv:
        assert await kv.get_batch(keys[:16], timeout_s=timeout_s) == list(sample.values())[:16]
        # Under load a slow node makes the read hedge to the 12th: then every node was asked
        # and none is left to touch.
        assert kv.follow_ups.counters.num_touches > 0 or kv.read_counters.num_reserve_asks, (
            f"a read over {transport} touched no unasked node: its shards would expire early"
        )
        # Nodes an earlier test killed and restarted must hold the sample again first: with
        # n00 and n01 hung, every other node's shard is needed.
        await every_node_holds(cluster.cluster_toml, keys, timeout_s=600.0)
        hung = [cluster.procs[n] for n in ("n00", "n01")]
        for proc in hung:
            proc.send_signal(signal.SIGSTOP)
        try:
            start_s = time.monotonic()
            for batch in _batches(keys[16:], 8):
                got = await kv.get_batch(batch, timeout_s=timeout_s)
                assert got == [sample[k] for k in batch], "a read with 2 hung nodes was wrong"
            slowest_s = time.monotonic() - start_s
        finally:
            for proc in hung:
                proc.send_signal(signal.SIGCONT)
        _assert_transport_used(kv, transport)
    assert kv.read_counters.num_reserve_asks > 0, f"no read over {transport} hedged to the 12th"
    assert slowest_s < timeout_s / 3, (
        f"4 batches took {slowest_s:.2f} s with 2 hung nodes over {transport}: a hung node "
        "must cost about the hedge delay, not the deadline"
    )


@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
async def test_get_into_over_ucx_lands_payloads_in_place(cluster: LocalCluster) -> None:
    rng = random.Random(11)
    # 4 MB, 2 MB and 1 MB split into 10 whole payloads; 4 MiB - 7 leaves a padded last one.
    sizes = [4_000_000, 2_000_000, 4 * MiB - 7, 1_000_000]
    keys = block_keys(list(range(len(sizes) * 4)), 4, "in-place", "salt")
    blocks = {key: rng.randbytes(size) for key, size in zip(keys, sizes, strict=True)}
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport="ucx") as kv:
        await asyncio.gather(*(kv.put(key, block) for key, block in blocks.items()))
        assert kv.ucx is not None
        for key, block in blocks.items():
            before = kv.ucx.counters.num_landed_in_place
            hedges_before = kv.read_counters.num_reserve_asks
            out = bytearray(len(block))
            assert await kv.get_into(key, out) and out == block, "get_into over UCX failed"
            landed = kv.ucx.counters.num_landed_in_place - before
            whole = len(block) // kv.codec.payload_bytes(len(block))
            # A read asks k+1 nodes and ends at k shards: the parity shard may beat one (both
            # may, when the read was slow enough to hedge to the 12th node).
            hedged = kv.read_counters.num_reserve_asks > hedges_before
            spare = (kv.codec.num_shards if hedged else kv.config.client.read_fanout) - kv.codec.k
            assert whole - spare <= landed <= whole, (
                f"{landed} of the {whole} data payloads that fit landed in the caller's buffer"
            )
            assert await kv.get(key) == block, "get over UCX (buffers of their own) failed"


@pytest.mark.slow
@pytest.mark.skipif(not ucx_available(), reason="ucxx not installed")
async def test_a_node_whose_ucx_address_went_stale_is_read_over_grpc(
    cluster: LocalCluster, stored: dict
) -> None:
    """n02 restarts (a new UCX worker address) while n01 and n03 are down, so every batch
    needs n02 (10 nodes up, k = 10: a hedge to the 12th node cannot stand in for it): the UCX
    request to its old address gets no reply, and the read falls back to gRPC."""
    sample = dict(list(stored.items())[150:170])
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport="ucx") as kv:
        assert await kv.get_batch(list(sample)) == list(sample.values())
        try:
            cluster.kill_node("n01")
            cluster.kill_node("n03")
            cluster.restart_node("n02")
            outs = [bytearray(len(b)) for b in sample.values()]
            landed = await kv.get_batch_into(list(sample), outs, timeout_s=20)
            assert all(landed), "a batch missed although the 10 nodes it needs were up"
            assert [bytes(o) for o in outs] == list(sample.values()), "wrong bytes after fallback"
            assert kv.ucx is not None and kv.ucx.counters.num_fallbacks > 0, (
                "the stale node was never read over gRPC: no fallback happened"
            )
        finally:
            cluster.restart_node("n01")
            cluster.restart_node("n03")


@pytest.mark.slow
async def test_a_restarted_node_is_read_over_its_fallback_then_linked_again(
    cluster: LocalCluster, stored: dict
) -> None:
    """n03 restarts: its local link and the arena its old process mapped are gone. Reads stay
    byte-identical (the fallback, or the other nodes), and the client links to the new
    process's socket, learnt from a fresh Health reply, without a new connect."""
    sample = dict(list(stored.items())[150:170])
    keys, blocks = list(sample), list(sample.values())
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport="local") as kv:
        assert kv.local is not None
        reader = next(r for r in kv.local.readers if r.node_id == "n03")
        assert await kv.get_batch(keys) == blocks
        # Connect needs one local link; n03's may come from a background Health ask (a
        # loaded machine answers a first Health slowly): wait for it, reading meanwhile.
        deadline_s = time.monotonic() + 60
        while reader.link is None or not reader.link.alive:
            assert time.monotonic() < deadline_s, "n03 was never linked before its restart"
            assert await kv.get_batch(keys[:4]) == blocks[:4], "wrong bytes before linking"
            await asyncio.sleep(0.05)
        old_link = reader.link
        cluster.restart_node("n03")
        outs = [bytearray(len(b)) for b in blocks]
        assert all(await kv.get_batch_into(keys, outs, timeout_s=20)), "a miss after a restart"
        assert [bytes(o) for o in outs] == blocks, "wrong bytes right after a node restart"
        # Wait on the outcome, not a fixed time: reads go on until n03 has a new live link.
        deadline_s = time.monotonic() + 60
        while reader.link is old_link or reader.link is None or not reader.link.alive:
            assert time.monotonic() < deadline_s, "the restarted node was never linked again"
            assert await kv.get_batch(keys[:4]) == blocks[:4], "wrong bytes while relinking"
            await asyncio.sleep(0.05)
        assert not old_link.alive, "the link to the killed process still counts as alive"
        replies_before = kv.local.counters.num_local_replies
        assert await kv.get_batch(keys) == blocks, "wrong bytes over the new link"
        assert kv.local.counters.num_local_replies >= replies_before + 10, (
            "reads did not go back to the local channel once the node was linked again"
        )


def _flip_bytes(paths: list[Path], rng: random.Random) -> list[tuple[Path, int, int]]:
    """Flip one byte every ~2 KiB of each file; return (path, offset, original) to undo it.

    A file may be gone by now: a node deletes a segment (or moves it to quarantine/) once the
    corrupt records it found left no live one there, as an earlier run's reads did.
    """
    undo = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError), path.open("r+b") as f:
            size = path.stat().st_size
            for offset in range(rng.randrange(2048), size, 2048):
                f.seek(offset)
                original = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([original ^ 0x5A]))
                undo.append((path, offset, original))
    return undo


def _restore(undo: list[tuple[Path, int, int]]) -> None:
    """Undo ``_flip_bytes`` where the file is still there: the node's upkeep tick (every
    second) may have freed a segment whose records the reads found corrupt meanwhile."""
    for path, offset, original in undo:
        with contextlib.suppress(FileNotFoundError), path.open("r+b") as f:
            f.seek(offset)
            f.write(bytes([original]))


async def test_reads_stay_correct_with_corrupt_shards_on_two_nodes(
    cluster: LocalCluster, transport: str
) -> None:
    # Nodes drop the corrupt records they find: each run reads blocks of its own, so the
    # other transport's run and the module's `stored` blocks keep all their shards.
    rng = random.Random(3)
    keys = block_keys(list(range(40 * 4)), 4, f"corrupt-{transport}", "salt")
    blocks = {key: rng.randbytes(rng.randint(1 * KiB, 1 * MiB)) for key in keys}
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as kv:
        await asyncio.gather(*(kv.put(key, block) for key, block in blocks.items()))
        segment_files = [
            path
            for node_id in ("n02", "n08")
            for path in (cluster.root / node_id).rglob("*")
            if path.is_file() and "segment" in str(path.relative_to(cluster.root)).lower()
        ]
        assert segment_files, "no segment files found under the node data dirs"
        undo = _flip_bytes(segment_files, rng)
        try:
            got = await _read_all(kv, blocks)
        finally:
            _restore(undo)
        _assert_all_identical(got, blocks, "with corrupt shard files on n02 and n08")
        _assert_transport_used(kv, transport)
        # A hedged read may finish before a corrupt shard arrives, so the nodes' own
        # counts (they verify every record they read) count too.
        stats = await kv.node_stats()
        num_node_corrupt = sum(stats[n].corrupt_shards for n in ("n02", "n08") if stats[n])
        assert kv.read_counters.num_corrupt_shards + num_node_corrupt > 0, (
            "corruption went unnoticed: neither node nor client reported a corrupt shard"
        )


async def test_concurrent_writers_never_mix(cluster: LocalCluster, transport: str) -> None:
    rng = random.Random(99)
    keys = block_keys(list(range(30 * 8)), 8, "writers", "salt")
    sizes = [rng.choice([3 * KiB, 200 * KiB, 1 * MiB]) for _ in keys]
    a = {k: rng.randbytes(n) for k, n in zip(keys, sizes, strict=True)}
    b = {k: rng.randbytes(n) for k, n in zip(keys, sizes, strict=True)}
    async with (
        KVClient.connect(cluster.cluster_toml, tenant="acme") as writer_a,
        KVClient.connect(cluster.cluster_toml, tenant="acme") as writer_b,
        KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as reader,
    ):
        reads_during = asyncio.gather(
            *(reader.get(k) for k in keys),
            *(reader.get_batch(keys[i : i + 16]) for i in range(0, len(keys), 16)),
        )
        half, slow = len(keys) // 2, 60.0  # 480 puts at once on a loaded machine: no deadline
        await asyncio.gather(
            *(writer_a.put(k, a[k], timeout_s=slow) for k in keys[:half]),
            writer_a.put_batch(
                keys[half:], [a[k] for k in keys[half:]], traffic_class="chat", timeout_s=slow
            ),
            writer_b.put_batch(
                keys[:half], [b[k] for k in keys[:half]], traffic_class="chat", timeout_s=slow
            ),
            *(writer_b.put(k, b[k], timeout_s=slow) for k in keys[half:]),
        )
        gathered = await reads_during
        during = list(gathered[: len(keys)]) + [v for batch in gathered[len(keys) :] for v in batch]
        # A long deadline: 240 blocks at once on a loaded machine may take longer than the
        # default 5 s, and a deadline's miss is not what this test is about.
        after = await reader.get_batch(keys, timeout_s=slow)
    for key, value in zip(keys * 3, during + after, strict=True):
        assert value in (a[key], b[key], None), "a read returned a MIX of two writers' bytes"
    assert all(value in (a[k], b[k]) for k, value in zip(keys, after, strict=True)), (
        "after both writes finished every key must read as one writer's bytes"
    )


async def test_batches_mix_hits_misses_repeats_and_sizes(
    cluster: LocalCluster, stored: dict, transport: str
) -> None:
    hits = list(stored)[150:170]
    missing = block_keys(list(range(3 * 4)), 4, "never-written", "salt")
    keys = [*hits[:10], missing[0], hits[3], *missing[1:], *hits[10:]]  # hits[3] twice
    async with KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as kv:
        sizes = [len(stored[k]) if k in stored else 100 for k in keys]
        outs = [bytearray(size) for size in sizes]
        before = kv.read_counters.num_node_requests
        landed = await kv.get_batch_into(keys, outs)
        assert landed == [k in stored for k in keys], "hits and misses mixed up in a batch"
        assert all(bytes(o) == stored[k] for k, o, ok in zip(keys, outs, landed, strict=True) if ok)
        assert kv.read_counters.num_node_requests - before <= 12 + 12, (
            "a batch sent more than one request per node (plus reserve asks for its misses)"
        )
        assert await kv.get_batch(keys) == [stored.get(k) for k in keys]
        assert await kv.get_batch([]) == [] and await kv.get_batch_into([], []) == []
        _assert_transport_used(kv, transport)


async def test_batch_misuse_raises_before_anything_lands(cluster: LocalCluster) -> None:
    keys = block_keys(list(range(4 * 4)), 4, "batch-misuse", "salt")
    async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
        await kv.put_batch(keys, [b"m" * 3000] * 4, traffic_class="chat")
        with pytest.raises(InvalidArgument, match="one buffer per key"):
            await kv.get_batch_into(keys, [bytearray(3000)] * 3)
        with pytest.raises(InvalidArgument, match="one block per key"):
            await kv.put_batch(keys, [b"x"], traffic_class="chat")
        with pytest.raises(InvalidArgument, match="read-only"):
            await kv.get_batch_into(keys[:1], [bytes(3000)])
        with pytest.raises(InvalidArgument, match="3000 bytes"):
            await kv.get_batch_into(keys[:2], [bytearray(3000), bytearray(2999)])
        with pytest.raises(InvalidArgument, match="16 bytes"):
            await kv.put_batch([keys[0], b"short"], [b"a", b"b"], traffic_class="chat")
        with pytest.raises(UnknownTrafficClass):
            await kv.put_batch(keys, [b"a"] * 4, traffic_class="bulk")
        assert await kv.get_batch(keys) == [b"m" * 3000] * 4, "misuse damaged stored blocks"


async def test_bad_input_raises_clear_errors(cluster: LocalCluster) -> None:
    key = block_keys(list(range(16)), 16, "bad-input", "salt")[0]
    async with KVClient.connect(cluster.cluster_toml, tenant="acme") as kv:
        await kv.put(key, b"z" * 5000)
        with pytest.raises(InvalidArgument, match="5000 bytes"):
            await kv.get_into(key, bytearray(4999))
        with pytest.raises(InvalidArgument, match="writable"):
            await kv.get_into(key, bytes(5000))
        max_bytes = cluster.config.codec.max_block_bytes
        with pytest.raises(InvalidArgument, match="max_block_bytes"):
            await kv.put(key, bytes(max_bytes + 1))
        with pytest.raises(InvalidArgument):
            await kv.put(key, b"")
        with pytest.raises(InvalidArgument, match="bytes-like"):
            await kv.put(key, "text is not a block")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="contiguous"):
            await kv.put(key, memoryview(bytes(100))[::2])
        with pytest.raises(UnknownTrafficClass, match="chat"):
            await kv.put(key, b"z" * 10, traffic_class="bulk")
        with pytest.raises(InvalidArgument, match="16 bytes"):
            await kv.get(b"short")
        with pytest.raises(InvalidArgument, match="16 bytes"):
            await kv.contains([key, b"short"])
        assert await kv.get(key) == b"z" * 5000, "a rejected call must not damage stored data"
    with pytest.raises(InvalidArgument, match="transport"):
        KVClient.connect(cluster.cluster_toml, tenant="acme", transport="rdma")
    with pytest.raises(ValueError, match="no cluster config"):
        await KVClient.connect(cluster.root / "missing.toml", tenant="acme")


async def test_tenants_are_isolated(cluster: LocalCluster, transport: str) -> None:
    key = block_keys(list(range(16)), 16, f"shared-namespace-{transport}", "same-salt")[0]
    async with (
        KVClient.connect(cluster.cluster_toml, tenant="acme", transport=transport) as acme,
        KVClient.connect(cluster.cluster_toml, tenant="globex", transport=transport) as globex,
    ):
        await acme.put(key, b"acme secret" * 100)
        assert await globex.get(key) is None, "another tenant READ acme's block"
        assert await globex.contains([key]) == [False], "another tenant SAW acme's block"
        await globex.delete([key])
        assert await acme.get(key) == b"acme secret" * 100, "another tenant DELETED acme's block"
        await globex.put(key, b"globex" * 10)
        assert await acme.get(key) == b"acme secret" * 100
        assert await globex.get(key) == b"globex" * 10
        assert await acme.get_batch([key]) == [b"acme secret" * 100]
        assert await globex.get_batch([key]) == [b"globex" * 10], "a batch read another's block"
        _assert_transport_used(acme, transport)
        await acme.delete([key])
        assert await acme.get(key) is None and await acme.contains([key]) == [False]
    kv = await KVClient.connect(cluster.cluster_toml, tenant="globex")
    async with kv:  # the other documented form: async with await KVClient.connect(...)
        assert await kv.get(key) == b"globex" * 10
