"""Tables that stay readable in a narrow terminal: columns are left out, never folded.

Rich folds a cell that does not fit, and a number folded over three lines ("16,1 / 98,3 / 04")
is worse than no number. So every command's table goes through :func:`print_fitted`: when
the table is wider than the console (80 columns in a small terminal), columns are dropped
from the right, sparing the first and the ones named in ``keep``, and the caption says which
were left out. A console that is not a terminal (a file, a pipe, a CI log) is given room for
the whole table.
"""

from __future__ import annotations

import sys
from collections.abc import Collection

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

WIDTH_OFF_TERMINAL = 200


def make_console(*, stderr: bool = False) -> Console:
    """A console as wide as the terminal, or wide enough for any table off a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else WIDTH_OFF_TERMINAL)


def fit_to_width(table: Table, console: Console, keep: Collection[str] = ()) -> Table:
    """``table`` with columns dropped from the right until it fits ``console.width``."""
    left_out = []
    while _natural_width(table, console) > console.width:
        droppable = [
            i for i, column in enumerate(table.columns) if i > 0 and str(column.header) not in keep
        ]
        if not droppable:
            break
        left_out.append(str(table.columns.pop(droppable[-1]).header).replace("\n", " "))
    if left_out:
        note = f"left out at {console.width} columns: {', '.join(reversed(left_out))}"
        table.caption = f"{table.caption}; {note}" if table.caption else note
    return table


def print_fitted(table: Table, console: Console | None = None, keep: Collection[str] = ()) -> None:
    """Print ``table`` on ``console`` (default: :func:`make_console`), fitted to its width."""
    console = console or make_console()
    console.print(fit_to_width(table, console, keep))


def _natural_width(table: Table, console: Console) -> int:
    return Measurement.get(console, console.options.update(width=1 << 16), table).maximum
