"""The prefill balancer: length buckets, a fitted prefill cost model, earliest-finish routing.

Pure code (no clock, no I/O): the router passes ``now_s`` and measured times in.

**Cost model.** A prefill that computes ``n_new`` tokens after ``n_cached`` tokens swapped
in from the store takes::

    t(n_new, n_cached) = a + b*n_new + c*((n_cached + n_new)^2 - n_cached^2) + d*n_cached

the quadratic ``a + b*n + c*n^2`` of a prompt of ``n`` computed tokens (the ``n^2`` is
attention), charged only for the positions actually computed, plus the fetch of the cached
ones. The four coefficients are fitted by least squares (non-negative) over the most recent
``window`` measured prefills of one worker, seeded by that worker's calibration run (a few
cold prefills of set lengths at start-up), which the window then ages out.

**Routing.** Each prefill worker serves its requests one at a time, in order. A worker's
backlog is the predicted time of the requests it holds, less what the running one has used.
A new request goes to the worker that would *finish* it soonest (backlog plus its predicted
cost on that worker), with no prefix affinity: the store is shared, so any worker hits any
prefix. Among workers that tie (within 5%), the one holding fewer requests of the same length bucket
wins, which spreads each bucket's long prompts over the workers.

**Late binding.** The router sends a worker at most the request it runs plus
``max_queued_per_worker`` more (default 1, so it never idles between two); later requests
wait at the router, in arrival order, and are assigned as workers make room. Each choice then
starts from where the workers really are, so a wrong prediction (a noisy calibration, a
worker slowed by its neighbours) costs one request, not a whole burst queued behind it.

**Buckets.** Prompt lengths are bucketed (default <16K, 16-64K, 64-256K, >=256K tokens):
the tie-break above, and the router's metrics per bucket.

**Chunk size.** :meth:`PrefillCostModel.chunk_tokens_for` solves the largest prefill chunk
(a multiple of the block size) whose step fits a time budget, even for the step that ends
at ``max_model_len`` (the dearest one: attention over the longest context).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("balanced", "least-loaded", "round-robin")  # the router's ways to pick a worker
DEFAULT_BUCKET_BOUNDS_TOKENS = (16_384, 65_536, 262_144)  # <16K, 16-64K, 64-256K, >=256K
DEFAULT_FIT_WINDOW = 256
TIE_TOLERANCE_S = 1e-3
TIE_TOLERANCE_FRACTION = 0.05  # finishes this close count as equal (calibration noise)


@dataclass(frozen=True)
class BalancerConfig:
    """How the router balances prefill work (``kvstore serve --bucket-bounds``)."""

    bucket_bounds_tokens: tuple[int, ...] = DEFAULT_BUCKET_BOUNDS_TOKENS
    fit_window: int = DEFAULT_FIT_WINDOW  # recent prefills per worker the model is fitted to
    # Requests a worker holds beyond the one it runs: enough that it never idles between
    # two; the rest wait at the router for late binding (see the module doc).
    max_queued_per_worker: int = 1

    def __post_init__(self) -> None:
        bounds = self.bucket_bounds_tokens
        if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] <= 0:
            raise ValueError(
                f"bucket_bounds_tokens={bounds}: give increasing positive token counts, "
                "e.g. 16384,65536,262144 for <16K, 16-64K, 64-256K, >=256K"
            )
        if self.max_queued_per_worker < 0:
            raise ValueError("max_queued_per_worker must be >= 0")
        if self.fit_window < 4:
            raise ValueError(f"fit_window={self.fit_window}: need >= 4 prefills to fit a, b, c, d")

    def bucket_of(self, num_tokens: int) -> int:
        """Index of ``num_tokens``'s bucket: 0 below the first bound, len(bounds) at the top."""
        return sum(num_tokens >= bound for bound in self.bucket_bounds_tokens)

    def bucket_names(self) -> list[str]:
        """Labels such as ``<16K``, ``16K-64K``, ``>=256K``."""
        names = [_tokens_label(b) for b in self.bucket_bounds_tokens]
        middle = [f"{lo}-{hi}" for lo, hi in itertools.pairwise(names)]
        return [f"<{names[0]}", *middle, f">={names[-1]}"]


