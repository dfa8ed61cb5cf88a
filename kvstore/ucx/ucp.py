"""The few libucp calls ucxx's Python API lacks, through ctypes: probe and scatter receives.

ucxx exposes tagged sends and receives of one contiguous buffer. A batch read needs a receive
that scatters one message over many places (each shard payload straight to its place in the
caller's block: UCX's IOV datatype), so the data path probes and receives through libucp's own
C API, on the handles of the ucxx worker (the same libucp instance ucxx loaded)::

    ucp_tag_probe_nb(worker, tag, mask, remove=1, &info) -> message handle (or NULL)
    ucp_tag_msg_recv_nbx(worker, buffer | iov[], count, message, &param) -> request
    ucp_request_check_status(request) -> UCS_INPROGRESS, UCS_OK or an error; then free it

Over shared memory a receive into an IOV makes UCX pick "rendezvous data fetch into iov":
the sender writes each region with CMA (process_vm_writev) once the receiver has matched the
message, so the bytes move once, by the sender, into memory the receiver chose; a contiguous
receive is a CMA read by the receiver. Either way nothing lands before the receiver matched
the message, which is what lets a read stop waiting for a straggler safely (kvstore/ucx/worker.py).

Requests are polled, not called back: a batch has one or two receives per node, and polling
their status after each progress call costs less than a ctypes callback into Python.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from erasure.isal_backend import buffer_address
from kvstore.errors import InvalidArgument, Unavailable

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_MESSAGE_TRUNCATED = -9
_FIRST_ERROR_POINTER = (1 << 64) - 100  # UCS_PTR_IS_ERR: statuses -100..-1 cast to pointers
_OP_ATTR_FIELD_DATATYPE = 1 << 3
_DATATYPE_IOV = 2  # ucp_dt_make_iov()
_ALL_TAG_BITS = (1 << 64) - 1


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


class _Iov(ctypes.Structure):  # ucp_dt_iov_t
    _fields_ = [("buffer", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class Ucp:
    """libucp's probe, scatter-receive and request calls (one instance per process)."""

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
        self._iov = _RequestParam(op_attr_mask=_OP_ATTR_FIELD_DATATYPE, datatype=_DATATYPE_IOV)

    def probe(self, worker: int) -> tuple[int, int, int] | None:
        """(message handle, tag, length) of the oldest unexpected message, taken off the
        worker's queue (it must then be received), or None."""
        handle = self._lib.ucp_tag_probe_nb(worker, 0, 0, 1, ctypes.byref(self._info))
        if not handle:
            return None
        return handle, self._info.sender_tag, self._info.length

    def receive(self, worker: int, message: int, regions: Sequence[Any]) -> Receive:
        """Receive a probed message into ``regions`` in order (one region: contiguous).

        A region is a writable memoryview, or device memory given as an object with
        ``address`` and ``nbytes`` (kvstore/ucx/worker.py wraps CUDA arrays so).
        """
        if len(regions) == 1:
            (region,) = regions
            keep: object = region
            status = self._lib.ucp_tag_msg_recv_nbx(
                worker, _address(region), region.nbytes, message, ctypes.byref(self._contig)
            )
        else:
            iov = (_Iov * len(regions))()
            for entry, region in zip(iov, regions, strict=True):
                entry.buffer, entry.length = _address(region), region.nbytes
            keep = (iov, regions)
            status = self._lib.ucp_tag_msg_recv_nbx(
                worker, ctypes.addressof(iov), len(regions), message, ctypes.byref(self._iov)
            )
        return Receive(self, status, keep)

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
        self._keep = keep  # the IOV array and the regions, alive while UCX may write there
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


def check_regions(regions: Sequence[memoryview]) -> None:
    """Every region must be writable host memory: UCX writes there."""
    for region in regions:
        if region.readonly or not region.contiguous:
            raise InvalidArgument("UCX receive regions must be writable contiguous host memory")
