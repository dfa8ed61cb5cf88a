"""The few libucp calls the data path makes through ctypes: probe, and receive by handle.

ucxx's Python API receives a probed message only through its own request objects (one Python
object, with its own bookkeeping, per message). A batch read receives one message per shard
straight into its place, so the worker probes and receives through libucp's C API, on the
handles of the ucxx worker (the same libucp instance ucxx loaded)::

    ucp_tag_probe_nb(worker, tag=0, mask=0, remove=1, &info) -> message handle (or NULL)
    ucp_tag_msg_recv_nbx(worker, buffer, length, message, &param) -> NULL (done) or request
    ucp_request_check_status(request) -> UCS_INPROGRESS, UCS_OK or an error; then free it

Over shared memory a receive of a rendezvous message is one CMA read by the receiver, done
inside ``ucp_tag_msg_recv_nbx``: the receive is usually complete when the call returns.
Requests are polled, not called back: a ctypes callback into Python costs more than a poll.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from erasure.isal_backend import buffer_address
from kvstore.errors import Unavailable

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_MESSAGE_TRUNCATED = -9
_FIRST_ERROR_POINTER = (1 << 64) - 100  # UCS_PTR_IS_ERR: statuses -100..-1 cast to pointers


class _RecvInfo(ctypes.Structure):  # ucp_tag_recv_info_t
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


class _RequestParam(ctypes.Structure):  # ucp_request_param_t (UCX 1.21 ucp.h)
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class Ucp:
    """libucp's probe, receive and request calls (one instance per process)."""

    def __init__(self, lib_path: Path) -> None:
        lib = ctypes.CDLL(str(lib_path))  # already loaded by ucxx: the same library instance
        lib.ucp_tag_probe_nb.restype = ctypes.c_void_p
        lib.ucp_tag_probe_nb.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.POINTER(_RecvInfo),
        ]
        lib.ucp_tag_msg_recv_nbx.restype = ctypes.c_void_p
        lib.ucp_tag_msg_recv_nbx.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.POINTER(_RequestParam),
        ]
        lib.ucp_request_check_status.restype = ctypes.c_int
        lib.ucp_request_check_status.argtypes = [ctypes.c_void_p]
        lib.ucp_request_free.argtypes = [ctypes.c_void_p]
        self._lib = lib
        self._info = _RecvInfo()
        self._contig = _RequestParam()

    def probe(self, worker: int) -> tuple[int, int, int] | None:
        """(message handle, tag, length) of the oldest unexpected message, taken off the
        worker's queue (it must then be received), or None."""
        handle = self._lib.ucp_tag_probe_nb(worker, 0, 0, 1, ctypes.byref(self._info))
        if not handle:
            return None
        return handle, self._info.sender_tag, self._info.length

    def receive(self, worker: int, message: int, region: Any) -> Receive:
        """Receive a probed message into ``region``: a writable memoryview, or device memory
        as an object with ``address`` and ``nbytes`` (kvstore/wire/ucx_worker.py wraps CUDA
        arrays so)."""
        status = self._lib.ucp_tag_msg_recv_nbx(
            worker, _address(region), region.nbytes, message, ctypes.byref(self._contig)
        )
        return Receive(self, status, region)

    def check(self, request: int) -> int:
        """The status of a request in flight; a finished request is freed."""
        status = self._lib.ucp_request_check_status(request)
        if status != UCS_INPROGRESS:
            self._lib.ucp_request_free(request)
        return status


class Receive:
    """One receive posted with :meth:`Ucp.receive`; poll :meth:`status` until it is done."""

    def __init__(self, ucp: Ucp, status_pointer: int | None, keep: object) -> None:
        self._ucp = ucp
        self._keep = keep  # the region, alive while UCX may write there
        self._request: int | None = None
        self._status = UCS_OK
        if status_pointer is not None and status_pointer >= _FIRST_ERROR_POINTER:
            self._status = status_pointer - (1 << 64)  # failed at once
        elif status_pointer:
            self._request, self._status = status_pointer, UCS_INPROGRESS

    def status(self) -> int:
        """UCS_INPROGRESS while data may still land; then UCS_OK or the (negative) error."""
        if self._request is not None:
            self._status = self._ucp.check(self._request)
            if self._status != UCS_INPROGRESS:
                self._request, self._keep = None, None
        return self._status


def _address(region: Any) -> int:
    return region.address if hasattr(region, "address") else buffer_address(region)


def load(libucx_dir: Path | None) -> Ucp | None:
    """The bindings over the libucp that ucxx uses, or None without the libucx wheel."""
    if libucx_dir is None:
        return None
    path = libucx_dir / "lib" / "libucp.so.0"
    if not path.exists():
        raise Unavailable(f"libucp not found at {path}; reinstall the ucx extra")
    return Ucp(path)
