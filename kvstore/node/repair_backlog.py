"""What the repair service knows is missing, and when it lists a group again. Pure code: no
I/O, time passed in (monotonic seconds), so tests drive it directly.

**The backlog is recomputed, never merely decremented.** :class:`Backlog` holds, per led group,
the blocks that lack shards as the latest look at them found: a pass replaces the group's
whole record from its listing of every member, a hint or a rebuild replaces one block's. So
after a pass the backlog is exactly what the members hold (a shard counted missing on a
member that was not ready, or down, counts until a later look finds it there). Figures::

    backlog shards   shards the led groups' readable blocks lack: missing (member up) and
                     waiting (member down or not ready: rebuilt when it is back)
    at-risk blocks   blocks with fewer than k+m shards (k+2 by default): one more failure
                     than they can take is one failure closer
    cost bytes       what rebuilding them all moves: k survivors read per block, each
                     missing shard written
    eta_s            cost bytes at the repair rate (the configured one, or the measured one
                     when rebuilds ran slower), from when the waiting members are back

**When a group is listed** (:class:`PassSchedule`): every ``repair_scan_interval_s``, and after
a *trigger*: this node became ready for repair (its first pass waits for that), a member
restarted, came back, went down or became ready, or this node took the group's lead over.
A triggered pass waits ``settle_s`` first, and triggers meanwhile join it, so a block whose
two members return together is read and decoded once, not once per member. A pass that left
shards missing on members that are up (a put refused, a survivor unreadable, a member too busy
to list) is retried a few seconds later (:meth:`PassSchedule.retry`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

BlockId = tuple[str, bytes]  # (tenant, key)


@dataclass(frozen=True, slots=True)
class Hole:
    """What one readable block lacks: shards missing on members that are up, shards waiting
    for members that are down, and the size of one shard."""

    num_missing: int
    num_waiting: int
    shard_bytes: int

    @property
    def num_shards(self) -> int:
        return self.num_missing + self.num_waiting


@dataclass(frozen=True, slots=True)
class BacklogFigures:
    shards: int = 0  # missing + waiting
    waiting: int = 0
    blocks: int = 0  # blocks with fewer than k+m shards
    cost_bytes: int = 0


class Backlog:
    """Per led group, the blocks that lack shards (see the module docstring). The totals are
    kept as the record changes, so reading them costs nothing however long the backlog is."""

    def __init__(self, k: int) -> None:
        self._k = k
        self._group_to_holes: dict[int, dict[BlockId, Hole]] = {}
        self._totals = [0, 0, 0, 0]  # shards, waiting, blocks, cost bytes

    def replace_group(self, group: int, holes: Mapping[BlockId, Hole]) -> None:
        """A fresh listing of ``group``: its record becomes ``holes``."""
        for hole in self._group_to_holes.pop(group, {}).values():
            self._count(hole, -1)
        kept = {b: h for b, h in holes.items() if h.num_shards}
        for hole in kept.values():
            self._count(hole, +1)
        self._group_to_holes[group] = kept

    def set_block(self, group: int, block: BlockId, hole: Hole | None) -> None:
        """A fresh look at one block (a hint, a rebuild): ``None`` = it lacks nothing."""
        holes = self._group_to_holes.setdefault(group, {})
        old = holes.pop(block, None)
        if old is not None:
            self._count(old, -1)
        if hole is not None and hole.num_shards:
            holes[block] = hole
            self._count(hole, +1)

    def missing_in(self, group: int) -> int:
        """Shards of ``group`` missing on members that are up (a rebuild that failed)."""
        return sum(h.num_missing for h in self._group_to_holes.get(group, {}).values())

    def keep_groups(self, groups: Collection[int]) -> None:
        """Forget the groups this node no longer leads (their new leader counts them)."""
        for group in [g for g in self._group_to_holes if g not in groups]:
            self.replace_group(group, {})
            del self._group_to_holes[group]

    def figures(self) -> BacklogFigures:
        return BacklogFigures(*self._totals)

    def _count(self, hole: Hole, sign: int) -> None:
        cost_bytes = hole.shard_bytes * (self._k + hole.num_shards)
        for i, value in enumerate((hole.num_shards, hole.num_waiting, 1, cost_bytes)):
            self._totals[i] += sign * value


def eta_s(cost_bytes: int, configured_bytes_per_s: float, measured_bytes_per_s: float) -> float:
    """Seconds to move ``cost_bytes`` at the configured rate, or at the measured one when
    rebuilds ran slower than that (a loaded node); 0 when nothing is left."""
    if not cost_bytes:
        return 0.0
    rate = configured_bytes_per_s
    if 0 < measured_bytes_per_s < rate:
        rate = measured_bytes_per_s
    return cost_bytes / rate


class RateMeter:
    """Bytes per second of the rebuilds so far, an exponential moving average over rebuilds
    (time spent rebuilding only, so idle time between them does not count)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self.bytes_per_s = 0.0

    def add(self, num_bytes: int, elapsed_s: float) -> None:
        if num_bytes <= 0 or elapsed_s <= 0:
            return
        rate = num_bytes / elapsed_s
        if not self.bytes_per_s:
            self.bytes_per_s = rate
        else:
            self.bytes_per_s += self._alpha * (rate - self.bytes_per_s)


