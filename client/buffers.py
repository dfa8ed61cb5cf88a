"""What the client takes as a block: any contiguous buffer, CPU tensors included.

A put's data and a ``get_into`` destination become one flat byte view here, copying nothing:

    bytes, bytearray, memoryview, numpy arrays, mmap ...   the buffer protocol
    CPU tensors (torch, or any DLPack producer)             ``__dlpack__`` through numpy
    torch tensors of a dtype numpy lacks (bfloat16, fp8)    viewed as uint8 by their own library

The client never imports torch: a tensor is recognized by ``__dlpack__``, and for a dtype numpy
cannot express, its bytes are taken through the library that made it (already imported by
whoever made the tensor). A tensor on an accelerator is refused with advice: the store lands
bytes in host memory, and the caller copies them to the device (the engine adapters do, layer
by layer).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from erasure.codec import byte_view as codec_byte_view
from kvstore.errors import InvalidArgument, InvalidCodecInput

Buffer = Any  # anything byte_view accepts (see the module docstring)
_DLPACK_HOST_DEVICES = (1, 3)  # kDLCPU, kDLCUDAHost (pinned host memory)


def byte_view(buffer: Buffer, what: str) -> memoryview:
    """A flat, C-contiguous byte view of ``buffer`` (see the module docstring); misuse is
    raised as InvalidArgument naming ``what``."""
    try:
        return codec_byte_view(_exported(buffer, what), what)
    except InvalidCodecInput as exc:
        raise InvalidArgument(str(exc)) from None


def writable_view(buffer: Buffer, what: str) -> memoryview:
    """:func:`byte_view` of a buffer the client may write (a ``get_into`` destination)."""
    view = byte_view(buffer, what)
    if view.readonly:
        raise InvalidArgument(
            f"{what} is a read-only {type(buffer).__name__}; reads need writable buffers "
            "(bytearray, numpy array, CPU tensor, a BufferPool slot)"
        )
    return view


def _exported(buffer: Buffer, what: str) -> Any:
    """``buffer`` itself when it has the buffer protocol, else a numpy array sharing its
    memory (a DLPack tensor)."""
    if not hasattr(buffer, "__dlpack__") or _has_buffer_protocol(buffer):
        return buffer
    device_type, device_id = buffer.__dlpack_device__()
    if int(device_type) not in _DLPACK_HOST_DEVICES:
        raise InvalidArgument(
            f"{what} is a tensor on device {int(device_type)}:{device_id}; the store reads and "
            "writes host memory: pass a CPU tensor (pinned where CUDA is present) and copy it "
            "to the device"
        )
    if hasattr(buffer, "detach"):  # a torch tensor that requires grad exports only detached
        buffer = buffer.detach()
    try:
        return np.from_dlpack(buffer)
    except (RuntimeError, TypeError, BufferError):  # a dtype numpy lacks (bfloat16, fp8)
        return _as_uint8(buffer, what)


def _has_buffer_protocol(buffer: Any) -> bool:
    try:
        memoryview(buffer)
    except TypeError:
        return False
    return True


def _as_uint8(tensor: Any, what: str) -> Any:
    """``tensor``'s bytes as a uint8 numpy array, through the library that made it."""
    library = sys.modules.get(type(tensor).__module__.partition(".")[0])
    uint8 = getattr(library, "uint8", None)
    if uint8 is None or not hasattr(tensor, "view") or not hasattr(tensor, "is_contiguous"):
        raise InvalidArgument(f"{what}: numpy cannot view this {type(tensor).__name__}'s dtype")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{what} must be C-contiguous; call .contiguous() first")
    return np.from_dlpack(tensor.reshape(-1).view(uint8))
