"""What a read decided for each key: a hit, a miss, or a timeout, told apart.

A miss (``None``) means the cluster answered and the block is not there (or fewer than k of its
shards are). A *timeout* means the deadline passed before that was decided: under overload a
block that exists can time out, and a caller that treats that as a miss recomputes for nothing
or, worse, concludes the data is gone. So the client keeps them apart::

    kv.get(key)                              -> bytes | None   (a timeout reads as None, as ever)
    kv.get(key, on_timeout="raise")          -> bytes | None   or raises kvstore.errors.Timeout
    kv.get_batch(keys, outcomes=True)        -> BatchResult(blocks, outcomes)
    kv.read_counters.num_timeouts                              (counted apart from num_misses)

``Timeout`` carries the keys that timed out and the batch's blocks (the hits still there).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, Timeout

ON_TIMEOUT = ("miss", "raise")


class Outcome(enum.Enum):
    HIT = "hit"
    MISS = "miss"  # decided: the block is not readable
    TIMEOUT = "timeout"  # the deadline passed first: the block may exist


@dataclass(frozen=True)
class BatchResult:
    """``get_batch(keys, outcomes=True)``: each key's block (None unless a hit) and outcome."""

    blocks: list[bytes | None]
    outcomes: list[Outcome]

    @classmethod
    def of(cls, blocks: Sequence[bytes | None], timed_out: Sequence[bool]) -> BatchResult:
        outcomes = [
            Outcome.HIT if b is not None else Outcome.TIMEOUT if t else Outcome.MISS
            for b, t in zip(blocks, timed_out, strict=True)
        ]
        return cls(list(blocks), outcomes)

    @property
    def timed_out(self) -> list[int]:
        """Positions of the keys that timed out."""
        return [i for i, o in enumerate(self.outcomes) if o is Outcome.TIMEOUT]


def check_on_timeout(on_timeout: str) -> None:
    if on_timeout not in ON_TIMEOUT:
        raise InvalidArgument(
            f"on_timeout={on_timeout!r}: pass 'miss' (a timeout reads as None) or 'raise' "
            "(kvstore.errors.Timeout)"
        )


def raise_timeouts(keys: Sequence[bytes], result: BatchResult, timeout_s: float) -> None:
    """Raise Timeout naming the keys the deadline left undecided (none: return)."""
    positions = result.timed_out
    if not positions:
        return
    named = ", ".join(keys[i].hex() for i in positions[:4])
    more = f" and {len(positions) - 4} more" if len(positions) > 4 else ""
    raise Timeout(
        f"{len(positions)} of {len(keys)} keys were not decided within {timeout_s:g} s (the "
        f"nodes did not answer in time; the blocks may exist): {named}{more}; retry, or raise "
        "timeout_s",
        keys=[keys[i] for i in positions],
        blocks=result.blocks,
    )