class PassSchedule:
    """Which led groups are due for a listing pass, and when (see the module docstring)."""

    def __init__(self, settle_s: float, interval_s: float) -> None:
        self.settle_s = settle_s
        self.interval_s = interval_s
        self._group_to_due_s: dict[int, float] = {}
        self._next_full_s: float | None = None  # None: the first pass waits for readiness

    def trigger(self, groups: Iterable[int], now_s: float) -> None:
        """List ``groups`` after the settle delay; a group already due keeps its earlier time,
        so triggers during a settle join that pass."""
        for group in groups:
            due_s = now_s + self.settle_s
            self._group_to_due_s[group] = min(self._group_to_due_s.get(group, due_s), due_s)

    def retry(self, group: int, at_s: float) -> None:
        """List ``group`` again at ``at_s`` (or earlier, if it is due earlier already)."""
        self._group_to_due_s[group] = min(self._group_to_due_s.get(group, at_s), at_s)

    def start(self, led: Iterable[int], now_s: float) -> None:
        """This node became ready: list every led group (settled), and periodically after."""
        self.trigger(led, now_s)
        self._next_full_s = now_s + self.interval_s

    def take_due(self, led: Collection[int], now_s: float) -> list[int]:
        """The led groups to list now (forgotten once taken); the periodic pass included."""
        if self._next_full_s is not None and now_s >= self._next_full_s:
            self._next_full_s = now_s + self.interval_s
            for group in led:
                self._group_to_due_s.setdefault(group, now_s)
        due = sorted(g for g, at_s in self._group_to_due_s.items() if at_s <= now_s)
        for group in due:
            del self._group_to_due_s[group]
        return [g for g in due if g in led]

    def pending(self, led: Collection[int]) -> int:
        """Led groups waiting for a pass (all of them before the first: nothing is known)."""
        if self._next_full_s is None:
            return len(led)
        return sum(1 for g in self._group_to_due_s if g in led)

    def next_due_s(self) -> float:
        """When the next pass is due (monotonic; inf before the first, which readiness starts)."""
        full_s = self._next_full_s if self._next_full_s is not None else float("inf")
        return min([full_s, *self._group_to_due_s.values()])

    def is_due(self, group: int) -> bool:
        return group in self._group_to_due_s


class TokenBucket:
    """A token bucket in bytes (the repair rate): :meth:`take` spends ``num_bytes`` and says
    how long to wait before the rate allows them (0: at once)."""

    def __init__(self, bytes_per_s: float, now_s: float, burst_s: float = 0.5) -> None:
        self.bytes_per_s = bytes_per_s
        self._burst_bytes = bytes_per_s * burst_s
        self._tokens = self._burst_bytes
        self._last_s = now_s

    def take(self, num_bytes: int, now_s: float) -> float:
        refill = (now_s - self._last_s) * self.bytes_per_s
        self._tokens = min(self._burst_bytes, self._tokens + refill) - num_bytes
        self._last_s = now_s
        return max(0.0, -self._tokens / self.bytes_per_s)


class ProbePacer:
    """When the next Health probe of the group members is due: every ``base_s`` after a probe
    that saw a change or a member down, doubling up to ``idle_s`` while probes find every
    member up and nothing changed (steady)."""

    def __init__(self, base_s: float, idle_s: float) -> None:
        self.base_s, self.idle_s = base_s, idle_s
        self.period_s = base_s
        self.next_s = 0.0  # monotonic; 0: probe now

    def probed(self, steady: bool, now_s: float) -> None:
        self.period_s = min(2 * self.period_s, self.idle_s) if steady else self.base_s
        self.next_s = now_s + self.period_s

    def reset(self) -> None:
        """Probe now, then at ``base_s`` (a new map: its members are unknown)."""
        self.period_s, self.next_s = self.base_s, 0.0


def changed_members(previous: Mapping[str, int], seen: Mapping[str, int]) -> set[str]:
    """Members whose state changed between two probes: an incarnation seen (0 = down or not
    ready for repair) that differs from the one before. A member seen for the first time is
    no change (the pass this node runs when it becomes ready covers it)."""
    return {m for m, now in seen.items() if m in previous and previous[m] != now}
