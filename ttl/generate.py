"""``kvstore sim generate``: a seeded multi-day synthetic workload of chat and agent sessions.

The model (every number is a flag; defaults in ``WorkloadParams``):

* Arrivals: sessions of each class start as a Poisson process whose rate follows a daily
  cycle, ``rate(t) = sessions_per_day x (1 + diurnal_amplitude x sin(2 pi t / 1 day))``.
* System prompts: each class has a pool of prompts of lognormal length; a session picks one
  with Zipf popularity (``prompt_zipf``), so popular prompts are shared by many sessions.
* Chat: a session is a number of visits (geometric, mean ``chat_visits``); a visit is a few
  turns (geometric, mean ``chat_turns``) apart by think times (lognormal, median
  ``chat_think_s``); visits are apart by return gaps (lognormal, median ``chat_return_h`` hours,
  sigma ``chat_return_sigma``): most users come back within hours, a long tail after days.
* Agent: a session is a few bursts (geometric, mean ``agent_bursts``) apart by gaps (lognormal,
  median ``agent_burst_gap_h`` hours); a burst is many tool-call turns (geometric, mean
  ``agent_turns``) apart by tool run times (lognormal, median ``agent_tool_s``).
* Context: a request's input is the whole conversation so far: system prompt, task, every
  earlier message and reply. Chat turns add a user message and the reply; agent turns add the
  model's tool call and the tool's result; a later agent burst adds a follow-up instruction.
  Message lengths are lognormal (sigma ``message_sigma``). When the context would pass
  ``max_context_tokens`` it is compacted: it restarts from the system prompt plus a summary of
  ``summary_tokens`` (all new blocks after the prompt).
* Blocks: ``hash_ids`` cover the full ``block_tokens`` blocks of the input (the partial tail
  block is never cached). A prompt's blocks are shared by every session that uses it; the
  block that straddles the prompt's end and every later block belong to the session.

Output: Mooncake JSONL sorted by time (``timestamp`` in ms, ``input_length``,
``output_length``, ``class``, ``hash_ids``; ids chained, as Mooncake's). The same parameters
and seed give a byte-identical file.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ttl.traces import Trace, trace_from_records
from ttl.units import DAY_S

CHAT, AGENT = "chat", "agent"


def _param(default: float | int, help_: str) -> float | int:
    return field(default=default, metadata={"help": help_})


@dataclass(frozen=True)
class WorkloadParams:
    days: float = _param(14.0, "trace length in days")
    seed: int = _param(0, "random seed: the same seed gives a byte-identical trace")
    block_tokens: int = _param(128, "tokens per KV block (hash_ids cover full blocks)")
    chat_sessions_per_day: float = _param(1500.0, "mean chat sessions started per day")
    agent_sessions_per_day: float = _param(150.0, "mean agent sessions started per day")
    diurnal_amplitude: float = _param(0.5, "daily swing of the arrival rate, 0..1")
    chat_prompts: int = _param(40, "distinct chat system prompts")
    agent_prompts: int = _param(10, "distinct agent system prompts (with tool definitions)")
    prompt_zipf: float = _param(1.1, "Zipf exponent of system-prompt popularity")
    chat_prompt_tokens: float = _param(1200.0, "median chat system prompt length (tokens)")
    agent_prompt_tokens: float = _param(6000.0, "median agent system prompt length (tokens)")
    prompt_sigma: float = _param(0.5, "lognormal sigma of system prompt lengths")
    chat_visits: float = _param(3.0, "mean visits per chat session (geometric)")
    chat_turns: float = _param(3.0, "mean turns per chat visit (geometric)")
    chat_think_s: float = _param(60.0, "median seconds between turns of one visit")
    chat_return_h: float = _param(8.0, "median hours between visits of a chat session")
    chat_return_sigma: float = _param(1.6, "lognormal sigma of chat return gaps (the tail)")
    chat_user_tokens: float = _param(150.0, "median user message length (tokens)")
    chat_reply_tokens: float = _param(350.0, "median chat reply length (tokens)")
    agent_task_tokens: float = _param(400.0, "median agent task / follow-up length (tokens)")
    agent_bursts: float = _param(2.0, "mean bursts per agent session (geometric)")
    agent_burst_gap_h: float = _param(3.0, "median hours between bursts of an agent session")
    agent_burst_gap_sigma: float = _param(1.0, "lognormal sigma of agent burst gaps")
    agent_turns: float = _param(15.0, "mean tool-call turns per burst (geometric)")
    agent_tool_s: float = _param(6.0, "median seconds between tool-call turns")
    agent_call_tokens: float = _param(120.0, "median tool call (model output) length (tokens)")
    agent_tool_tokens: float = _param(500.0, "median tool result length (tokens)")
    message_sigma: float = _param(0.8, "lognormal sigma of message lengths and waits")
    max_context_tokens: int = _param(65536, "context length that triggers compaction")
    summary_tokens: int = _param(1500, "summary length after compaction (tokens)")

    def __post_init__(self) -> None:
        if self.days <= 0 or self.block_tokens < 1:
            raise ValueError("days must be > 0 and block_tokens >= 1")
        if self.chat_prompts < 1 or self.agent_prompts < 1:
            raise ValueError("chat_prompts and agent_prompts must be >= 1")
        means = (self.chat_visits, self.chat_turns, self.agent_bursts, self.agent_turns)
        if min(means) < 1:
            raise ValueError("chat_visits, chat_turns, agent_bursts, agent_turns are means >= 1")
        if not 0 <= self.diurnal_amplitude <= 1:
            raise ValueError(f"diurnal_amplitude must be in [0, 1], got {self.diurnal_amplitude}")
        if self.max_context_tokens <= self.summary_tokens:
            raise ValueError("max_context_tokens must exceed summary_tokens")


# t_ms, class, input tokens, output tokens, prompt base id, shared blocks, base id, blocks
Request = tuple[int, str, int, int, int, int, int, int]


class _Ids:
    """Hands out ranges of fresh block ids."""

    def __init__(self) -> None:
        self.next_id = 0

    def take(self, count: int) -> int:
        first, self.next_id = self.next_id, self.next_id + count
        return first


@dataclass(frozen=True)
class _Prompt:
    tokens: int
    base_id: int


class _Context:
    """One conversation's growing context; block ``i`` past the shared prompt blocks is
    ``epoch base + i``, where a compaction starts a new epoch (bases assigned at the end)."""

    def __init__(self, prompt: _Prompt, params: WorkloadParams) -> None:
        self.prompt, self.params = prompt, params
        self.tokens = prompt.tokens
        self.epoch_blocks = [0]  # most blocks used per epoch
        self.pending: list[tuple[float, str, int, int, int, int]] = []

    def add(self, num_tokens: int) -> None:
        if self.tokens + num_tokens > self.params.max_context_tokens:
            self.tokens = self.prompt.tokens + self.params.summary_tokens
            self.epoch_blocks.append(0)
        self.tokens += num_tokens

    def request(self, time_s: float, traffic_class: str, output_tokens: int) -> None:
        num_blocks = self.tokens // self.params.block_tokens
        epoch = len(self.epoch_blocks) - 1
        self.epoch_blocks[epoch] = max(self.epoch_blocks[epoch], num_blocks)
        self.pending.append((time_s, traffic_class, self.tokens, output_tokens, epoch, num_blocks))

    def finish(self, ids: _Ids) -> list[Request]:
        bases = [ids.take(n) for n in self.epoch_blocks]
        shared = self.prompt.tokens // self.params.block_tokens
        return [
            (
                round(t * 1000),
                cls,
                num_in,
                num_out,
                self.prompt.base_id,
                min(shared, n),
                bases[e],
                n,
            )
            for t, cls, num_in, num_out, e, n in self.pending
        ]


class _Generator:
    def __init__(self, params: WorkloadParams) -> None:
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self.ids = _Ids()
        self.horizon_s = params.days * DAY_S

    def lognormal(self, median: float, sigma: float | None = None) -> float:
        sigma = self.p.message_sigma if sigma is None else sigma
        return median * math.exp(sigma * self.rng.standard_normal())

    def tokens(self, median: float) -> int:
        return max(1, round(self.lognormal(median)))

    def count(self, mean: float) -> int:
        return int(self.rng.geometric(1.0 / mean))

    def prompts(self, num: int, median_tokens: float) -> list[_Prompt]:
        prompts = []
        for _ in range(num):
            tokens = max(1, round(self.lognormal(median_tokens, self.p.prompt_sigma)))
            prompts.append(_Prompt(tokens, self.ids.take(tokens // self.p.block_tokens)))
        return prompts

    def starts(self, per_day: float) -> np.ndarray:
        """Session start times: a Poisson process with a daily cycle (by thinning)."""
        amplitude = self.p.diurnal_amplitude
        num = self.rng.poisson(per_day * self.p.days * (1 + amplitude))
        times = np.sort(self.rng.uniform(0.0, self.horizon_s, num))
        accept = (1 + amplitude * np.sin(2 * np.pi * times / DAY_S)) / (1 + amplitude)
        return times[self.rng.uniform(size=num) < accept]

    def pick(self, prompts: list[_Prompt]) -> _Prompt:
        weights = 1.0 / np.arange(1, len(prompts) + 1) ** self.p.prompt_zipf
        return prompts[self.rng.choice(len(prompts), p=weights / weights.sum())]

    def chat_session(self, start_s: float, prompt: _Prompt) -> list[Request]:
        p, context, time_s = self.p, _Context(prompt, self.p), start_s
        for visit in range(self.count(p.chat_visits)):
            if visit:
                time_s += self.lognormal(p.chat_return_h * 3600, p.chat_return_sigma)
            for turn in range(self.count(p.chat_turns)):
                time_s += self.lognormal(p.chat_think_s) if turn else 0.0
                if time_s >= self.horizon_s:
                    return context.finish(self.ids)
                context.add(self.tokens(p.chat_user_tokens))
                reply = self.tokens(p.chat_reply_tokens)
                context.request(time_s, CHAT, reply)
                context.add(reply)
        return context.finish(self.ids)

    def agent_session(self, start_s: float, prompt: _Prompt) -> list[Request]:
        p, context, time_s = self.p, _Context(prompt, self.p), start_s
        for burst in range(self.count(p.agent_bursts)):
            if burst:
                time_s += self.lognormal(p.agent_burst_gap_h * 3600, p.agent_burst_gap_sigma)
            context.add(self.tokens(p.agent_task_tokens))
            for turn in range(self.count(p.agent_turns)):
                time_s += self.lognormal(p.agent_tool_s) if turn else 0.0
                if time_s >= self.horizon_s:
                    return context.finish(self.ids)
                call = self.tokens(p.agent_call_tokens)
                context.request(time_s, AGENT, call)
                context.add(call + self.tokens(p.agent_tool_tokens))
        return context.finish(self.ids)

    def sessions(self, progress: Progress | None = None) -> list[list[Request]]:
        """Every session's requests, sessions in order of their start; ``progress`` sees
        (sessions done, sessions in all) every 1,024 sessions."""
        p = self.p
        chat_prompts = self.prompts(p.chat_prompts, p.chat_prompt_tokens)
        agent_prompts = self.prompts(p.agent_prompts, p.agent_prompt_tokens)
        starts = [(t, True) for t in self.starts(p.chat_sessions_per_day)]
        starts += [(t, False) for t in self.starts(p.agent_sessions_per_day)]
        starts.sort()
        sessions = []
        for start_s, is_chat in starts:
            if progress is not None and not len(sessions) % 1024:
                progress(len(sessions), len(starts))
            sessions.append(
                self.chat_session(start_s, self.pick(chat_prompts))
                if is_chat
                else self.agent_session(start_s, self.pick(agent_prompts))
            )
        if progress is not None:
            progress(len(sessions), len(starts))
        return sessions

    def requests(self, progress: Progress | None = None) -> list[Request]:
        """Every request of every session, sorted by time (stable: session order on ties)."""
        requests = [request for session in self.sessions(progress) for request in session]
        requests.sort(key=operator.itemgetter(0))
        return requests


Progress = Callable[[int, int], None]  # (sessions generated, sessions in all)


def generate_requests(params: WorkloadParams, progress: Progress | None = None) -> list[Request]:
    """The workload's requests in time order (see the module docstring for the model)."""
    return _Generator(params).requests(progress)


