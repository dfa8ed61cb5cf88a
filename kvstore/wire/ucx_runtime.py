"""UCX as the data path loads it: the optional ucxx binding (imported on first use), the
worker's context, and the tag space of requests and batches (kvstore/wire/ucx_worker.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.wire import ucp

# ucxx sets UCX_MEMTYPE_CACHE, which this UCX release no longer knows and warns about.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

# ucxx's binding, its Array and the libucp bindings, loaded on first use (ucx_available):
# importing ucxx takes seconds on a busy machine, which a gRPC-only process (and every
# `kvstore ... --help`) should not pay. None until then, and where the `ucx` extra is missing.
# Read them as attributes of this module (``ucx_runtime.ucx_api``), never imported by name.
ucx_api: Any = None
Array: Any = None
UCP: ucp.Ucp | None = None
_ucx_tried = False

INSTALL_HINT = "install the ucx extra (`pip install 'kvstore[ucx]'`) or use transport='grpc'"
MAX_TAG = (1 << 64) - 1
# A batch of messages shares one tag base: message i travels with tag `tag_base + i`.
BATCH_INDEX_BITS = 20
MAX_BATCH_MESSAGES = 1 << BATCH_INDEX_BITS
# The tag of read requests sent to a node (kvstore/wire/ucx_frames.py). Client batch tags live on
# client workers, so they never meet it.
REQUEST_TAG = MAX_TAG


def ucx_available() -> bool:
    """True when ucxx can be imported (the optional `ucx` extra is installed); imports it."""
    global ucx_api, Array, UCP, _ucx_tried
    if not _ucx_tried:
        _ucx_tried = True
        try:
            import libucx
            import ucxx._lib.libucxx as api
            from ucxx._lib.arr import Array as array_type
        except ImportError:  # the optional `ucx` extra is not installed
            return False
        UCP = ucp.load(Path(libucx.__file__).parent)
        ucx_api, Array = api, array_type
    return ucx_api is not None


def make_context(transports: str | None) -> Any:
    """A UCX context with tag matching and wakeups, on ``transports`` (UCX_TLS) or UCX's choice."""
    config = {"TLS": transports} if transports else {}
    try:
        return ucx_api.UCXContext(config, (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    except ucx_api.UCXError as exc:
        raise InvalidArgument(
            f"UCX cannot start with transports {transports!r} ({exc}); use None for UCX's "
            "choice, or names such as 'tcp', 'sm' (shared memory), 'cma', 'self'"
        ) from exc


def batch_tag(tag_base: int, index: int) -> int:
    """The tag of message ``index`` of the batch starting at ``tag_base``."""
    if tag_base % MAX_BATCH_MESSAGES or not 0 <= tag_base <= MAX_TAG:
        raise InvalidArgument(
            f"tag base {tag_base:#x} must be a 64-bit value with its low {BATCH_INDEX_BITS} "
            "bits zero (the client makes them with UcxTransport.new_batch)"
        )
    if not 0 <= index < MAX_BATCH_MESSAGES:
        raise InvalidArgument(
            f"message index {index} is outside a batch of at most {MAX_BATCH_MESSAGES}; "
            "split the request"
        )
    return tag_base + index


def check_tag(tag: int) -> None:
    if not 0 <= tag <= MAX_TAG:
        raise InvalidArgument(f"UCX tag {tag} is not an unsigned 64-bit integer")
