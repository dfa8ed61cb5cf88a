"""What a UCX worker tracks per receive and send (kvstore/wire/ucx_worker.py): receive slots and
their destinations, listeners, sends, and the group receive of one batch's messages.

A slot is only *registered* until its message arrives; the worker then probes the message and
receives it into the slot's exact region (the worker's docstring says why: a pre-posted receive
cannot be cancelled safely). A group receive holds messages that arrive before their regions
are named, and posts each into its region once they are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.wire import ucp, ucx_runtime

# Where a receive lands: host memory, a CUDA array (``__cuda_array_interface__``, e.g. a torch
# CUDA tensor; UCX's CUDA transports copy into it), a function called on arrival with the
# message's length that returns host memory for it (a buffer of exactly the right size).
Destination = Any


@dataclass(eq=False)
class Receive:
    """A slot waiting for the message with one tag; ``posted`` is set once it is matched."""

    destination: Destination
    capacity: int  # the most bytes the destination takes
    future: asyncio.Future[int]
    posted: ucp.Receive | None = None
    num_bytes: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class Listener:
    """Every message with one tag is received whole and handed to ``handler``."""

    handler: Callable[[memoryview], None]
    max_bytes: int


@dataclass(eq=False)
class Send:
    request: Any
    future: asyncio.Future[None]
    array: Any  # keeps the source buffer alive until UCX is done with it


class Receiver(Protocol):
    """What a group receive needs of its worker."""

    def post_receive(self, message: int, region: Any) -> ucp.Receive: ...

    def discard(self, message: int, num_bytes: int) -> None: ...

    def forget_group(self, group: GroupReceive) -> None: ...


class GroupReceive:
    """Messages ``tag_base + first`` onwards of one batch, each received into its own region,
    the regions named (:meth:`land`) once the caller knows them; messages that arrive
    earlier are held unread. ``future`` gives the total bytes once all of them landed.

    One object and one future for the whole group: the per-message work is a few native
    calls in the worker's dispatch loop (the worker's docstring, "Why one message per shard").
    """

    def __init__(
        self, worker: Receiver, tag_base: int, first: int, future: asyncio.Future[int]
    ) -> None:
        self.tag_base = tag_base
        self.first = first
        self.future = future
        self.regions: list[Any] | None = None
        self.held: dict[int, tuple[int, int]] = {}  # index -> (message handle, length)
        self.posted: dict[int, ucp.Receive] = {}  # index -> receive in transfer
        self.num_landed = 0
        self.num_bytes = 0
        self.cancelled = False
        self.released = asyncio.Event()
        self._worker = worker

    def land(self, regions: Sequence[Any]) -> None:
        """Name the regions: message ``first + i`` lands in ``regions[i]`` (exactly its size)."""
        if self.cancelled or self.regions is not None or self.future.done():
            return
        self.regions = list(regions)
        for index, (message, num_bytes) in sorted(self.held.items()):
            self._post(index, message, num_bytes)
        self.held.clear()
        self.settle()

    def arrive(self, index: int, message: int, num_bytes: int) -> None:
        """Message ``index`` of the batch was probed: post it, or hold it until :meth:`land`."""
        if self.cancelled:
            self._worker.discard(message, num_bytes)
        elif self.regions is None:
            self.held[index] = (message, num_bytes)
        else:
            self._post(index, message, num_bytes)
            self.settle()

    def _post(self, index: int, message: int, num_bytes: int) -> None:
        assert self.regions is not None
        position = index - self.first
        region = self.regions[position] if 0 <= position < len(self.regions) else None
        if self.future.done() or region is None or region.nbytes != num_bytes:
            if not self.future.done():
                self.future.set_exception(
                    InvalidArgument(
                        f"message {index} of batch {self.tag_base:#x} is {num_bytes} bytes, "
                        "not the size of its region (or has none)"
                    )
                )
            self._worker.discard(message, num_bytes)
            return
        posted = self._worker.post_receive(message, region)
        self.num_bytes += num_bytes
        if posted.status() == ucp.UCS_INPROGRESS:
            self.posted[index] = posted
        else:
            self.landed(posted.status())

    def landed(self, status: int) -> None:
        """One posted message finished with ``status``."""
        if status != ucp.UCS_OK and not self.future.done():
            self.future.set_exception(Unavailable(f"UCX receive failed with status {status}"))
        self.num_landed += 1

    def reap(self) -> None:
        """Count the posted messages that finished; settle."""
        for index, posted in list(self.posted.items()):
            status = posted.status()
            if status != ucp.UCS_INPROGRESS:
                del self.posted[index]
                self.landed(status)
        self.settle()

    def settle(self) -> None:
        """Resolve a group whose every message landed; forget one that is over."""
        complete = self.regions is not None and self.num_landed == len(self.regions)
        if complete and not self.future.done():
            self.future.set_result(self.num_bytes)
        if (complete or self.cancelled or self.future.done()) and not self.posted:
            self._worker.forget_group(self)
            self.released.set()

    async def cancel(self) -> None:
        """Stop the group; return once nothing can write into its regions any more."""
        self.cancelled = True
        if not self.future.done():
            self.future.cancel()
        for message, num_bytes in self.held.values():
            self._worker.discard(message, num_bytes)
        self.held.clear()
        self.settle()
        await self.released.wait()


class CudaRegion:
    """A CUDA array as a receive region: its device pointer and size (UCX copies there)."""

    def __init__(self, array: Any) -> None:
        interface = array.__cuda_array_interface__
        self.address = interface["data"][0]
        self.nbytes = ucx_runtime.Array(array).nbytes
        self.array = array  # alive while UCX may write


def destination_of(out: Destination, max_bytes: int | None) -> tuple[Destination, int]:
    """Check a receive's destination; return it (host memory as a byte view) and its size."""
    if callable(out):
        if max_bytes is None or max_bytes < 0:
            raise InvalidArgument("a receive that allocates on arrival needs max_bytes >= 0")
        return out, max_bytes
    if hasattr(out, "__cuda_array_interface__"):
        region = CudaRegion(out)
        return region, region.nbytes
    try:
        view = memoryview(out).cast("B")
    except TypeError:
        raise InvalidArgument(
            f"receive buffer must be host memory or a CUDA array, got {type(out).__name__}"
        ) from None
    if view.readonly or not view.contiguous:
        raise InvalidArgument("receive buffer must be writable and contiguous")
    return view, len(view)


