"""Which nodes of a group a read asks first, and which it keeps in reserve. Pure code.

A read asks ``fanout`` nodes (11 of 12 by default) and finishes at the first ``k`` valid shards
of one version. Positions are ranked by

1. suspect (recently failed) nodes last,
2. then slow nodes (see client/node_health.py), the slowest last: when two nodes look slow and
   only one can be skipped, the read still skips the worse one,
3. then data shards (positions < k) before parity shards, so that with every node healthy all
   ``k`` data shards are asked and the block is their concatenation (no decoding),
4. then by position.

The first ``fanout`` positions are asked at once, plus any slow node due for a probe (asked as
an extra, never in place of a healthy node). The rest are the reserve, asked only when the
first wave cannot give ``k`` shards of one version.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from client.node_health import SLOW_SCORE


@dataclass(frozen=True)
class ReadPlan:
    ask: tuple[int, ...]  # group positions asked at once
    reserve: tuple[int, ...]  # asked only if ``ask`` cannot give k shards of one version


def plan_read(
    k: int,
    fanout: int,
    suspect: Sequence[bool],
    late_scores: Sequence[float],
    probe: Sequence[bool],
) -> ReadPlan:
    """Rank the group's positions (see module doc); ``probe[i]`` adds slow node i as an extra."""

    def rank(i: int) -> tuple[bool, float, bool, int]:
        lateness = late_scores[i] if late_scores[i] > SLOW_SCORE else 0.0
        return suspect[i], lateness, i >= k, i

    order = sorted(range(len(suspect)), key=rank)
    ask = order[:fanout]
    extras = [i for i in order[fanout:] if probe[i] and not suspect[i]]
    reserve = [i for i in order[fanout:] if i not in extras]
    return ReadPlan(ask=tuple(ask + extras), reserve=tuple(reserve))


@functools.cache
def healthy_plan(k: int, fanout: int, num_members: int) -> ReadPlan:
    """The plan of a group whose members are all healthy: the same for every such group."""
    return plan_read(k, fanout, [False] * num_members, [0.0] * num_members, [False] * num_members)
