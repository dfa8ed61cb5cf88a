"""``kvstore bench serve --drop-after-first-token N``: the issue-42 loop against a real
``kvstore serve``.

``N`` streamed chat requests, ``concurrency`` at a time, each hung up 0-50 ms after its first
token (the client closes the connection), as the API-key holder did who once wedged the
server for good. Every ``probe_every`` tries, and after the last, a probe: a one-token request
that must finish within ``probe_timeout_s``. A probe that does not is a wedge (the wedge was
permanent: every later request got its first token, then nothing until 504). The JSON counts
tries, drops that saw their first token, wedges, and the probes' latencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from typing import Any

DROP_MAX_TOKENS = 32  # long enough that the hang-up lands mid-decode
PROBE_TIMEOUT_S = 60.0


async def _drop_after_first_token(client: Any, model: str, rng: random.Random) -> int | bool:
    """One streamed request hung up 0-50 ms after its first token: True if it saw one, False
    if it ended first, its HTTP status if refused (429 under serve's default queue limits:
    run with ``--serve-args "--max-waiting-requests 0 --max-queue-wait-s 0"`` to drop them all)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Tell me about item {rng.randrange(10**6)}."}],
        "max_tokens": DROP_MAX_TOKENS,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code
        async for line in response.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                await asyncio.sleep(rng.uniform(0.0, 0.05))
                return True  # leaving the block closes the connection mid-stream
    return False


async def _probe(client: Any, model: str, timeout_s: float) -> float | None:
    """Seconds a one-token request took, or None if it did not finish in ``timeout_s``."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    start_s = time.monotonic()
    try:
        response = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), timeout_s)
    except (TimeoutError, OSError):
        return None
    return time.monotonic() - start_s if response.status_code == 200 else None


async def drops(
    base_url: str,
    model: str,
    num_tries: int,
    *,
    concurrency: int = 4,
    probe_every: int = 50,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the loop (see the module doc); the report."""
    import httpx

    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    num_first_tokens, probes_s, wedges, refused = 0, [], [], Counter()

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal num_first_tokens
        # A refused or broken connection is not a wedge: the probes decide.
        async with gate:
            with contextlib.suppress(httpx.HTTPError):
                outcome = await _drop_after_first_token(client, model, rng)
                if outcome is True:
                    num_first_tokens += 1
                elif outcome is not False:
                    refused[str(outcome)] += 1

    start_s = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=probe_timeout_s) as client:
        for first in range(0, num_tries, probe_every):
            batch = range(first, min(first + probe_every, num_tries))
            await asyncio.gather(*(one(client) for _ in batch))
            probe_s = await _probe(client, model, probe_timeout_s)
            if probe_s is None:
                wedges.append(batch.stop)
            else:
                probes_s.append(probe_s)
    return {
        "tries": num_tries,
        "concurrency": concurrency,
        "dropped_after_first_token": num_first_tokens,
        "refused_by_status": dict(refused),
        "probes": len(probes_s) + len(wedges),
        "wedges": len(wedges),
        "wedged_after_tries": wedges,
        "probe_p50_s": sorted(probes_s)[len(probes_s) // 2] if probes_s else None,
        "probe_max_s": max(probes_s, default=None),
        "seconds": time.monotonic() - start_s,
    }