def region_for(receive: Receive, num_bytes: int) -> Any:
    """Where a matched message of ``num_bytes`` is received."""
    destination = receive.destination
    if isinstance(destination, memoryview):
        return destination[:num_bytes]
    if isinstance(destination, CudaRegion):
        return destination  # a longer buffer takes a shorter message
    view = memoryview(destination(num_bytes)).cast("B")
    if view.readonly or len(view) < num_bytes:
        raise InvalidArgument(f"got no writable buffer of {num_bytes} bytes from its allocator")
    receive.destination = view
    return view[:num_bytes]


def resolve_receive(receive: Receive, status: int) -> None:
    """Complete a receive's future from its final status (unless the waiter gave up)."""
    if receive.future.done():
        return
    if status == ucp.UCS_OK:
        receive.future.set_result(receive.num_bytes)
    else:
        receive.future.set_exception(Unavailable(f"UCX receive failed with status {status}"))


def resolve_send(future: asyncio.Future[Any], request: Any) -> None:
    """Complete ``future`` from a finished ucxx send (unless the waiter gave up)."""
    if future.done():
        return
    try:
        request.check_error()
    except Exception as exc:  # one ucxx error type per UCX status; all mean "not delivered"
        future.set_exception(Unavailable(f"UCX transfer failed: {type(exc).__name__}: {exc}"))
    else:
        future.set_result(None)
