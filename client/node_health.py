"""What a client believes about one node: down (suspect) or slow, and when to try it again.

Pure code: time comes in as ``now_s`` (monotonic seconds), so tests drive it directly.

* **Suspect.** A failed RPC (unreachable, deadline, internal error) makes the node suspect for
  ``2 s``, doubling on each consecutive failed probe up to ``30 s`` (failures while it is
  suspect belong to the same outage and do not lengthen it). Reads skip suspect nodes; when
  the window passes, the next request is the probe: success clears the state, failure doubles
  the window.
* **Overloaded.** A node that shed a request (RESOURCE_EXHAUSTED, kvstore/node/admission.py)
  is suspect for ``OVERLOAD_MIN_S``, doubling on each consecutive shed up to
  ``OVERLOAD_MAX_S``: the client backs off from it, and reads ask the other nodes meanwhile.
* **Slow.** After a read finishes early, every asked node that had not answered yet was
  *late*. ``late_score`` is an exponential moving average of lateness. A healthy node among the
  11 asked is late about 1 read in 11 (score ~0.1); a straggler is late every time (score -> 1).
  Above ``SLOW_SCORE`` the node is slow: reads ask the other nodes instead and add the slow one
  only as an extra, every ``PROBE_EVERY``-th read, to notice when it recovers.
"""

from __future__ import annotations

from dataclasses import dataclass

SUSPECT_MIN_S = 2.0
SUSPECT_MAX_S = 30.0
OVERLOAD_MIN_S = 0.1
OVERLOAD_MAX_S = 2.0
LATE_ALPHA = 0.2  # weight of the newest lateness observation
SLOW_SCORE = 0.5
PROBE_EVERY = 32  # a slow node is asked as an extra once per this many reads that skip it


@dataclass
class NodeHealth:
    suspect_until_s: float = 0.0
    suspect_window_s: float = 0.0  # 0 = not failing; else the window of the last failure
    late_score: float = 0.0
    num_skipped: int = 0  # reads that skipped this node while slow, since its last probe

    def is_suspect(self, now_s: float) -> bool:
        return now_s < self.suspect_until_s

    def record_failure(self, now_s: float) -> None:
        """An RPC to the node failed: suspect it, for twice as long as last time. Failures
        while it is suspect already (concurrent calls, a put retrying it) are the same
        outage: they do not lengthen the window, or a put retrying a node that restarts
        would keep reads off it for 30 s after it is back."""
        if self.is_suspect(now_s) and self.suspect_window_s >= SUSPECT_MIN_S:
            return
        self.suspect_window_s = min(SUSPECT_MAX_S, max(SUSPECT_MIN_S, 2 * self.suspect_window_s))
        self.suspect_until_s = now_s + self.suspect_window_s

    def record_overload(self, now_s: float) -> None:
        """The node shed a request: back off from it, briefly (it is up, only busy)."""
        window_s = min(OVERLOAD_MAX_S, max(OVERLOAD_MIN_S, 2 * self.suspect_window_s))
        self.suspect_window_s = window_s
        self.suspect_until_s = max(self.suspect_until_s, now_s + window_s)

    def record_success(self) -> None:
        self.suspect_window_s = 0.0
        self.suspect_until_s = 0.0

    def record_lateness(self, late: bool) -> None:
        self.late_score += LATE_ALPHA * (float(late) - self.late_score)

    @property
    def is_slow(self) -> bool:
        return self.late_score > SLOW_SCORE

    def take_probe(self) -> bool:
        """For a slow node a read is skipping: True once every PROBE_EVERY calls."""
        self.num_skipped += 1
        if self.num_skipped < PROBE_EVERY:
            return False
        self.num_skipped = 0
        return True
