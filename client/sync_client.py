"""``SyncKVClient``: the blocking face of :class:`~client.kv_client.KVClient`, for engines
that call storage from their own threads (vLLM's workers, SGLang's cache controller,
LMCache's lookups).

::

    caller threads (any number)            one background thread
    ---------------------------            ------------------------------------------
    kv.get_batch_into(keys, bufs) --+
    kv.put_batch(keys, blocks) -----+-->   event loop running one KVClient: every call
    kv.submit("put_batch", ...) ----+      is a coroutine on it, run concurrently
         ^ blocks on (or returns) a concurrent.futures.Future of that coroutine

The calls and their results are :class:`KVClient`'s, blocking: a miss is None or False,
misuse and failures raise the same kvstore.errors exceptions the async client raises. Any
number of threads may call at once; the calls overlap on the loop as concurrent coroutines
on one KVClient do. Buffers handed to ``get_batch_into`` are written on the loop thread
until the call returns, so the caller must not touch them before that.

``close()`` (or leaving a ``with`` block) lets background shard writes finish, closes the
channels and stops the thread; calls after it raise InvalidArgument. A client left open is
closed at interpreter exit. A client must not be called from its own loop thread (that
would wait on itself): code running on that loop should use ``client`` (the KVClient)
directly.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from client.kv_client import Buffer, Key, KVClient
from kvstore.config import ClusterConfig
from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

# The KVClient coroutines ``submit`` may start (the data calls; ``close`` has its own method).
SUBMITTABLE = frozenset(
    {
        "put",
        "put_batch",
        "get",
        "get_into",
        "get_batch",
        "get_batch_into",
        "land_batch",
        "contains",
        "match_prefix",
        "delete",
        "node_stats",
        "wait_until_accepted",
    }
)
CLOSE_TIMEOUT_S = 30.0  # for the background writes and channel shutdown at close()


class SyncKVClient:
    """A :class:`KVClient` on a background event-loop thread. Create with :meth:`connect`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self._loop = loop
        self._thread = thread
        self._client: KVClient | None = None
        self._lock = threading.Lock()  # guards _closed against a close() racing a call
        self._closed = False

    @classmethod
    def connect(
        cls,
        cluster_toml: str | Path | ClusterConfig,
        tenant: str,
        token: str | None = None,
        **options: Any,
    ) -> SyncKVClient:
        """Start the loop thread and connect: the arguments and keyword ``options``
        (``transport``, ``tls_cert_file``, ``tls_key_file``) are :meth:`KVClient.connect`'s.

        Raises what ``KVClient.connect`` raises; the thread is stopped again then.
        """
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=_run_loop, args=(loop,), name="kvstore-client", daemon=True
        )
        thread.start()
        sync = cls(loop, thread)

        async def open_client() -> KVClient:
            return await KVClient.connect(cluster_toml, tenant, token, **options)

        try:
            sync._client = _result(asyncio.run_coroutine_threadsafe(open_client(), loop))
        except BaseException:
            sync._stop_loop()
            raise
        _OPEN.add(sync)
        return sync

    @property
    def client(self) -> KVClient:
        """The KVClient itself: only for coroutines running on this client's loop."""
        return self._open_client()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The background loop the KVClient runs on."""
        return self._loop

    @property
    def tenant(self) -> str:
        return self._open_client().tenant

    def submit(self, method: str, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Start ``KVClient.<method>(*args, **kwargs)`` without waiting: a Future of its result.

        For callers that overlap a store call with their own work (the engines' background
        saves, and layer-wise loads: ``land_batch``'s ``on_landed`` then runs on the loop
        thread). ``method`` is one of ``SUBMITTABLE``. The Future raises what the call raises.
        """
        if method not in SUBMITTABLE:
            raise InvalidArgument(
                f"submit({method!r}): not a KVClient data call; use one of {sorted(SUBMITTABLE)}"
            )
        with self._lock:
            client = self._open_client()
            self._check_not_on_loop()
            coroutine = getattr(client, method)(*args, **kwargs)
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _result(self.submit(method, *args, **kwargs))

    def put(self, key: Key, data: Buffer, traffic_class: str = "chat", **kw: Any) -> None:
        """KVClient.put, blocking (``ttl_s=``, ``timeout_s=``): QuorumError below the quorum."""
        self._call("put", key, data, traffic_class, **kw)

    def put_batch(
        self, keys: Sequence[Key], blocks: Sequence[Buffer], *, traffic_class: str, **kw: Any
    ) -> None:
        """KVClient.put_batch, blocking (``ttl_s=``): QuorumError names the keys not stored."""
        self._call("put_batch", keys, blocks, traffic_class=traffic_class, **kw)

    def get(self, key: Key, **kw: Any) -> bytes | None:
        """KVClient.get, blocking: the block or None (a miss)."""
        return self._call("get", key, **kw)

    def get_into(self, key: Key, out: Buffer, **kw: Any) -> bool:
        """KVClient.get_into, blocking: False on a miss."""
        return self._call("get_into", key, out, **kw)

    def get_batch(self, keys: Sequence[Key], **kw: Any) -> list[bytes | None]:
        """KVClient.get_batch, blocking: each key's block or None."""
        return self._call("get_batch", keys, **kw)

    def get_batch_into(
        self, keys: Sequence[Key], buffers: Sequence[Buffer], **kw: Any
    ) -> list[bool]:
        """KVClient.get_batch_into, blocking: True where the block landed in its buffer."""
        return self._call("get_batch_into", keys, buffers, **kw)

    def contains(self, keys: Sequence[Key], **kw: Any) -> list[bool]:
        """KVClient.contains, blocking (TTLs not refreshed)."""
        return self._call("contains", keys, **kw)

    def match_prefix(self, keys: Sequence[Key], **kw: Any) -> int:
        """KVClient.match_prefix, blocking: how many leading keys are readable."""
        return self._call("match_prefix", keys, **kw)

    def delete(self, keys: Sequence[Key], **kw: Any) -> None:
        """KVClient.delete, blocking."""
        self._call("delete", keys, **kw)

    def node_stats(self, **kw: Any) -> dict[str, Any]:
        """KVClient.node_stats, blocking."""
        return self._call("node_stats", **kw)

    def wait_until_accepted(self, timeout_s: float = 30.0) -> None:
        """KVClient.wait_until_accepted, blocking: once every node accepts the token."""
        self._call("wait_until_accepted", timeout_s)

    def counters(self) -> dict[str, int]:
        """The KVClient's read and write counters."""
        return self._open_client().counters()

    def close(self) -> None:
        """Let background writes finish, close the channels, stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._check_not_on_loop()
            self._closed = True
        _OPEN.discard(self)
        try:
            if self._client is not None:
                future = asyncio.run_coroutine_threadsafe(self._client.close(), self._loop)
                future.result(CLOSE_TIMEOUT_S)
        except Exception:  # closing must not raise on a broken store; say so and go on
            log.warning("closing the kvstore client failed", exc_info=True)
        finally:
            self._stop_loop()

    def __enter__(self) -> SyncKVClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open_client(self) -> KVClient:
        if self._closed or self._client is None:
            raise InvalidArgument("this SyncKVClient is closed; connect a new one")
        return self._client

    def _check_not_on_loop(self) -> None:
        if threading.current_thread() is self._thread:
            raise InvalidArgument(
                "a SyncKVClient was called from its own loop thread, which would wait on "
                "itself; coroutines on that loop must await .client (the KVClient) instead"
            )

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()
    # Stopped by close(): cancel what is left (a caller interrupted mid-call) so nothing
    # runs against closed channels.
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _result(future: concurrent.futures.Future[Any]) -> Any:
    """Wait for ``future``; if the waiting thread is interrupted, cancel the call too."""
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


_OPEN: weakref.WeakSet[SyncKVClient] = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    for sync in list(_OPEN):
        sync.close()
