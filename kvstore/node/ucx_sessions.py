"""The node's UCX read sessions: who may read over UCX, which has no TLS.

A client opens a session over the node's identity-checked gRPC channel (``OpenUcxSession``,
kvstore/node/servicer.py), where its credential is checked as for any RPC. The node hands
back a random session id and key; the client signs each UCX request frame with the key and
checks the node's signed reply (kvstore/wire/ucx_frames.py). So the bearer token never
crosses UCX, and a process that took the node's UCX address cannot answer as the node.

A session remembers the credential it was opened with: the bearer token, checked again on
every request (a revoked token stops at once, as over gRPC), or the principal of a client
certificate. Sessions expire ``SESSION_TTL_S`` after they are opened (the client opens a
new one before that), and at most ``MAX_SESSIONS`` are kept, the oldest forgotten first, so
a client that opens sessions in a loop costs the node bounded memory.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.node.reads import Credential
from kvstore.wire.ucx_frames import SESSION_ID_BYTES, SESSION_KEY_BYTES

SESSION_TTL_S = 3600.0
MAX_SESSIONS = 1 << 16


@dataclass(frozen=True)
class UcxSession:
    credential: Credential  # what a read of this session acts as (kvstore/node/reads.py)
    key: bytes  # signs the session's request and reply frames
    expires_at_s: float  # on the sessions' clock


class UcxSessions:
    """Open sessions by id (see the module doc). Thread-safe: the gRPC face opens them, the
    UCX face looks them up."""

    def __init__(
        self,
        ttl_s: float = SESSION_TTL_S,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self._max_sessions, self._clock = ttl_s, max_sessions, clock
        self._sessions: OrderedDict[bytes, UcxSession] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def open(self, credential: Credential) -> tuple[bytes, UcxSession]:
        """A new session for ``credential``: (its id, the session)."""
        session_id = secrets.token_bytes(SESSION_ID_BYTES)
        session = UcxSession(
            credential, secrets.token_bytes(SESSION_KEY_BYTES), self._clock() + self.ttl_s
        )
        with self._lock:
            self._sessions[session_id] = session
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return session_id, session

    def find(self, session_id: bytes) -> UcxSession | None:
        """The session ``session_id`` names, or None if unknown or expired (forgotten then,
        with every older expired one)."""
        now_s = self._clock()
        with self._lock:
            while self._sessions:  # expiry follows opening order: the oldest expire first
                oldest_id, oldest = next(iter(self._sessions.items()))
                if oldest.expires_at_s > now_s:
                    break
                del self._sessions[oldest_id]
            return self._sessions.get(session_id)

    def __len__(self) -> int:
        return len(self._sessions)
