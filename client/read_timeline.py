"""A per-stage timeline of batch reads: who did what when, for ``kvstore bench swapin``.

Off by default (``KVClient.timeline`` is None): then nothing is recorded. Given one, every
batch read appends spans to it, all on one clock, CLOCK_MONOTONIC (``time.monotonic_ns``),
which every process of a host shares, so a local node's own read times line up with the
client's::

    lane            what        from ... to
    node <id>       request     the client sent its READ ... the event loop took the answer
    node <id>       queue       the client sent its READ ... the node started reading it
    node <id>       read        the node's read loop (local channel: the node's own clock)
    node <id>       land        the client's receiver thread landing the answer
    client          wait        the event loop waiting for node answers (idle, or other work)
    client          tally       the event loop counting one node answer's shards
    client          check       a block check of the blocks just completed (decode pool)
    client          stop        cancelling the requests still out
    client          decode      the final block pass (and any parity rebuild)
    client          <caller>    whatever the caller adds (the bench: chunk, swap-in)

Per batch read the spans are O(nodes): one request, read and land per node request, one
tally per answer, a wait per wake-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

CLIENT = "client"


@dataclass
class ReadTimeline:
    """Spans (lane, what, start ns, end ns) on CLOCK_MONOTONIC; ``start_ns`` is time zero."""

    start_ns: int = field(default_factory=time.monotonic_ns)
    spans: list[tuple[str, str, int, int]] = field(default_factory=list)

    def add(self, lane: str, what: str, start_ns: int, end_ns: int | None = None) -> None:
        """One span; ``end_ns`` defaults to now."""
        self.spans.append((lane, what, start_ns, time.monotonic_ns() if end_ns is None else end_ns))

    def rows(self) -> list[dict[str, float | str]]:
        """The spans in milliseconds from ``start_ns``, sorted by start (for JSON)."""
        zero = self.start_ns
        return [
            {
                "lane": lane,
                "what": what,
                "start_ms": round((start - zero) / 1e6, 3),
                "end_ms": round((end - zero) / 1e6, 3),
            }
            for lane, what, start, end in sorted(self.spans, key=lambda span: span[2])
        ]

    def stages_ms(self) -> dict[str, float]:
        """What the spans add up to, in ms: the first send to the last answer taken, the
        nodes' reads (the median node's span, and from the first read start to the last
        read end), the receivers' landing, and the client's waiting, tallying, checks."""
        by_what: dict[str, list[tuple[int, int]]] = {}
        for lane, what, start, end in self.spans:
            key = what if lane == CLIENT else f"node_{what}"
            by_what.setdefault(key, []).append((start, end))
        stages: dict[str, float] = {}
        requests = by_what.get("node_request", [])
        if requests:
            stages["first_send_to_last_answer"] = _ms(
                max(e for _, e in requests) - min(s for s, _ in requests)
            )
        reads = by_what.get("node_read", [])
        if reads:
            durations = sorted(e - s for s, e in reads)
            stages["node_read_median"] = _ms(durations[len(durations) // 2])
            stages["node_reads_first_to_last"] = _ms(
                max(e for _, e in reads) - min(s for s, _ in reads)
            )
        queued = sorted(e - s for s, e in by_what.get("node_queue", []))
        if queued:  # a READ's send to its node starting the read: the wake-up, queueing
            stages["node_queue_median"] = _ms(queued[len(queued) // 2])
        for name in ("node_land", "wait", "tally", "check", "stop", "decode"):
            spans = by_what.get(name)
            if spans:
                stages[f"{name}_sum"] = _ms(sum(e - s for s, e in spans))
        return stages


def _ms(ns: int) -> float:
    return round(ns / 1e6, 3)
