"""Prefill and decode worker processes: each loads the model and serves one gRPC service.

::

    python -m engine_adapter.workers prefill|decode --cluster DIR/cluster.toml --id p0
        [--model default] [--port 0] [--ready-file PATH] [--parent-pid PID]

The handoff, through the store::

    prefill worker                                        decode worker
    lookup + swap-in cached blocks, compute the rest
    sample the first token  --PrefillFirst-->  router
    put every new full block (awaited)
    tail KV, token ids      --Handoff------->  router --Decode(Handoff)-->  get_into each full
                                                                            block (a missing one
                                                                            is recomputed), load
                                                                            the tail KV, decode

A worker computes one request at a time on one compute thread (torch calls never block the
event loop, so Health answers while a prefill runs); requests queue on a lock. It writes
``--ready-file`` (JSON: id, role, address, pid, model fingerprint) once it serves, and exits
on SIGTERM/SIGINT or when its parent process dies, so a killed ``kvstore serve`` leaves no
workers behind.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from client import KVClient, block_keys
from engine_adapter import serving_pb2 as pb
from engine_adapter import serving_pb2_grpc as pb_grpc
from engine_adapter.kv_layout import KVBlockLayout
from engine_adapter.loader import LoadedModel, load_model
from engine_adapter.paged_kv import BlockTable, PagedKVCache
from engine_adapter.router import CHANNEL_OPTIONS
from kvstore.errors import InvalidArgument, KVStoreError, to_grpc_status

log = logging.getLogger(__name__)

T = TypeVar("T")
ROLES = ("prefill", "decode")
PARENT_POLL_S = 0.5
STOP_GRACE_S = 2.0


class TenantClients:
    """One store client per tenant (the tenant travels with every store request)."""

    def __init__(self, cluster_toml: str | Path) -> None:
        self.cluster_toml = cluster_toml
        self._tenant_to_client: dict[str, KVClient] = {}
        self._lock = asyncio.Lock()

    async def get(self, tenant: str) -> KVClient:
        async with self._lock:
            if tenant not in self._tenant_to_client:
                self._tenant_to_client[tenant] = await KVClient.connect(self.cluster_toml, tenant)
            return self._tenant_to_client[tenant]

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._tenant_to_client.values()))


class KVRuntime:
    """The model, its paged KV cache and one compute thread: the synchronous torch side."""

    def __init__(self, loaded: LoadedModel, block_tokens: int, max_model_len: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        cfg = self.model.config
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.layout = KVBlockLayout.for_model(cfg, block_tokens, dtype)
        self.namespace = self.layout.namespace(loaded.fingerprint)
        self.max_model_len = min(max_model_len, cfg.max_position_embeddings)
        device = next(self.model.parameters()).device
        self.cache = PagedKVCache(self.layout, -(-self.max_model_len // block_tokens), device)
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.lock = asyncio.Lock()  # one request holds the cache at a time

    @property
    def block_tokens(self) -> int:
        return self.layout.block_tokens

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def keys(self, token_ids: Sequence[int], tenant: str) -> list[bytes]:
        """Store keys of the full blocks; the tenant is the salt, so tenants never share KV."""
        return block_keys(list(token_ids), self.block_tokens, self.namespace, tenant)

    def allocate(self, num_tokens: int) -> BlockTable:
        if num_tokens > self.max_model_len:
            raise InvalidArgument(
                f"{num_tokens} tokens (prompt + max_new_tokens) exceed the worker's "
                f"max_model_len {self.max_model_len}; shorten the prompt or raise --max-model-len"
            )
        table = BlockTable(self.block_tokens)
        table.block_ids = self.cache.pool.allocate(table.num_blocks_for(num_tokens))
        return table

    def release(self, table: BlockTable) -> None:
        self.cache.pool.free(table.block_ids)
        table.block_ids = []

    def new_block_buffer(self) -> torch.Tensor:
        """A staging buffer of one store block (kv_layout shape)."""
        return torch.empty(self.layout.shape, dtype=getattr(torch, self.layout.dtype))

    def forward(self, token_ids: Sequence[int], table: BlockTable, start: int) -> torch.Tensor:
        """Compute KV of positions [start, len(token_ids)); next-token logits of the last one.

        ``start`` is a block boundary and chunks are the blocks, so computed KV is bitwise
        equal to the KV of the same blocks computed by any other worker (see EngineConfig).
        """
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.cache.kv.device)
        t, hidden = self.block_tokens, None
        for chunk_start in range(start, len(ids), t):
            chunk = ids[chunk_start : chunk_start + t]
            hidden = self.model(chunk, chunk_start, self.cache, table)  # [n, hidden]
        assert hidden is not None, f"forward over an empty range [{start}, {len(ids)})"
        return self.model.logits(hidden[-1])  # [vocab]

    def load_blocks(self, table: BlockTable, first_block: int, buffers: list[torch.Tensor]) -> None:
        """Copy fetched store blocks into the table's blocks from ``first_block`` on."""
        block_ids = table.block_ids[first_block : first_block + len(buffers)]
        for layer in range(self.layout.num_layers):
            self.cache.load_layer(layer, block_ids, buffers)

    def save_blocks(self, table: BlockTable, block_indexes: Sequence[int]) -> list[torch.Tensor]:
        """The table's blocks ``block_indexes`` serialised for the store (kv_layout shape)."""
        buffers = [self.new_block_buffer() for _ in block_indexes]
        for index, buffer in zip(block_indexes, buffers, strict=True):
            self.cache.save_block(table.block_ids[index], buffer)
        return buffers

    def tail_kv(self, table: BlockTable, num_tokens: int) -> bytes:
        """KV of the positions after the last full block: ``[L, 2, Hkv, tail, D]`` bytes."""
        tail = num_tokens % self.block_tokens
        if tail == 0:
            return b""
        block_id = table.block_ids[num_tokens // self.block_tokens]
        layers = [
            self.cache.block(layer, block_id)[:, :, :tail]
            for layer in range(self.layout.num_layers)
        ]
        return _tensor_bytes(torch.stack(layers))  # [L, 2, Hkv, tail, D]

    def load_tail_kv(self, table: BlockTable, num_tokens: int, data: bytes) -> None:
        """Inverse of :meth:`tail_kv`."""
        tail = num_tokens % self.block_tokens
        lay = self.layout
        expected_bytes = lay.block_bytes // lay.block_tokens * tail
        if len(data) != expected_bytes:
            raise InvalidArgument(
                f"handoff tail KV is {len(data)} bytes, expected {expected_bytes} for {tail} "
                "tokens of this model's layout; prefill and decode workers must run one model"
            )
        if tail == 0:
            return
        dtype = getattr(torch, lay.dtype)
        kv = torch.frombuffer(bytearray(data), dtype=dtype)
        kv = kv.view(
            lay.num_layers, 2, lay.num_kv_heads, tail, lay.head_dim
        )  # [L, 2, Hkv, tail, D]
        block_id = table.block_ids[num_tokens // self.block_tokens]
        for layer in range(lay.num_layers):
            self.cache.block(layer, block_id)[:, :, :tail].copy_(kv[layer])


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _writable(buffer: torch.Tensor) -> np.ndarray:
    """A writable uint8 view of a CPU staging buffer, for ``KVClient.get_into``."""
    return buffer.view(torch.uint8).numpy().reshape(-1)


class Sampler:
    """Greedy or seeded temperature / top-p sampling; its RNG state travels in the handoff."""

    def __init__(self, sampling: pb.SamplingParams, state: bytes = b"") -> None:
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(sampling.seed)
        if state:
            self.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    def state(self) -> bytes:
        return _tensor_bytes(self.generator.get_state())

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token id from fp32 ``logits`` ``[vocab]``."""
        if self.sampling.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.sampling.temperature, dim=-1)
        top_p = self.sampling.top_p
        if 0 < top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < top_p  # always keeps the top
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self.generator))


class WorkerBase:
    """What both roles share: identity, the runtime, store clients, tokenizer, load."""

    role = ""

    def __init__(
        self,
        worker_id: str,
        runtime: KVRuntime,
        clients: TenantClients,
        inject_delay_s: float = 0.0,
    ) -> None:
        self.worker_id = worker_id
        self.runtime = runtime
        self.clients = clients
        self.tokenizer = runtime.loaded.tokenizer
        self.inject_delay_s = inject_delay_s  # test-only: a slow worker, to kill mid-request
        self.num_active = 0

    async def Health(  # gRPC method name
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthReply:
        return pb.HealthReply(
            worker_id=self.worker_id,
            role=self.role,
            model_fingerprint=self.runtime.loaded.fingerprint,
            num_active=self.num_active,
            pid=os.getpid(),
        )

    def text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    @contextlib.asynccontextmanager
    async def serving(
        self, context: grpc.aio.ServicerContext, request_id: str
    ) -> AsyncIterator[None]:
        """Count the request, hold the cache, and turn kvstore errors into gRPC statuses."""
        self.num_active += 1
        try:
            async with self.runtime.lock:
                await asyncio.sleep(self.inject_delay_s)
                yield
        except KVStoreError as exc:
            log.warning("%s %s: request %s failed: %s", self.role, self.worker_id, request_id, exc)
            await context.abort(*to_grpc_status(exc))
        finally:
            self.num_active -= 1


class PrefillWorker(WorkerBase, pb_grpc.PrefillWorkerServicer):
    """Cache-backed prefill, then the handoff (see the module doc)."""

    role = "prefill"

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PrefillEvent]:
        start_s = time.perf_counter()
        async with self.serving(context, request.request_id):
            token_ids = self.prompt_ids(request)
            kv = await self.clients.get(request.tenant)
            kv.config.ttl.classes.check(request.traffic_class)
            table = self.runtime.allocate(len(token_ids))
            try:
                async for event in self._prefill(request, token_ids, kv, table, start_s):
                    yield event
            finally:
                self.runtime.release(table)

    def prompt_ids(self, request: pb.PrefillRequest) -> list[int]:
        """The prompt: the request's token ids, or its conversation through the chat template."""
        if request.token_ids:
            ids = list(request.token_ids)
            vocab_size = self.runtime.model.config.vocab_size
            if max(ids) >= vocab_size:
                raise InvalidArgument(
                    f"token id {max(ids)} is outside the vocabulary ({vocab_size})"
                )
            return ids
        if self.tokenizer is None or not request.messages:
            raise InvalidArgument(
                f"model {self.runtime.loaded.spec!r} has no tokenizer: send token_ids"
                if request.messages
                else "empty prompt: send messages or token_ids"
            )
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        return self.tokenizer.apply_chat_template(messages)

    async def _prefill(
        self,
        request: pb.PrefillRequest,
        token_ids: list[int],
        kv: KVClient,
        table: BlockTable,
        start_s: float,
    ) -> AsyncIterator[pb.PrefillEvent]:
        runtime = self.runtime
        keys = runtime.keys(token_ids, request.tenant)
        num_cached_blocks = await self._swap_in(kv, keys, table, len(token_ids))
        num_cached_tokens = num_cached_blocks * runtime.block_tokens
        logits = await runtime.run(runtime.forward, token_ids, table, num_cached_tokens)
        sampler = Sampler(request.sampling)
        first_token_id = sampler(logits)
        stats = pb.PrefillStats(
            worker_id=self.worker_id,
            num_prompt_tokens=len(token_ids),
            num_cached_tokens=num_cached_tokens,
            num_computed_tokens=len(token_ids) - num_cached_tokens,
            prefill_s=time.perf_counter() - start_s,
        )
        first = pb.PrefillFirst(
            stats=stats, first_token_id=first_token_id, text=self.text([first_token_id])
        )
        yield pb.PrefillEvent(first=first)
        await self._store_blocks(kv, keys, table, num_cached_blocks, request.traffic_class)
        tail_kv = await runtime.run(runtime.tail_kv, table, len(token_ids))
        yield pb.PrefillEvent(
            handoff=pb.Handoff(
                request_id=request.request_id,
                tenant=request.tenant,
                traffic_class=request.traffic_class,
                model_fingerprint=runtime.loaded.fingerprint,
                token_ids=token_ids,
                block_tokens=runtime.block_tokens,
                num_stored_blocks=len(keys),
                tail_kv=tail_kv,
                tail_tokens=len(token_ids) % runtime.block_tokens,
                kv_dtype=runtime.layout.dtype,
                first_token_id=first_token_id,
                sampler_state=sampler.state(),
            )
        )

    async def _swap_in(
        self, kv: KVClient, keys: list[bytes], table: BlockTable, num_tokens: int
    ) -> int:
        """Fetch the longest stored prefix of full blocks into the cache; how many blocks.

        The last prompt token is always computed (its logits give the first token), so a
        prompt of whole blocks recomputes its last block.
        """
        usable = keys[: (num_tokens - 1) // self.runtime.block_tokens]
        num_hits = await kv.match_prefix(usable) if usable else 0
        buffers = await fetch_blocks(kv, usable[:num_hits], self.runtime)
        num_fetched = next((i for i, b in enumerate(buffers) if b is None), len(buffers))
        fetched = [b for b in buffers[:num_fetched] if b is not None]
        await self.runtime.run(self.runtime.load_blocks, table, 0, fetched)
        return num_fetched

    async def _store_blocks(
        self,
        kv: KVClient,
        keys: list[bytes],
        table: BlockTable,
        first_block: int,
        traffic_class: str,
    ) -> None:
        """Put the new full blocks and wait for every put: decode reads them next.

        A failed put is logged, not raised: the decode worker recomputes a block it cannot
        read, so the request still gets the right answer.
        """
        indexes = list(range(first_block, len(keys)))
        buffers = await self.runtime.run(self.runtime.save_blocks, table, indexes)
        results = await asyncio.gather(
            *(
                kv.put(keys[i], _writable(b), traffic_class)
                for i, b in zip(indexes, buffers, strict=True)
            ),
            return_exceptions=True,
        )
        for index, result in zip(indexes, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("prefill %s: block %d not stored: %s", self.worker_id, index, result)


async def fetch_blocks(
    kv: KVClient, keys: Sequence[bytes], runtime: KVRuntime
) -> list[torch.Tensor | None]:
    """Each key's block in a fresh staging buffer, or None where the read missed."""
    buffers = [runtime.new_block_buffer() for _ in keys]
    hits = await asyncio.gather(
        *(kv.get_into(k, _writable(b)) for k, b in zip(keys, buffers, strict=True))
    )
    return [b if hit else None for b, hit in zip(buffers, hits, strict=True)]


class DecodeWorker(WorkerBase, pb_grpc.DecodeWorkerServicer):
    """Swap the prompt's KV in from the store plus the handoff's tail, then decode."""

    role = "decode"

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeEvent]:
        handoff, sampling = request.handoff, request.sampling
        async with self.serving(context, handoff.request_id):
            self._check_handoff(handoff)
            table = self.runtime.allocate(len(handoff.token_ids) + sampling.max_new_tokens)
            try:
                async for event in self._decode(handoff, sampling, table):
                    yield event
            finally:
                self.runtime.release(table)

    def _check_handoff(self, handoff: pb.Handoff) -> None:
        runtime = self.runtime
        mine = (runtime.loaded.fingerprint, runtime.block_tokens, runtime.layout.dtype)
        theirs = (handoff.model_fingerprint, handoff.block_tokens, handoff.kv_dtype)
        if mine != theirs:
            raise InvalidArgument(
                f"handoff from a prefill worker running (model, block_tokens, dtype) = {theirs}, "
                f"this decode worker runs {mine}; start both roles with the same --model"
            )

    async def _decode(
        self, handoff: pb.Handoff, sampling: pb.SamplingParams, table: BlockTable
    ) -> AsyncIterator[pb.DecodeEvent]:
        token_ids = list(handoff.token_ids)
        generated = [handoff.first_token_id]
        finish = pb.Finish(
            decode_worker_id=self.worker_id, finish_reason=self._stop_reason(generated, sampling)
        )
        if not finish.finish_reason:
            await self._restore_prompt(handoff, table, finish)
            sampler = Sampler(sampling, handoff.sampler_state)
            async for token in self._generate(token_ids, generated, table, sampler, sampling):
                yield pb.DecodeEvent(token=token)
            finish.finish_reason = self._stop_reason(generated, sampling)
        finish.text = self.text(generated)
        yield pb.DecodeEvent(finish=finish)

    def _stop_reason(self, generated: list[int], sampling: pb.SamplingParams) -> str:
        eos = self.runtime.model.config.eos_token_id
        if not sampling.ignore_eos and eos is not None and generated[-1] == eos:
            return "stop"
        return "length" if len(generated) >= sampling.max_new_tokens else ""

    async def _restore_prompt(
        self, handoff: pb.Handoff, table: BlockTable, finish: pb.Finish
    ) -> None:
        """Swap the prompt's full blocks in from the store (computing unreadable ones), then
        load the tail KV from the handoff."""
        runtime = self.runtime
        token_ids = list(handoff.token_ids)
        kv = await self.clients.get(handoff.tenant)
        keys = runtime.keys(token_ids, handoff.tenant)[: handoff.num_stored_blocks]
        buffers = await fetch_blocks(kv, keys, runtime)
        num_recomputed = await runtime.run(self._load_or_compute, token_ids, table, buffers)
        await runtime.run(runtime.load_tail_kv, table, len(token_ids), handoff.tail_kv)
        finish.num_recomputed_tokens = num_recomputed
        finish.num_swapped_tokens = len(keys) * runtime.block_tokens - num_recomputed

    def _load_or_compute(
        self, token_ids: list[int], table: BlockTable, buffers: list[torch.Tensor | None]
    ) -> int:
        """Load fetched blocks, compute missing ones in order; tokens computed."""
        t, num_computed = self.runtime.block_tokens, 0
        for index, buffer in enumerate(buffers):
            if buffer is not None:
                self.runtime.load_blocks(table, index, [buffer])
            else:
                self.runtime.forward(token_ids[: (index + 1) * t], table, index * t)
                num_computed += t
        if num_computed:
            log.warning(
                "decode %s: recomputed %d prompt tokens the store did not return",
                self.worker_id,
                num_computed,
            )
        return num_computed

    async def _generate(
        self,
        token_ids: list[int],
        generated: list[int],
        table: BlockTable,
        sampler: Sampler,
        sampling: pb.SamplingParams,
    ) -> AsyncIterator[pb.TokenDelta]:
        """Sample tokens after the first until a stop; ``generated`` grows in place."""
        text = self.text(generated)
        while not self._stop_reason(generated, sampling):
            position = len(token_ids) + len(generated) - 1
            logits = await self.runtime.run(self._step, generated[-1], position, table)
            generated.append(sampler(logits))
            text, delta = self._text_delta(generated, text)
            yield pb.TokenDelta(token_id=generated[-1], text=delta)

    def _step(self, token_id: int, position: int, table: BlockTable) -> torch.Tensor:
        ids = torch.tensor([token_id], dtype=torch.long, device=self.runtime.cache.kv.device)
        hidden = self.runtime.model(ids, position, self.runtime.cache, table)  # [1, hidden]
        return self.runtime.model.logits(hidden[-1])

    def _text_delta(self, generated: list[int], previous: str) -> tuple[str, str]:
        """(text so far, new text); holds back an incomplete UTF-8 character."""
        text = self.text(generated)
        if text.endswith("\ufffd"):
            return previous, ""
        return text, text[len(previous) :]


# --- the process main ----------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    """Arguments of one worker process."""
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--cluster", required=True, type=Path, help="the store's cluster.toml")
    parser.add_argument("--id", required=True, help="worker id, e.g. p0 or d0")
    parser.add_argument("--model", default="default", help="default, random:<size>, a .gguf or dir")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    parser.add_argument(
        "--ready-file", type=Path, help="write id/address/pid JSON here once serving"
    )
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process dies")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048, help="tokens per request")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 suits shared CPUs)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random-init seed (random:<size>)")
    parser.add_argument("--inject-delay-ms", type=float, default=0.0, help="tests: slow requests")


async def serve_worker(args: argparse.Namespace) -> None:
    """Load the model, serve until SIGTERM/SIGINT or the parent's death."""
    torch.set_num_threads(args.threads)
    loaded = await asyncio.to_thread(load_model, args.model, "cpu", "float32", args.seed)
    runtime = KVRuntime(loaded, args.block_tokens, args.max_model_len)
    clients = TenantClients(args.cluster)
    worker_type = PrefillWorker if args.role == "prefill" else DecodeWorker
    worker = worker_type(args.id, runtime, clients, args.inject_delay_ms / 1000)
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add = (
        pb_grpc.add_PrefillWorkerServicer_to_server
        if args.role == "prefill"
        else pb_grpc.add_DecodeWorkerServicer_to_server
    )
    add(worker, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    stop = _stop_on_signals()
    watcher = asyncio.create_task(_watch_parent(args.parent_pid, stop)) if args.parent_pid else None
    if args.ready_file:
        _write_ready(args.ready_file, worker, f"127.0.0.1:{port}")
    log.info("%s worker %s serving on 127.0.0.1:%d", args.role, args.id, port)
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    await server.stop(STOP_GRACE_S)
    await clients.close()
    runtime.executor.shutdown(wait=False, cancel_futures=True)


def _stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``parent_pid`` is no longer our parent (it died: we were re-parented)."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("parent process %d is gone; stopping", parent_pid)
    stop.set()


def _write_ready(path: Path, worker: WorkerBase, address: str) -> None:
    info = {
        "worker_id": worker.worker_id,
        "role": worker.role,
        "address": address,
        "pid": os.getpid(),
        "model_fingerprint": worker.runtime.loaded.fingerprint,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_adapter.workers", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--log-level", default="INFO")
    configure(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {args.id} %(name)s %(levelname)s %(message)s",
    )
    asyncio.run(serve_worker(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
