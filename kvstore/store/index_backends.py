"""The index's backends: a small ordered key-value store with transactions, one byte map per
sub-database (:data:`kvstore.store.index_codec.DBS`).

lmdb on a node (:class:`LmdbBackend`) and a sorted in-memory twin (:class:`MemoryBackend`) for
unit tests and the simulator: both keep the same :class:`Txn` semantics, so the index logic
(kvstore/store/index.py) is written once and one test suite runs against both.

Disk space (lmdb only, :class:`LmdbBackend`): the index never writes into a page the filesystem
has not allocated. lmdb maps its files; a page of a sparse file that a full disk cannot back
kills the process with SIGBUS (seen on a full tmpfs: lock.mdb's reader table). So ``lock.mdb`` is
allocated whole before lmdb maps it (a new index on a full disk is refused with
CapacityExhausted), and ``data.mdb`` is kept allocated ``reserve_bytes`` ahead of lmdb's last
page (``posix_fallocate``): the index's own writes land in space the node already holds, puts
are refused (CapacityExhausted) once that reserve cannot be kept, and deletes, expiry and
eviction still commit from what is left. The allocated size counts inside the node's byte limit:
each file's size rounded up to whole pages, since both are allocated whole. Not ``st_blocks``:
that also counts the filesystem's own metadata, which moves with the write pattern (ext4 adds
an extent tree block once writes split the fallocated, unwritten extent into more than four,
xfs its bmap blocks and speculative preallocation), so the node's capacity would shrink by a
page when nothing but the index's write order changed.
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

import lmdb

from kvstore.errors import CapacityExhausted, IndexUnusable
from kvstore.store.index_check import check_index_pages
from kvstore.store.index_codec import DBS

DEFAULT_RESERVE_BYTES = 32 << 20
# lmdb's lock file with its default 126 reader slots: a 128-byte header and 64 bytes a slot.
LOCK_FILE_BYTES = 8192
# Page-level lmdb failures that mean the file is damaged, not that a request was wrong.
_CORRUPT_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError)


class Txn(Protocol):
    """The backend's transaction: an ordered byte map per named sub-database."""

    def get(self, db: str, key: bytes) -> bytes | None: ...

    def put(self, db: str, key: bytes, value: bytes) -> None: ...

    def put_many(self, db: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        """``put`` of every ``(key, value)``, in order (a batch of rows in one call)."""
        ...

    def delete(self, db: str, key: bytes) -> None: ...

    def scan(
        self, db: str, start: bytes, stop: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        """Up to ``limit`` items with ``start <= key < stop`` (no stop: to the end), ascending."""
        ...


class Backend(Protocol):
    reserve_bytes: int  # write space kept allocated ahead (0: none needed)

    def begin(self, *, write: bool) -> AbstractContextManager[Txn]:
        """A transaction: commits when the block exits normally, aborts on an exception."""
        ...

    def allocated_bytes(self) -> int:
        """Disk bytes the backend holds (0 in memory)."""
        ...

    def ensure_reserve(self) -> bool:
        """Keep write space allocated ahead; False when the disk cannot give it."""
        ...

    def headroom_bytes(self) -> int:
        """Space allocated ahead that writes can still use."""
        ...

    def verify(self) -> None:
        """Read everything once; IndexUnusable if the backend is damaged."""
        ...

    def close(self) -> None: ...


class _LmdbTxn:
    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, lmdb._Database]) -> None:
        self.txn: lmdb.Transaction | None = txn  # None once the transaction ended
        self._dbs = dbs

    @property
    def _txn(self) -> lmdb.Transaction:
        assert self.txn is not None, "index view used after its transaction ended"
        return self.txn

    def get(self, db: str, key: bytes) -> bytes | None:
        return self._txn.get(key, db=self._dbs[db])

    def put(self, db: str, key: bytes, value: bytes) -> None:
        self._txn.put(key, value, db=self._dbs[db])

    def put_many(self, db: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        self._txn.cursor(db=self._dbs[db]).putmulti(items)

    def delete(self, db: str, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs[db])

    def scan(
        self, db: str, start: bytes, stop: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        items: list[tuple[bytes, bytes]] = []
        cursor = self._txn.cursor(db=self._dbs[db])
        if not cursor.set_range(start):
            return items
        for key, value in cursor.iternext():
            if (stop is not None and key >= stop) or len(items) >= limit:
                break
            items.append((key, value))
        return items


class LmdbBackend:
    """lmdb environment under ``path``; ``sync`` = fsync on every commit (durability).

    ``reserve_bytes``: disk space kept allocated ahead of lmdb's last page (module docstring).
    The map itself is a large virtual reservation (``map_size_bytes``); only the file's
    allocated size costs disk. Raises IndexUnusable if the files are not a readable lmdb
    environment.
    """

    def __init__(
        self,
        path: Path,
        *,
        sync: bool,
        map_size_bytes: int = 1 << 40,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    ) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.reserve_bytes = reserve_bytes
        # The reader table is written through a mapping: allocate it whole before lmdb maps
        # it (lmdb only ftruncates it, and a page a full disk cannot back is a SIGBUS). The
        # descriptor stays open until the environment closes: closing any descriptor of a
        # file drops every fcntl lock this process holds on it, lmdb's shared lock on
        # lock.mdb too; the next process to open the index (the scrub's check) would then
        # take it as unused and reset its reader table and write mutex under our open
        # transactions.
        self._lock_fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _allocate_whole(self._lock_fd, path / "lock.mdb", LOCK_FILE_BYTES)
            self._env, self._dbs = _open_env(path, map_size_bytes, sync)
            _allocate_whole(self._lock_fd, path / "lock.mdb", 0)  # as lmdb sized it
            self._data_fd = os.open(path / "data.mdb", os.O_RDWR)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.ensure_reserve()

    @contextmanager
    def begin(self, *, write: bool) -> Iterator[Txn]:
        try:
            wrapper = _LmdbTxn(self._env.begin(write=write), self._dbs)
            try:
                with wrapper.txn:
                    yield wrapper
            finally:
                # py-lmdb frees a read txn's reader slot only when the Transaction object is
                # freed, and a view may outlive its block (an exception's traceback holds the
                # frames that used it: a failed put's). Enough of those filled lmdb's reader
                # table (MDB_READERS_FULL), so the wrapper lets go of the txn here.
                wrapper.txn = None
        except lmdb.MapFullError as exc:
            raise CapacityExhausted(
                f"the lmdb index is full ({exc}); raise its map size or free entries"
            ) from None
        except _CORRUPT_ERRORS as exc:
            raise IndexUnusable(f"the index in {self.path} is damaged: {exc}") from exc
        except lmdb.Error as exc:  # lmdb reports errno failures by their strerror text
            if not _disk_full(exc, self.path):
                raise
            raise CapacityExhausted(f"disk full while committing the index: {exc}") from exc

    def used_bytes(self) -> int:
        """Bytes of the data file up to lmdb's last page (what the index occupies)."""
        info, stat = self._env.info(), self._env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    def allocated_bytes(self) -> int:
        """Disk bytes the index's files hold (its share of the node's byte limit)."""
        return sum(_allocated(self.path / name) for name in ("data.mdb", "lock.mdb"))

    def ensure_reserve(self) -> bool:
        """Keep the data file allocated ``reserve_bytes`` past lmdb's last page; False when the
        disk cannot give that much (then only the space left ahead remains for writes)."""
        want = self.used_bytes() + self.reserve_bytes
        if os.fstat(self._data_fd).st_size >= want - self.reserve_bytes // 2:
            return True
        try:
            os.posix_fallocate(self._data_fd, 0, want)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            return False
        return True

    def headroom_bytes(self) -> int:
        """Allocated bytes past lmdb's last page: what index writes can still use."""
        return os.fstat(self._data_fd).st_size - self.used_bytes()

    def verify(self) -> None:
        """Read every page of every sub-database; IndexUnusable if any fails. In a child
        process (kvstore/store/index_check.py): lmdb aborts the process that steps onto a
        damaged leaf."""
        damage = check_index_pages(self.path, DBS)
        if damage is not None:
            raise IndexUnusable(damage)

    def close(self) -> None:
        self._env.close()
        os.close(self._data_fd)
        os.close(self._lock_fd)  # after the environment: lmdb's lock is gone by now


def _allocated(path: Path) -> int:
    """A file allocated whole (no holes): its size rounded up to whole pages."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def _open_env(
    path: Path, map_size_bytes: int, sync: bool
) -> tuple[lmdb.Environment, dict[str, lmdb._Database]]:
    """lmdb's environment in ``path`` and its sub-databases; a damaged index is
    IndexUnusable, a full disk CapacityExhausted (a clear error, not lmdb's traceback)."""
    try:
        env = lmdb.open(
            str(path), map_size=map_size_bytes, max_dbs=len(DBS), sync=sync, readahead=False
        )
        return env, {name: env.open_db(name.encode()) for name in DBS}
    except (*_CORRUPT_ERRORS, lmdb.VersionMismatchError) as exc:
        raise IndexUnusable(f"the index in {path} cannot be opened: {exc}") from exc
    except lmdb.Error as exc:
        if not _disk_full(exc, path):
            raise
        raise CapacityExhausted(f"disk full: the index in {path} cannot be opened: {exc}") from exc


def _allocate_whole(fd: int, path: Path, min_bytes: int) -> None:
    """Allocate every byte of the open file ``fd``, at least ``min_bytes`` (no holes for a
    mapping to fault on). An index whose lock file was allocated before needs no new space,
    so only a node whose index is new can be refused here: it holds nothing yet, and a full
    disk is a clear CapacityExhausted instead of a SIGBUS at its first reader."""
    try:
        os.posix_fallocate(fd, 0, max(os.fstat(fd).st_size, min_bytes, 1))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise CapacityExhausted(
            f"disk full: the index's lock file {path} cannot be allocated ({exc}); free space "
            f"on {path.parent} and start the node again"
        ) from None


def _disk_full(exc: lmdb.Error, path: Path) -> bool:
    """Whether an lmdb write failure is the disk running out: ENOSPC, or the EIO lmdb reports
    for a short write, on a filesystem with (almost) nothing left."""
    text = str(exc)
    if os.strerror(errno.ENOSPC) in text:
        return True
    return os.strerror(errno.EIO) in text and shutil.disk_usage(path).free < 1 << 20


class _SortedMap:
    """A dict with its keys kept sorted, for range scans in the in-memory twin."""

    def __init__(self) -> None:
        self.items: dict[bytes, bytes] = {}
        self.keys: list[bytes] = []

    def put(self, key: bytes, value: bytes) -> None:
        if key not in self.items:
            bisect.insort(self.keys, key)
        self.items[key] = value

    def delete(self, key: bytes) -> None:
        if self.items.pop(key, None) is not None:
            del self.keys[bisect.bisect_left(self.keys, key)]


class _MemoryTxn:
    def __init__(self, maps: dict[str, _SortedMap], undo: list | None) -> None:
        self._maps = maps
        self._undo = undo  # None: read-only

    def get(self, db: str, key: bytes) -> bytes | None:
        return self._maps[db].items.get(key)

    def put(self, db: str, key: bytes, value: bytes) -> None:
        self._record(db, key)
        self._maps[db].put(key, value)

    def put_many(self, db: str, items: Sequence[tuple[bytes, bytes]]) -> None:
        for key, value in items:
            self.put(db, key, value)

    def delete(self, db: str, key: bytes) -> None:
        self._record(db, key)
        self._maps[db].delete(key)

    def scan(
        self, db: str, start: bytes, stop: bytes | None, limit: int
    ) -> list[tuple[bytes, bytes]]:
        smap = self._maps[db]
        first = bisect.bisect_left(smap.keys, start)
        last = len(smap.keys) if stop is None else bisect.bisect_left(smap.keys, stop)
        keys = smap.keys[first : min(last, first + limit)]
        return [(k, smap.items[k]) for k in keys]

    def _record(self, db: str, key: bytes) -> None:
        if self._undo is None:
            raise RuntimeError("write in a read-only transaction (open it with write=True)")
        self._undo.append((db, key, self._maps[db].items.get(key)))

    def rollback(self) -> None:
        for db, key, old in reversed(self._undo or []):
            if old is None:
                self._maps[db].delete(key)
            else:
                self._maps[db].put(key, old)


class MemoryBackend:
    """The in-memory twin of :class:`LmdbBackend`: same semantics, no durability.

    Transactions are serialized by one lock (a twin for tests and the simulator, not a server).
    """

    reserve_bytes = 0

    def __init__(self) -> None:
        self._maps = {name: _SortedMap() for name in DBS}
        self._lock = threading.RLock()

    @contextmanager
    def begin(self, *, write: bool) -> Iterator[Txn]:
        with self._lock:
            txn = _MemoryTxn(self._maps, [] if write else None)
            try:
                yield txn
            except BaseException:
                txn.rollback()
                raise

    def used_bytes(self) -> int:
        return 0

    def allocated_bytes(self) -> int:
        return 0

    def ensure_reserve(self) -> bool:
        return True

    def headroom_bytes(self) -> int:
        return 1 << 62

    def verify(self) -> None:
        return None

    def close(self) -> None:
        self._maps = {name: _SortedMap() for name in DBS}