def request_hash_ids(request: Request) -> itertools.chain[int]:
    """Block ids of a request: the shared prompt blocks, then the session's own blocks."""
    _, _, _, _, prompt_base, num_shared, base, num_blocks = request
    return itertools.chain(
        range(prompt_base, prompt_base + num_shared), range(base + num_shared, base + num_blocks)
    )


def generate_trace(params: WorkloadParams) -> Trace:
    """The workload as a ``Trace`` in memory (what loading ``write_workload``'s file gives)."""
    records = []
    for request in generate_requests(params):
        t_ms, traffic_class, num_in, num_out = request[:4]
        ids = list(request_hash_ids(request))
        records.append((t_ms / 1000.0, traffic_class, num_in, num_out, ids))
    return trace_from_records(records, params.block_tokens, chain=False)


def write_workload(
    params: WorkloadParams, path: str | Path, progress: Progress | None = None
) -> int:
    """Write the workload as Mooncake JSONL with a ``class`` field; return the request count."""
    requests = generate_requests(params, progress)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for request in requests:
            t_ms, traffic_class, num_in, num_out = request[:4]
            ids = ",".join(map(str, request_hash_ids(request)))
            f.write(
                f'{{"timestamp": {t_ms}, "input_length": {num_in}, "output_length": {num_out}, '
                f'"class": "{traffic_class}", "hash_ids": [{ids}]}}\n'
            )
    return len(requests)


def write_session_files(
    params: WorkloadParams, folder: str | Path, progress: Progress | None = None
) -> int:
    """Write the workload as session files, one JSON document per conversation
    (``ttl.traces`` format ``sessions``); return the request count. Session ids are local to
    a file, so system prompts are no longer shared across sessions: a loader benchmark."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    num_requests = 0
    for index, session in enumerate(_Generator(params).sessions(progress)):
        if not session:
            continue
        start_ms = session[0][0]
        doc = {
            "block_size": params.block_tokens,
            "t": start_ms / 1000.0,
            "class": session[0][1],
            "requests": [_session_request(request, start_ms) for request in session],
        }
        (folder / f"session-{index:07d}.json").write_text(json.dumps(doc))
        num_requests += len(session)
    return num_requests


def _session_request(request: Request, start_ms: int) -> dict:
    t_ms, _, num_in, num_out = request[:4]
    return {
        "t": (t_ms - start_ms) / 1000.0,
        "in": num_in,
        "out": num_out,
        "hash_ids": list(request_hash_ids(request)),
    }
