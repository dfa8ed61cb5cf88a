"""``kvstore bench serve --flood N`` and ``--slow-sockets N``: the HTTP front of a real
``kvstore serve`` (its defaults) under a flood of chat requests and under slow clients.

Flood: ``N`` chat requests sent at once through the official ``openai`` client (no
retries). The contract: every request gets 200, 429 or 503 within its deadline (the serve
default, ``--request-timeout-s``) plus 1 s; none hangs to 504; ``/health`` agrees with what a
request arriving at the same moment gets (a prober asks ``/health`` and sends a one-token
request right after, every ``--probe-interval-s``: 200 from ``/health`` should mean the probe
was queued, 503 that it was refused at once with 429 ``queue_full``/``queue_wait`` or 503);
the JSON counts each status and error code and says which requests broke the contract.

Slow sockets: ``N`` connections that never finish their headers (half of them) or send a
body at one byte a second (the other half), opened together, while a client sends ordinary
one-token completions one after another. The JSON says how many the server closed, how long
after its timeout (header or body) each was closed, and the ordinary requests' latency before
and during (their ratio is the figure: measured side by side in one run).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from engine_adapter.serving.admission import DEFAULT_TIMEOUT_S
from engine_adapter.serving.http_limits import FrontLimits

CONTRACT_SLACK_S = 1.0  # the flood contract: an answer within the deadline plus this
SOCKET_SLACK_S = 2.0  # a slow socket counts as closed in time within its timeout plus this
REFUSED_AT_ONCE = {"queue_full", "queue_wait", "no_worker", "connection_limit"}
SYSTEM = (
    "You are the support desk of Acme Cloud. Answer in one short sentence. Acme Cloud runs "
    "data centres in Frankfurt, Virginia and Singapore; backups are kept thirty days."
)
TOPICS = ("backups", "regions", "API keys", "billing", "uptime", "support hours", "quotas")


@dataclass
class Outcome:
    """One request's answer as its client saw it."""

    status: int  # HTTP status; 0: no answer (connection error or client timeout)
    code: str  # the error body's code ("" for 200)
    seconds: float  # from sending to the whole answer
    retry_after: str = ""  # the Retry-After header of a 429/503

    @property
    def refused_at_once(self) -> bool:
        return self.code in REFUSED_AT_ONCE


def _client(base_url: str, timeout_s: float) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s
    )


async def chat_once(client: Any, model: str, question: str, max_tokens: int) -> Outcome:
    """One chat request; its status, code and time (errors are outcomes, not exceptions)."""
    import openai

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    start_s = time.monotonic()
    try:
        await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        code = str((body.get("error") or body).get("code") or "")
        retry = exc.response.headers.get("retry-after", "")
        return Outcome(exc.status_code, code, time.monotonic() - start_s, retry)
    except (openai.APIConnectionError, openai.APITimeoutError) as exc:
        return Outcome(0, type(exc).__name__, time.monotonic() - start_s)
    return Outcome(200, "", time.monotonic() - start_s)


def questions(num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Question {i}: how do {rng.choice(TOPICS)} work for team {rng.randrange(10**6)}?"
            for i in range(num)]  # fmt: skip