def _tokens_label(num_tokens: int) -> str:
    return f"{num_tokens // 1024}K" if num_tokens % 1024 == 0 else str(num_tokens)


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill: tokens computed, tokens swapped in, seconds."""

    num_new_tokens: int
    num_cached_tokens: int
    seconds: float


def _features(num_new: int, num_cached: int) -> list[float]:
    end = num_cached + num_new
    return [1.0, float(num_new), float(end * end - num_cached * num_cached), float(num_cached)]


class PrefillCostModel:
    """``t(n_new, n_cached)`` of one worker, refitted on every observation (see module doc)."""

    def __init__(self, samples: Iterable[PrefillSample] = (), window: int = DEFAULT_FIT_WINDOW):
        self.samples: deque[PrefillSample] = deque(samples, maxlen=window)
        self.coefficients = (0.0, 0.0, 0.0, 0.0)  # a, b, c, d
        self.refit()

    def predict_s(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        features = _features(num_new_tokens, num_cached_tokens)
        return sum(k * x for k, x in zip(self.coefficients, features, strict=True))

    def observe(self, sample: PrefillSample) -> None:
        self.samples.append(sample)
        self.refit()

    def refit(self) -> None:
        """Non-negative least squares over the window (all 4-column subsets, best fit)."""
        if not self.samples:
            return
        x = np.array([_features(s.num_new_tokens, s.num_cached_tokens) for s in self.samples])
        y = np.array([s.seconds for s in self.samples])
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # n^2 reaches 1e11: condition it
        self.coefficients = tuple(_nonnegative_lstsq(x / scale, y) / scale)

    def chunk_tokens_for(self, budget_s: float, block_tokens: int, max_model_len: int) -> int:
        """Largest multiple of ``block_tokens`` whose prefill step ending at ``max_model_len``
        takes at most ``budget_s``; at least one block."""
        best = block_tokens
        for chunk in range(block_tokens, max_model_len + 1, block_tokens):
            if self.predict_s(chunk, max_model_len - chunk) > budget_s:
                break
            best = chunk
        return best


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||x k - y|| with k >= 0, exactly, by trying every set of free columns."""
    num_columns = x.shape[1]
    best, best_residual = np.zeros(num_columns), float(np.sum(y * y))
    for size in range(1, num_columns + 1):
        for columns in itertools.combinations(range(num_columns), size):
            k, *_ = np.linalg.lstsq(x[:, columns], y, rcond=None)
            if (k < 0).any():
                continue
            residual = float(np.sum((x[:, columns] @ k - y) ** 2))
            if residual < best_residual - 1e-15:
                best = np.zeros(num_columns)
                best[list(columns)] = k
                best_residual = residual
    return best


@dataclass
class _Held:
    request_id: str
    bucket: int
    predicted_s: float


@dataclass
class _WorkerQueue:
    """The requests the router has sent one worker, in the order the worker serves them."""

    model: PrefillCostModel
    held: list[_Held] = field(default_factory=list)
    head_started_s: float = 0.0  # when the worker (by our account) began the first held one

    def backlog_s(self, now_s: float) -> float:
        if not self.held:
            return 0.0
        head_left_s = max(self.held[0].predicted_s - (now_s - self.head_started_s), 0.0)
        return head_left_s + sum(h.predicted_s for h in self.held[1:])


