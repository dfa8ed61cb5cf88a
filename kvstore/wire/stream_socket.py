"""A TCP connection of the stream read channel, plain or TLS, that one thread reads while
others send.

The stream channel (kvstore/node/stream_server.py, client/stream/) reads on a dedicated
thread at each end and sends from others (the client's event loop; the node's delayed
answers). A kernel socket allows that; an OpenSSL connection does not (one ``SSL`` object
may not be used by two threads at once). So a TLS socket here is non-blocking, every call
into it holds one lock, and the waits for the kernel (readable, writable) happen outside
the lock: a reader waiting for data never blocks a sender, and neither ever runs inside
OpenSSL beside the other. A plain socket takes no lock and blocks as usual.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading

SEND_SLICE_BYTES = 1 << 20  # a TLS send's slice: the lock is held this long at most


class StreamSocket:
    """``sock`` (connected; an ``ssl.SSLSocket`` whose handshake is done, or a plain one)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._lock = threading.Lock()
        if self.tls:
            sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_into(self, view: memoryview) -> int:
        """Up to ``len(view)`` bytes into ``view`` (blocking until some came); 0 at EOF."""
        if not self.tls:
            return self.sock.recv_into(view)
        assert isinstance(self.sock, ssl.SSLSocket)
        while True:
            with self._lock:
                try:
                    return self.sock.recv_into(view)
                except ssl.SSLWantReadError:
                    pending = self.sock.pending()
                except ssl.SSLWantWriteError:
                    pending = -1
            if pending <= 0:
                _wait(self.sock, writable=pending < 0)

    def sendall(self, *buffers: bytes | memoryview) -> None:
        """Send every buffer, in order (blocking); OSError if the connection is gone."""
        if not self.tls:
            for data in buffers:
                self.sock.sendall(data)
            return
        for data in buffers:
            view = memoryview(data).cast("B")
            sent = 0
            while sent < len(view):
                piece = view[sent : sent + SEND_SLICE_BYTES]
                with self._lock:
                    try:
                        sent += self.sock.send(piece)
                        continue
                    except ssl.SSLWantWriteError:
                        writable = True
                    except ssl.SSLWantReadError:
                        writable = False
                # OpenSSL asks for the same slice again once the kernel has room.
                _wait(self.sock, writable=writable)

    def shutdown(self, how: int = socket.SHUT_RDWR) -> None:
        """Wake the reader (it sees EOF) and fail later sends; close() still to be called."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(how)

    def close(self) -> None:
        with self._lock:
            self.sock.close()


def _wait(sock: socket.socket, *, writable: bool) -> None:
    """Until ``sock`` is readable (or writable); a closed socket returns at once."""
    poller = select.poll()
    try:
        poller.register(sock.fileno(), select.POLLOUT if writable else select.POLLIN)
    except ValueError:  # closed: the next call raises
        return
    poller.poll()
