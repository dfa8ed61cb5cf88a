"""Fetch-or-compute: is swapping cached blocks in faster than recomputing them?

Pure code: no clock, no I/O, no torch. The connector times what it does and feeds the
observations in; the model keeps exponentially weighted moving averages (EWMA) of

* ``fetch_latency_s``: fixed cost of a fetch (one round trip: measured on fetches that found
  nothing, which move no bytes),
* ``fetch_bytes_per_s``: bandwidth of ``get_into`` fetches beyond that latency,
* ``compute_tokens_per_s``: prefill compute rate (tokens per second of forward passes),

and predicts ``fetch_s(n) = latency + n * block_bytes / bandwidth`` against
``compute_s(n) = n * block_tokens / rate``.

Compute and load at once (after "Compute Or Load KV Cache? Why Not Both?", Cake): the engine
can compute the first ``c`` cached blocks from the front while it fetches the other ``N - c``
from the store, and then compute the rest of the prompt over both. The plan picks the ``c``
(a whole number of prefill chunks) that minimises ``max(compute_s(c), fetch_s(N - c))``: ``c =
0`` when the store is fast (fetch everything), ``c = N`` when it is hopelessly slow (compute
everything), and in between they meet in the middle. A cached prefill is then never
predicted slower than either alone. Until a fetch has been observed, the model fetches
everything (exploration: the priors are guesses).

The compute rate is an average over whole prefills, so it slightly overstates the cost of
recomputing a prefix (early tokens attend to fewer keys); that biases towards fetching,
which the deadline bounds.

Every fetch gets a deadline: the predicted time to compute the same tokens, clamped to
``[min_deadline_s, max_deadline_s]``. A fetch that runs past it has already cost what
computing would have, so the connector stops waiting and computes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FetchPlan:
    num_blocks: int  # cached blocks to fetch, from first_block on (0: compute everything)
    deadline_s: float  # give up on the fetch after this long
    predicted_fetch_s: float
    predicted_compute_s: float  # time to compute those blocks' tokens instead
    first_block: int = 0  # blocks [0, first_block) are computed while the rest is fetched


@dataclass
class FetchCostModel:
    """EWMA estimates of fetch and compute speed and the fetch plan they imply."""

    min_deadline_s: float = 0.05
    max_deadline_s: float = 2.0
    ewma_weight: float = 0.3  # weight of the newest observation
    fetch_latency_s: float = 0.002  # prior: loopback gRPC round trip
    fetch_bytes_per_s: float = 1e9  # prior: a local cluster
    compute_tokens_per_s: float = 1e3  # prior: a small model on a CPU
    num_fetches: int = 0
    num_computes: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.ewma_weight <= 1:
            raise ValueError(f"ewma_weight must be in (0, 1], got {self.ewma_weight}")
        if not 0 < self.min_deadline_s <= self.max_deadline_s:
            raise ValueError("need 0 < min_deadline_s <= max_deadline_s")

    def observe_latency(self, seconds: float) -> None:
        """A metadata round trip (e.g. ``match_prefix``) took ``seconds``."""
        self.fetch_latency_s = self._ewma(self.fetch_latency_s, max(seconds, 0.0))

    def observe_fetch(self, num_bytes: int, seconds: float) -> None:
        """A completed fetch moved ``num_bytes`` in ``seconds`` (latency included)."""
        if num_bytes <= 0:
            return
        transfer_s = max(seconds - self.fetch_latency_s, seconds / 2, 1e-6)
        self.fetch_bytes_per_s = self._ewma(self.fetch_bytes_per_s, num_bytes / transfer_s)
        self.num_fetches += 1

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """Forward passes over ``num_tokens`` tokens took ``seconds``."""
        if num_tokens <= 0 or seconds <= 0:
            return
        self.compute_tokens_per_s = self._ewma(self.compute_tokens_per_s, num_tokens / seconds)
        self.num_computes += 1

    def fetch_s(self, num_blocks: int, block_bytes: int) -> float:
        return self.fetch_latency_s + num_blocks * block_bytes / self.fetch_bytes_per_s

    def compute_s(self, num_tokens: int) -> float:
        return num_tokens / self.compute_tokens_per_s

    def plan(
        self,
        num_cached_blocks: int,
        block_tokens: int,
        block_bytes: int,
        always: bool = False,
        chunk_blocks: int = 1,
    ) -> FetchPlan:
        """Which of the ``num_cached_blocks`` leading blocks to fetch and which to compute
        meanwhile (whole chunks of ``chunk_blocks``), and the fetch's deadline (module doc).

        ``always`` fetches everything whatever the prediction, with the longest deadline (a
        decode worker must swap the KV in; a benchmark measures the swap-in).
        """
        first_block = 0
        if not always and self.num_fetches:
            candidates = sorted({*range(0, num_cached_blocks, chunk_blocks), num_cached_blocks})
            first_block = min(
                candidates,
                key=lambda c: self._overlapped_s(c, num_cached_blocks, block_tokens, block_bytes),
            )
        num_blocks = num_cached_blocks - first_block
        fetch_s = self.fetch_s(num_blocks, block_bytes) if num_blocks else 0.0
        compute_s = self.compute_s(num_blocks * block_tokens)
        deadline_s = min(max(compute_s, self.min_deadline_s), self.max_deadline_s)
        if always:
            deadline_s = self.max_deadline_s
        return FetchPlan(num_blocks, deadline_s, fetch_s, compute_s, first_block)

    def _overlapped_s(
        self, first_block: int, num_cached_blocks: int, block_tokens: int, block_bytes: int
    ) -> float:
        """Predicted time until blocks [0, N) are all in the cache, computing the first
        ``first_block`` while fetching the others."""
        num_fetched = num_cached_blocks - first_block
        fetch_s = self.fetch_s(num_fetched, block_bytes) if num_fetched > 0 else 0.0
        return max(self.compute_s(first_block * block_tokens), fetch_s)

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.ewma_weight) * old + self.ewma_weight * new