async def flood(
    base_url: str,
    model: str,
    num_requests: int,
    max_tokens: int,
    deadline_s: float = DEFAULT_TIMEOUT_S,
    probe_interval_s: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Send ``num_requests`` chat requests at once, probe ``/health`` meanwhile; the record."""
    import httpx

    client = _client(base_url, deadline_s + 60.0)
    done = asyncio.Event()
    probes: list[tuple[float, int, asyncio.Task[Outcome]]] = []

    async def prober(http: httpx.AsyncClient, start_s: float) -> None:
        while not done.is_set():
            health = await http.get(f"{base_url}/health")
            probe = chat_once(client, model, "Probe: say hi.", 1)
            probes.append((time.monotonic() - start_s, health.status_code,
                           asyncio.create_task(probe)))  # fmt: skip
            await asyncio.sleep(probe_interval_s)

    start_s = time.monotonic()
    async with httpx.AsyncClient(timeout=30.0) as http:
        probing = asyncio.create_task(prober(http, start_s))
        tasks = [chat_once(client, model, q, max_tokens) for q in questions(num_requests, seed)]
        outcomes = await asyncio.gather(*tasks)
        done.set()
        await probing
        probe_outcomes = await asyncio.gather(*(task for _, _, task in probes))
    await client.close()
    return _flood_record(outcomes, probes, probe_outcomes, deadline_s, time.monotonic() - start_s)


def _flood_record(
    outcomes: list[Outcome],
    probes: list[tuple[float, int, Any]],
    probe_outcomes: list[Outcome],
    deadline_s: float,
    elapsed_s: float,
) -> dict[str, Any]:
    late = [o for o in outcomes if o.seconds > deadline_s + CONTRACT_SLACK_S]
    bad = [o for o in outcomes if o.status not in (200, 429, 503)]
    agreement = Counter(
        ("ready" if health == 200 else "unready", "refused" if o.refused_at_once else "taken")
        for (_, health, _), o in zip(probes, probe_outcomes, strict=True)
    )
    matching = agreement[("ready", "taken")] + agreement[("unready", "refused")]
    return {
        "num_requests": len(outcomes),
        "deadline_s": deadline_s,
        "elapsed_s": elapsed_s,
        "status_counts": {
            str(k): v for k, v in sorted(Counter(o.status for o in outcomes).items())
        },
        "code_counts": dict(sorted(Counter(o.code or "ok" for o in outcomes).items())),
        "seconds_by_status": {
            str(status): _summary([o.seconds for o in outcomes if o.status == status])
            for status in sorted({o.status for o in outcomes})
        },
        "num_late": len(late),
        "num_bad_status": len(bad),
        "num_504": sum(o.status == 504 for o in outcomes),
        "num_refusals_without_retry_after": sum(
            o.status in (429, 503) and not o.retry_after for o in outcomes
        ),
        "contract_met": not late and not bad,
        "health_probes": len(probes),
        "health_agreement": {f"{h}/{p}": n for (h, p), n in sorted(agreement.items())},
        "health_agreement_ratio": matching / len(probes) if probes else None,
        "health_timeline": [
            (round(t, 2), health, asdict(o))
            for (t, health, _), o in zip(probes, probe_outcomes, strict=True)
        ],
    }


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {
        "num": len(ordered),
        "min": ordered[0],
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
    }


async def slow_sockets(
    base_url: str,
    model: str,
    num_sockets: int,
    limits: FrontLimits,
    num_normal: int = 10,
) -> dict[str, Any]:
    """``num_sockets`` slow clients against the front while normal requests go on (module
    doc); the record."""
    host, _, port = base_url.removeprefix("http://").partition(":")
    client = _client(base_url, 120.0)

    async def normal_latencies() -> list[float]:
        seconds = []
        for index in range(num_normal):
            outcome = await chat_once(client, model, f"Normal question {index}?", 1)
            assert outcome.status == 200, f"a normal request got {outcome}"
            seconds.append(outcome.seconds)
        return seconds

    before = await normal_latencies()
    opened_s = time.monotonic()
    sockets = [
        asyncio.create_task(_slow_socket(host, int(port), index % 2 == 0, limits))
        for index in range(num_sockets)
    ]
    during = await normal_latencies()
    closes = await asyncio.gather(*sockets)
    await client.close()
    over_s = [seconds - timeout_s for seconds, timeout_s, _ in closes]
    return {
        "num_sockets": num_sockets,
        "header_timeout_s": limits.header_timeout_s,
        "body_timeout_s": limits.body_timeout_s,
        "num_closed_by_server": sum(closed for _, _, closed in closes),
        "closed_after_timeout_s": _summary(over_s),
        "all_closed": all(closed for *_, closed in closes),
        "all_closed_within_timeout_plus_2s": all(closed for *_, closed in closes)
        and max(over_s, default=0.0) <= SOCKET_SLACK_S,
        "normal_latency_before_s": _summary(before),
        "normal_latency_during_s": _summary(during),
        "normal_latency_ratio_p50": statistics.median(during) / statistics.median(before),
        "elapsed_s": time.monotonic() - opened_s,
    }


async def _slow_socket(
    host: str, port: int, headers_only: bool, limits: FrontLimits
) -> tuple[float, float, bool]:
    """One slow client: (seconds until the server closed it, its timeout, closed by the
    server at all within a bound)."""
    reader, writer = await asyncio.open_connection(host, port)
    start_s = time.monotonic()
    if headers_only:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # never finished
        timeout_s = limits.header_timeout_s
    else:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 4096\r\n\r\n")  # fmt: skip
        timeout_s = limits.body_timeout_s

    async def trickle() -> None:
        while not headers_only:
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(1.0)

    trickling = asyncio.create_task(trickle())
    bound_s = timeout_s + 60.0
    closed = True
    try:
        await asyncio.wait_for(reader.read(), bound_s)
    except (ConnectionError, OSError):
        pass  # reset: a byte sent after the server's close
    except TimeoutError:
        closed = False
    seconds = time.monotonic() - start_s
    trickling.cancel()
    await asyncio.gather(trickling, return_exceptions=True)
    writer.close()
    return seconds, timeout_s, closed


def load_average() -> list[float]:
    return list(os.getloadavg())


def start_serve(cluster_toml: str, run_dir: str, extra_args: list[str]) -> tuple[Any, str]:
    """``kvstore serve`` with its defaults (and ``extra_args``) on a free port: (process,
    base URL), once it serves. Its stderr (start-up stages, request log) goes to
    ``run_dir/serve.log``."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kvstore.cli", "serve", "--cluster", cluster_toml,
               "--port", "0", "--run-dir", run_dir, *extra_args]  # fmt: skip
    with open(Path(run_dir) / "serve.log", "ab") as log_file:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file, text=True)
    line = proc.stdout.readline()
    match = re.search(r"(http://[\d.]+:\d+)/v1", line)
    if not match:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"kvstore serve did not start ({line!r}); see {run_dir}/serve.log")
    return proc, match.group(1)


async def served_model(base_url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as http:
        reply = await http.get(f"{base_url}/v1/models", headers={"Authorization": "Bearer x"})
        return reply.json()["data"][0]["id"]


async def warm_up(base_url: str, model: str, num: int = 3) -> list[float]:
    """A few requests one after another (first-call costs; the queue's first estimates)."""
    client = _client(base_url, 300.0)
    seconds = [(await chat_once(client, model, f"Warm-up {i}?", 4)).seconds for i in range(num)]
    await client.close()
    return seconds


def flag_value(argv: list[str], flag: str, default: float) -> float:
    """A duration flag's value in ``argv`` (seconds), else ``default``."""
    from ttl.units import parse_duration_s

    if flag in argv and argv.index(flag) + 1 < len(argv):
        return parse_duration_s(argv[argv.index(flag) + 1])
    return default


def limits_of(argv: list[str]) -> FrontLimits:
    """The front's limits ``kvstore serve`` runs with, given these extra flags."""
    defaults = FrontLimits()
    return FrontLimits(
        header_timeout_s=flag_value(argv, "--header-timeout-s", defaults.header_timeout_s),
        body_timeout_s=flag_value(argv, "--body-timeout-s", defaults.body_timeout_s),
    )
