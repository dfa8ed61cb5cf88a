"""The repair's bookkeeping (pure): a backlog recomputed from what was found, passes scheduled
when a node is ready and when members change, a settle delay that batches returns, the ETA."""

from __future__ import annotations

import pytest

from kvstore.node.repair_backlog import (
    Backlog,
    Hole,
    PassSchedule,
    ProbePacer,
    RateMeter,
    TokenBucket,
    changed_members,
    eta_s,
)

K = 10


def test_a_pass_replaces_its_groups_backlog_instead_of_decrementing_it() -> None:
    backlog = Backlog(K)
    backlog.replace_group(3, {("t", b"a"): Hole(0, 1, 100), ("t", b"b"): Hole(0, 1, 100)})
    backlog.replace_group(4, {("t", b"c"): Hole(2, 0, 50)})
    assert backlog.figures().shards == 4 and backlog.figures().waiting == 2
    # The member that was not ready is back and holds its shards: a fresh listing finds
    # nothing missing, and the backlog is 0 at once, whatever the earlier pass counted.
    backlog.replace_group(3, {})
    figures = backlog.figures()
    assert (figures.shards, figures.waiting, figures.blocks) == (2, 0, 1), (
        "a backlog from a listing with a member not ready outlived the next listing"
    )
    assert figures.cost_bytes == 50 * (K + 2), "a rebuild reads k shards and writes each missing"


def test_a_look_at_one_block_replaces_its_entry_and_other_groups_are_forgotten() -> None:
    backlog = Backlog(K)
    backlog.replace_group(1, {("t", b"a"): Hole(1, 1, 10)})
    backlog.set_block(1, ("t", b"a"), Hole(0, 1, 10))  # the missing shard was rebuilt
    assert backlog.figures().shards == 1
    backlog.set_block(1, ("t", b"new"), Hole(1, 0, 10))  # a hint found another block short
    assert (backlog.figures().shards, backlog.figures().blocks) == (2, 2)
    backlog.set_block(1, ("t", b"a"), None)
    backlog.set_block(1, ("t", b"new"), Hole(0, 0, 10))
    assert backlog.figures().shards == 0 and backlog.figures().blocks == 0
    backlog.replace_group(2, {("t", b"x"): Hole(1, 0, 10)})
    backlog.keep_groups([1])  # group 2 got another leader
    assert backlog.figures().shards == 0


def test_the_first_pass_waits_for_readiness_then_lists_every_led_group() -> None:
    schedule = PassSchedule(settle_s=3.0, interval_s=600.0)
    led = [0, 5]
    assert schedule.take_due(led, 1000.0) == [], "a pass ran before the node was ready"
    assert schedule.pending(led) == 2, "before the first pass every led group is unknown"
    schedule.start(led, 10.0)
    assert schedule.take_due(led, 12.0) == [], "the settle delay was not waited"
    assert schedule.take_due(led, 13.0) == [0, 5]
    assert schedule.pending(led) == 0 and schedule.take_due(led, 14.0) == []
    assert schedule.take_due(led, 613.0) == [0, 5], "no periodic pass"


def test_triggers_during_the_settle_delay_join_one_pass() -> None:
    schedule = PassSchedule(settle_s=3.0, interval_s=600.0)
    schedule.start([0, 1, 2], 0.0)
    schedule.take_due([0, 1, 2], 3.0)
    schedule.trigger([1], 10.0)  # a member came back
    schedule.trigger([1, 2], 12.0)  # a second member came back two seconds later
    assert schedule.is_due(1) and schedule.pending([0, 1, 2]) == 2
    assert schedule.take_due([0, 1, 2], 12.5) == []
    assert schedule.take_due([0, 1, 2], 13.0) == [1], "the first trigger's time holds"
    assert schedule.take_due([0, 1, 2], 15.0) == [2]
    schedule.trigger([7], 20.0)
    assert schedule.take_due([0, 1, 2], 30.0) == [], "a group this node does not lead ran"


def test_changed_members_are_restarts_returns_and_losses_not_first_sightings() -> None:
    previous = {"a": 11, "b": 0, "c": 13, "d": 14}
    seen = {"a": 11, "b": 21, "c": 0, "d": 24, "e": 25}
    assert changed_members(previous, seen) == {"b", "c", "d"}


@pytest.mark.parametrize(
    ("configured", "measured", "expected"),
    [(100.0, 0.0, 10.0), (100.0, 50.0, 20.0), (100.0, 400.0, 10.0)],
)
def test_the_eta_uses_the_slower_of_the_configured_and_measured_rates(
    configured: float, measured: float, expected: float
) -> None:
    assert eta_s(1000, configured, measured) == expected
    assert eta_s(0, configured, measured) == 0.0


def test_the_rate_meter_averages_rebuilds() -> None:
    meter = RateMeter(alpha=0.5)
    meter.add(0, 1.0)
    assert meter.bytes_per_s == 0.0
    meter.add(100, 1.0)
    meter.add(300, 1.0)
    assert meter.bytes_per_s == 200.0


def test_next_due_is_the_earliest_pass_so_an_idle_loop_can_sleep_until_then() -> None:
    schedule = PassSchedule(settle_s=3.0, interval_s=600.0)
    assert schedule.next_due_s() == float("inf"), "nothing is due before readiness starts it"
    schedule.start([0, 1], now_s=100.0)
    assert schedule.next_due_s() == 103.0, "the settled first pass comes first"
    schedule.take_due([0, 1], now_s=103.0)
    assert schedule.next_due_s() == 700.0, "then the periodic pass"
    schedule.retry(1, at_s=150.0)
    assert schedule.next_due_s() == 150.0, "a retry due sooner must wake the loop sooner"


def test_probes_back_off_while_steady_and_return_at_once_on_a_change() -> None:
    pacer = ProbePacer(base_s=2.0, idle_s=16.0)
    for now_s, want_period_s in ((0.0, 4.0), (4.0, 8.0), (12.0, 16.0), (28.0, 16.0)):
        pacer.probed(True, now_s)
        assert pacer.period_s == want_period_s, "steady probes must back off up to idle_s"
    pacer.probed(False, 44.0)
    assert (pacer.period_s, pacer.next_s) == (2.0, 46.0), "a change must probe at base_s again"
    pacer.reset()
    assert pacer.next_s == 0.0, "a new map must be probed at once"


def test_the_token_bucket_allows_a_burst_then_the_rate() -> None:
    bucket = TokenBucket(bytes_per_s=100.0, now_s=0.0, burst_s=0.5)
    assert bucket.take(50, now_s=0.0) == 0.0, "the burst must pass at once"
    assert bucket.take(100, now_s=0.0) == 1.0, "beyond the burst: wait at the rate"
    assert bucket.take(0, now_s=1.0) == 0.0, "the debt is paid after its wait"