class PrefillBalancer:
    """Earliest-finish assignment of prefill requests to workers (see the module doc)."""

    def __init__(self, config: BalancerConfig | None = None) -> None:
        self.config = config or BalancerConfig()
        self.queues: dict[str, _WorkerQueue] = {}
        self._turn = itertools.count()

    def add_worker(self, worker_id: str, calibration: Sequence[PrefillSample] = ()) -> None:
        """Track ``worker_id``, its cost model seeded by its calibration run."""
        if worker_id not in self.queues:
            model = PrefillCostModel(calibration, self.config.fit_window)
            self.queues[worker_id] = _WorkerQueue(model)

    def finish_s(self, worker_id: str, num_tokens: int, now_s: float) -> float:
        """When ``worker_id`` would finish a new cold prefill of ``num_tokens``."""
        queue = self.queues[worker_id]
        return now_s + queue.backlog_s(now_s) + queue.model.predict_s(num_tokens)

    def assign(
        self, request_id: str, num_tokens: int, now_s: float, candidates: Sequence[str]
    ) -> str:
        """The worker among ``candidates`` that finishes the request soonest; it now holds it.

        The prediction assumes nothing is cached (the router does not look the prefix up);
        :meth:`update` corrects it once the worker reports what it swapped in.
        """
        if not candidates:
            raise ValueError("assign() needs at least one candidate worker")
        bucket = self.config.bucket_of(num_tokens)
        turn = next(self._turn) % len(candidates)
        rotated = [*candidates[turn:], *candidates[:turn]]
        finish = {w: self.finish_s(w, num_tokens, now_s) for w in rotated}
        soonest = min(finish.values())
        tolerance_s = max(TIE_TOLERANCE_S, TIE_TOLERANCE_FRACTION * (soonest - now_s))
        tied = [w for w in rotated if finish[w] <= soonest + tolerance_s]
        worker_id = min(tied, key=lambda w: self._num_held(w, bucket))
        queue = self.queues[worker_id]
        if not queue.held:
            queue.head_started_s = now_s
        queue.held.append(_Held(request_id, bucket, queue.model.predict_s(num_tokens)))
        return worker_id

    def update(self, worker_id: str, request_id: str, num_new: int, num_cached: int) -> None:
        """The worker reported what it computed and swapped in: re-predict that request."""
        queue = self.queues[worker_id]
        for held in queue.held:
            if held.request_id == request_id:
                held.predicted_s = queue.model.predict_s(num_new, num_cached)

    def finish(
        self, worker_id: str, request_id: str, now_s: float, sample: PrefillSample | None = None
    ) -> None:
        """``request_id`` left ``worker_id`` (done, failed or retried elsewhere); a measured
        ``sample`` teaches the worker's model."""
        queue = self.queues[worker_id]
        index = next((i for i, h in enumerate(queue.held) if h.request_id == request_id), None)
        if index is None:
            return
        del queue.held[index]
        if index == 0:
            queue.head_started_s = now_s
        if sample is not None:
            queue.model.observe(sample)

    def has_room(self, worker_id: str) -> bool:
        """Whether ``worker_id`` holds fewer requests than it runs plus may queue."""
        return len(self.queues[worker_id].held) <= self.config.max_queued_per_worker

    def head_started_s(self, worker_id: str) -> float:
        return self.queues[worker_id].head_started_s

    def is_head(self, worker_id: str, request_id: str) -> bool:
        held = self.queues[worker_id].held
        return bool(held) and held[0].request_id == request_id

    def _num_held(self, worker_id: str, bucket: int) -> int:
        return sum(h.bucket == bucket for h in self.queues[worker_id].held)


def list_schedule_makespan_s(durations_s: Sequence[float], num_workers: int) -> float:
    """Makespan of the longest-first offline assignment (LPT, within 4/3 of optimal)."""
    loads = [0.0] * num_workers
    for duration in sorted(durations_s, reverse=True):
        loads[loads.index(min(loads))] += duration
    return max(loads)


def makespan_lower_bound_s(durations_s: Sequence[float], num_workers: int) -> float:
    """No assignment finishes sooner: a perfect split of the work, or the longest request."""
    return max(sum(durations_s) / num_workers, max(durations_s, default=0.0))
