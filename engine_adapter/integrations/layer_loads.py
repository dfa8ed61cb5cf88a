"""Store blocks into vLLM's paged KV, layer by layer as their shards land: the loads of the
vLLM connector's workers (engine_adapter/integrations/vllm_connector.py).

::

    start(req_id, keys, block_ids)   the blocks queue for landing-pool slots (one block each)
    chunk = up to chunk_blocks of    land_batch into its slots, on the client's loop thread:
      them that got slots            local nodes write their data shards straight into the
                                     slots (client/landing_pool.py); on_landed tells the
                                     chunk's Readiness, which says when a layer is in place in
                                     every block of the chunk (client/readiness.py)
    progress(), on vLLM's thread     each (chunk, layer) in place: copied into the paged KV
                                     (CUDA: host-to-device on a side stream, by DMA from the
                                     registered pool); each chunk whose land_batch returned:
                                     its other layers copied for the blocks that landed, blocks
                                     rewritten after they were reported copied again, blocks
                                     that did not land noted failed, its slots released and
                                     given to blocks still queued
    wait_layer(l)                    until layer l of every block in flight is in the paged KV
    finish() / take_finished()       the loads whose every land_batch returned (wait / not)

A store block is layer-major (``[layer 0 | layer 1 | ...]``), so layer l of a block is bytes
``[l*S, (l+1)*S)`` and arrives with the data shards covering that range: each node's answer
completes a fixed range of layers of the blocks it carried. In a healthy read the nodes answer
together and every layer lands at about the same time; what layer-wise loading buys there is
the copy of layer l and the attention of the layers before it overlapping the rest of the
fetch. A node that answers late holds back only its own range of layers.

Verification. A layer is copied as soon as its shards are in place, before its block's
checksum is checked (when the block's land_batch returns). So every copied block is verified
by the time its load finishes or is reported failed; so is a block whose bytes changed after
the forward pass read one of its layers (``Landing.rewritten``, and the layer read differs from
the final bytes). The connector reports failed blocks to vLLM, which recomputes them and drops
the step's output of the requests that used them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from client.buffer_pool import BufferSlot
from client.kv_client import Landing
from client.landing_pool import LandingPool
from client.readiness import Readiness
from client.sync_client import SyncKVClient
from engine_adapter import kv_format
from engine_adapter.connector import StoreFailure
from engine_adapter.host_buffers import register_for_dma, unregister_for_dma
from engine_adapter.kv_layout import e4m3x16_bytes

log = logging.getLogger(__name__)

WAKE_S = 1.0  # longest wait between two looks at the loads (arrivals wake a waiter at once)
CLOSE_WAIT_S = 10.0  # for cancelled land_batch calls to return at close()


class PagedLayer:
    """One layer's paged KV as vLLM hands it over: a ``[B, H, N, C]`` view, blocks first,
    any physical strides. ``B`` may count kernel blocks, ``ratio`` of them per vLLM block.

    ``quantized``: pages go to the store as e4m3x16 (``[values | scales]`` of the logical
    ``[H, N, C]`` page, groups along C), quantised where the KV lives on the way out and
    dequantised on the KV's device on the way in."""

    def __init__(self, tensor: torch.Tensor, num_blocks: int, quantized: bool = False) -> None:
        if tensor.dim() != 4 or tensor.shape[0] % num_blocks:
            raise ValueError(
                f"KVStoreConnector expects [B, H, N, C] KV views with B a multiple of "
                f"{num_blocks} blocks, got shape {tuple(tensor.shape)}"
            )
        self.tensor = tensor
        self.ratio = tensor.shape[0] // num_blocks
        _, self.num_heads, self.kernel_tokens, self.num_channels = tensor.shape
        page_elements = self.ratio * self.num_heads * self.kernel_tokens * self.num_channels
        self.quantized = quantized
        # (P, H, T, D) of a page in kv_format's terms: one part, its tokens across kernel blocks
        self.part_shape = (1, self.num_heads, self.ratio * self.kernel_tokens, self.num_channels)
        if quantized:
            self.page_bytes = e4m3x16_bytes(page_elements)
        else:
            self.page_bytes = page_elements * tensor.element_size()

    def _kernel_ids(self, block_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.long)
        spread = ids[:, None] * self.ratio + torch.arange(self.ratio)  # [n, ratio]
        return spread.flatten().to(self.tensor.device)

    def _logical(self, pages: torch.Tensor) -> torch.Tensor:
        """[n, H, ratio * kernel_tokens, C] pages of the KV dtype -> [n * ratio, H,
        kernel_tokens, C], as the paged view indexes them (a vLLM block's tokens run across
        its kernel blocks)."""
        n = pages.shape[0]
        heads, tokens, channels = self.num_heads, self.kernel_tokens, self.num_channels
        shaped = pages.view(n, heads, self.ratio, tokens, channels)
        return shaped.transpose(1, 2).reshape(n * self.ratio, heads, tokens, channels)

    def read(self, block_ids: list[int], out: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy the blocks' logical [H, N, C] pages into ``out`` ([n, page_bytes] uint8)."""
        pages = self.tensor[self._kernel_ids(block_ids)]  # [n * ratio, H, kernel_tokens, C]
        n, heads, tokens, channels = (
            len(block_ids),
            self.num_heads,
            self.kernel_tokens,
            self.num_channels,
        )
        logical = pages.view(n, self.ratio, heads, tokens, channels).transpose(1, 2)
        if self.quantized:  # kv [n, L=1, P, H, T, D] into out [n, L=1, layer_bytes]
            kv = logical.reshape(n, 1, *self.part_shape)
            kv_format.encode_block(kv, out.view(n, 1, self.page_bytes))
            return
        dst = out.view(self.tensor.dtype).view(n, heads, self.ratio, tokens, channels)
        dst.copy_(logical, non_blocking=non_blocking)

    def write(self, block_ids: list[int], raw: torch.Tensor) -> list[int]:
        """Place the blocks' pages from ``raw`` ([n, page_bytes] uint8) into the paged KV;
        the ids of blocks left out: e4m3x16 pages holding a non-finite scale (the quantiser's
        mark for KV that held inf or NaN), which must be computed instead."""
        raw = raw.to(self.tensor.device)
        if not self.quantized:
            pages = raw.view(self.tensor.dtype).view(len(block_ids), *self.part_shape[1:])
            self.tensor[self._kernel_ids(block_ids)] = self._logical(pages)
            return []
        values, scales = kv_format.split_layer(raw, self.part_shape)
        finite = torch.isfinite(scales.flatten(1)).all(dim=1).tolist()
        good = [i for i, ok in enumerate(finite) if ok]
        if good:
            pages = torch.empty(
                (len(good), *self.part_shape), dtype=self.tensor.dtype, device=raw.device
            )
            kv_format.dequantize(values[good], scales[good], pages)
            ids = [block_ids[i] for i in good]
            self.tensor[self._kernel_ids(ids)] = self._logical(pages.squeeze(1))
        return [block_id for block_id, ok in zip(block_ids, finite, strict=True) if not ok]


@dataclass(eq=False)
class BlockLoad:
    """One request's blocks to load: store keys and vLLM block ids, and how it went."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    started_s: float = field(default_factory=time.perf_counter)
    finished_s: float = 0.0  # when the last of its land_batch calls was handled
    failed: set[int] = field(default_factory=set)  # block ids vLLM must compute instead
    read_layers: set[int] = field(default_factory=set)  # wait_layer returned for these
    chunks: list[_Chunk] = field(default_factory=list)
    num_started: int = 0  # blocks [0, num_started) are in chunks

    @property
    def done(self) -> bool:
        return self.num_started == len(self.keys) and all(c.done for c in self.chunks)

    def has_layer(self, layer: int) -> bool:
        """Whether ``layer`` of every block is in the paged KV (or its block failed)."""
        started = self.num_started == len(self.keys)
        return started and all(c.done or c.copied[layer] for c in self.chunks)


@dataclass(eq=False)
class _Chunk:
    """Blocks ``[start, start + len(slots))`` of a load, in one land_batch."""

    load: BlockLoad
    start: int
    slots: list[BufferSlot]
    readiness: Readiness
    copied: list[bool]  # per layer: in the paged KV for every block of the chunk
    future: concurrent.futures.Future[Landing] | None = None
    done: bool = False  # its land_batch returned, and every block is copied or failed
    copy_event: torch.cuda.Event | None = None  # CUDA: its last copy out of the slots
    holds_slots: bool = True

    @property
    def block_ids(self) -> list[int]:
        return self.load.block_ids[self.start : self.start + len(self.slots)]


class LayerLoads:
    """Loads into ``layers`` (one vLLM block = one store block of every layer, in order),
    through ``pool``'s slots, with ``kv`` (connected with ``landing_pool=pool``)."""

    def __init__(
        self,
        kv: SyncKVClient,
        pool: LandingPool,
        layers: Sequence[PagedLayer],
        chunk_blocks: int,
    ) -> None:
        self.kv, self.pool, self.layers = kv, pool, list(layers)
        self.layer_bytes = self.layers[0].page_bytes
        self.block_bytes = self.layer_bytes * len(self.layers)
        if pool.slot_bytes != self.block_bytes:
            raise ValueError(
                f"landing pool slots of {pool.slot_bytes} bytes for blocks of {self.block_bytes}"
            )
        self.chunk_blocks = chunk_blocks
        self.k = kv.client.codec.k
        self._rows = torch.frombuffer(pool.memory, dtype=torch.uint8).view(
            pool.num_slots, pool.slot_stride
        )
        self._device = self.layers[0].tensor.device
        self._stream: torch.cuda.Stream | None = None
        self._registered = 0
        if self._device.type == "cuda":
            register_for_dma(pool.address, pool.num_bytes)
            self._registered = pool.address
            self._stream = torch.cuda.Stream(device=self._device)
        self._loads: list[BlockLoad] = []
        self._arrived = threading.Condition()  # on_landed and land_batch ends notify it
        self._num_arrivals = 0
        self._seen_arrivals = 0  # _num_arrivals at the last progress()

    @property
    def in_flight(self) -> list[BlockLoad]:
        return list(self._loads)

    def start(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> BlockLoad:
        """Queue a request's blocks; chunks start as slots are free (now, for the first)."""
        load = BlockLoad(req_id, list(keys), list(block_ids))
        self._loads.append(load)
        self._start_chunks()
        return load

    def progress(self) -> None:
        """Copy what has landed, handle the land_batch calls that returned, start chunks."""
        num_layers = len(self.layers)
        with self._arrived:
            self._seen_arrivals = self._num_arrivals
            active = [c for load in self._loads for c in load.chunks if not c.done]
            ready = [
                (chunk, layer)
                for chunk in active
                for layer in range(num_layers)
                if not chunk.copied[layer] and chunk.readiness.segment_everywhere(layer)
            ]
            returned = [chunk for chunk in active if chunk.future and chunk.future.done()]
        for chunk, layer in ready:
            self._copy(chunk, layer, range(len(chunk.slots)))
            chunk.copied[layer] = True
        for chunk in returned:
            self._complete(chunk)
        self._release_slots(wait=False)
        self._start_chunks()

    def wait_layer(self, layer: int) -> None:
        """Until ``layer`` of every block in flight is in the paged KV; the forward pass reads
        it next (CUDA: the current stream waits for the copies)."""
        self.progress()
        while not all(load.has_layer(layer) for load in self._loads):
            self._wait_for_arrivals()
            self.progress()
        for load in self._loads:
            load.read_layers.add(layer)
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def finish(self) -> list[BlockLoad]:
        """Wait until every load's land_batch calls returned; those loads, forgotten here."""
        self.progress()
        while not all(load.done for load in self._loads):
            self._wait_for_arrivals()
            self.progress()
        return self.take_finished()

    def take_finished(self) -> list[BlockLoad]:
        """The loads that are over (their slots free again), forgotten here; no waiting."""
        finished = [load for load in self._loads if load.done]
        if finished:
            self._release_slots(wait=True, loads=finished)
            self._loads = [load for load in self._loads if not load.done]
        return finished

    def close(self) -> None:
        """Cancel the land_batch calls still out and unpin the pool (before the client
        closes); the pool itself is the caller's."""
        for load in self._loads:
            for chunk in load.chunks:
                if chunk.future is not None:
                    chunk.future.cancel()
        futures = [c.future for load in self._loads for c in load.chunks if c.future]
        concurrent.futures.wait(futures, timeout=CLOSE_WAIT_S)
        if self._stream is not None:
            self._stream.synchronize()
        self._loads = []
        if self._registered:
            unregister_for_dma(self._registered)
            self._registered = 0

    def _start_chunks(self) -> None:
        for load in self._loads:
            while load.num_started < len(load.keys):
                want = min(self.chunk_blocks, len(load.keys) - load.num_started)
                slots = self._acquire(want)
                if not slots:
                    return
                self._submit(load, slots)

    def _acquire(self, num_slots: int) -> list[BufferSlot]:
        slots: list[BufferSlot] = []
        while len(slots) < num_slots and (slot := self.pool.try_acquire()) is not None:
            slots.append(slot)
        if not slots:  # every slot is out: take back those whose copies are done
            self._release_slots(wait=True)
            while len(slots) < num_slots and (slot := self.pool.try_acquire()) is not None:
                slots.append(slot)
        return slots

    def _submit(self, load: BlockLoad, slots: list[BufferSlot]) -> None:
        start = load.num_started
        readiness = Readiness(len(slots), self.block_bytes, self.k, self.layer_bytes)
        chunk = _Chunk(load, start, slots, readiness, [False] * len(self.layers))
        load.chunks.append(chunk)
        load.num_started += len(slots)

        def landed(pairs: list[tuple[int, int]]) -> None:  # on the client's loop thread
            with self._arrived:
                chunk.readiness.landed(pairs)
                self._num_arrivals += 1
                self._arrived.notify_all()

        keys = load.keys[start : start + len(slots)]
        try:
            future = self.kv.submit("land_batch", keys, [s.view for s in slots], on_landed=landed)
        except StoreFailure as exc:  # a closed client: these blocks are computed instead
            future = concurrent.futures.Future()
            future.set_exception(exc)
        future.add_done_callback(lambda _: self._wake())
        chunk.future = future

    def _wake(self) -> None:
        with self._arrived:
            self._num_arrivals += 1
            self._arrived.notify_all()

    def _wait_for_arrivals(self) -> None:
        with self._arrived:
            self._arrived.wait_for(lambda: self._num_arrivals != self._seen_arrivals, WAKE_S)

    def _complete(self, chunk: _Chunk) -> None:
        """The chunk's land_batch returned: copy what is left, note what failed."""
        assert chunk.future is not None
        load, num_blocks = chunk.load, len(chunk.slots)
        try:
            landing = chunk.future.result()
        except (*StoreFailure, concurrent.futures.CancelledError) as exc:
            log.warning("loading %d KV blocks from kvstore failed: %s", num_blocks, exc)
            landing = Landing.nothing(num_blocks)
        block_ids = chunk.block_ids
        landed = [i for i, ok in enumerate(landing.landed) if ok]
        load.failed.update(block_ids[i] for i, ok in enumerate(landing.landed) if not ok)
        rewritten = [i for i in landed if landing.rewritten[i]]
        for i in rewritten:  # the forward pass may have read bytes from before the rewrite
            if any(not self._same(chunk, i, layer) for layer in sorted(load.read_layers)):
                load.failed.add(block_ids[i])
        for layer in range(len(self.layers)):
            positions = rewritten if chunk.copied[layer] else landed
            if positions:
                self._copy(chunk, layer, positions)
            chunk.copied[layer] = True
        chunk.done = True
        if self._stream is not None:
            chunk.copy_event = torch.cuda.Event()
            chunk.copy_event.record(self._stream)
        if load.done:
            load.finished_s = time.perf_counter()

    def _copy(self, chunk: _Chunk, layer: int, positions: Iterable[int]) -> None:
        """Layer ``layer`` of the chunk's blocks at ``positions``: slots -> the paged KV."""
        positions = list(positions)
        block_ids = [chunk.block_ids[p] for p in positions]
        slots = [chunk.slots[p].index for p in positions]
        start = layer * self.layer_bytes
        end = start + self.layer_bytes
        if self._stream is None:
            rows = self._rows[torch.tensor(slots), start:end]
            chunk.load.failed.update(self.layers[layer].write(block_ids, rows))
            return
        with torch.cuda.stream(self._stream):
            staging = torch.empty(
                (len(slots), self.layer_bytes), dtype=torch.uint8, device=self._device
            )
            for row, slot in enumerate(slots):  # DMA straight from the registered pool
                staging[row].copy_(self._rows[slot, start:end], non_blocking=True)
            chunk.load.failed.update(self.layers[layer].write(block_ids, staging))

    def _same(self, chunk: _Chunk, position: int, layer: int) -> bool:
        """Whether the paged KV holds the slot's final bytes of this layer of this block."""
        held = torch.empty((1, self.layer_bytes), dtype=torch.uint8)
        self.layers[layer].read([chunk.block_ids[position]], held)
        start = layer * self.layer_bytes
        slot = chunk.slots[position].index
        return torch.equal(held[0], self._rows[slot, start : start + self.layer_bytes])

    def _release_slots(self, wait: bool, loads: Iterable[BlockLoad] | None = None) -> None:
        """Give back the slots of done chunks whose copies are over (``wait``: wait for them)."""
        for load in self._loads if loads is None else loads:
            for chunk in load.chunks:
                if not (chunk.done and chunk.holds_slots):
                    continue
                if chunk.copy_event is not None:
                    if not wait and not chunk.copy_event.query():
                        continue
                    chunk.copy_event.synchronize()
                for slot in chunk.slots:
                    slot.release()
                chunk.holds_slots = False
