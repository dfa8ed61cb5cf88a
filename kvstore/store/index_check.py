"""Read every page of an lmdb index in a child process: ``python -m kvstore.store.index_check DIR``.

Why a child: lmdb trusts its pages. A lookup from the root checks each page's type and fails
with MDB_CORRUPTED, but a cursor stepping to the next leaf does not: on a leaf whose header was
damaged it fails an assertion inside lmdb, which aborts the whole process (``mdb.c: Assertion
'IS_LEAF(mp)' failed in mdb_cursor_next()``). A node that read its own damaged index through
would die there, at every restart too, instead of moving it aside and rebuilding it. The child
dies in its place, and its exit says what it found:

    0              every page of every sub-database read
    EXIT_DAMAGED   lmdb reported a damaged page (its message on stderr)
    killed         lmdb aborted (SIGABRT) or the mapping faulted (SIGSEGV, SIGBUS) on a page

The child opens the index read-only beside the node's own handle (lmdb is multi-process), so
it reads one committed snapshot while the node goes on writing. It imports lmdb and nothing of
ours but this module: it starts in tens of milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_DAMAGED = 3
_DAMAGE_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)
_REPO_ROOT = Path(__file__).resolve().parents[2]


class IndexCheckFailed(RuntimeError):
    """The check itself could not run (no process, out of memory): says nothing of the index."""


def check_index_pages(path: Path, db_names: Sequence[str]) -> str | None:
    """Read every page of ``db_names`` in the lmdb index at ``path``, in a child process.

    Returns None when every page read, or lmdb's words for the damage it met. Raises
    IndexCheckFailed when the child failed for another reason.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    try:
        done = subprocess.run(
            [sys.executable, "-m", __name__, str(path), *db_names],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    except OSError as exc:
        raise IndexCheckFailed(f"the index check could not start: {exc}") from exc
    said = done.stderr.strip().splitlines()[-1:] or ["(nothing on stderr)"]
    if done.returncode == 0:
        return None
    if done.returncode == EXIT_DAMAGED:
        return said[0]
    if -done.returncode in _DAMAGE_SIGNALS:
        return f"lmdb died reading a page ({signal.Signals(-done.returncode).name}): {said[0]}"
    raise IndexCheckFailed(f"the index check exited {done.returncode}: {said[0]}")


def _read_through(path: Path, db_names: Sequence[str]) -> None:
    """Walk every row of every named sub-database (the child's work)."""
    import lmdb  # the child's only dependency

    env = lmdb.open(str(path), readonly=True, max_dbs=len(db_names) + 1, readahead=False)
    try:
        with env.begin() as txn:
            for name in db_names:
                cursor = txn.cursor(db=env.open_db(name.encode(), txn=txn, create=False))
                if cursor.first():
                    for _ in cursor.iternext():  # every value too: overflow pages are read
                        pass
    finally:
        env.close()


def main(argv: Sequence[str]) -> int:
    import lmdb

    path, *db_names = argv
    try:
        _read_through(Path(path), db_names)
    except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError) as exc:
        print(f"the index in {path} is damaged: {exc}", file=sys.stderr)
        return EXIT_DAMAGED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
