"""What every report stage writes, written once: Markdown tables, sections, figures.

Tables: cells are escaped (a ``|`` inside a cell would split it into two columns: `\\|`, which
``evidence.html`` reads back as one cell) and every row must have the header's width (a short row
silently shifts every later column). Figures: the headless Agg backend (no display on a CI runner or
a TPU VM), tight layout, the save and the close (a figure left open holds its memory for the life of
the process). How numbers are formatted stays with the callers: they know the unit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path


def cell(value: object) -> str:
    """One table cell: ``str(value)`` on one line, its ``|`` escaped."""
    return " ".join(str(value).splitlines()).replace("|", "\\|")


def _row(cells: Sequence[str]) -> str:
    # an empty cell is "| |", not "|  |": the form the reports had before this module
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def table(headers: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table (no trailing newline). Raises ValueError on a row of the wrong width."""
    head = [cell(h) for h in headers]
    lines = [_row(head), "|" + "---|" * len(head)]
    for i, r in enumerate(rows):
        cells = [cell(c) for c in r]
        if len(cells) != len(head):
            raise ValueError(
                f"table row {i} has {len(cells)} cells, the header {len(head)}: {cells}"
            )
        lines.append(_row(cells))
    return "\n".join(lines)


def section(title: str, *blocks: str, level: int = 2) -> str:
    """``## title`` and its blocks, a blank line between each (no trailing newline)."""
    return "\n\n".join([f"{'#' * level} {title}", *blocks])


# pyplot's figure registry is global and not thread-safe; the capstone draws from two stage
# threads at once (``Stages.together``), so one figure is drawn at a time.
_PYPLOT = threading.RLock()


@contextlib.contextmanager
def figure(path: str | Path, *, dpi: int = 110, **subplots) -> Iterator[tuple]:
    """``with figure(path, figsize=(8, 4)) as (fig, ax):`` draw; on leaving, lay out, save to
    ``path`` (its directory made) and close. ``subplots`` goes to ``plt.subplots`` (``nrows``,
    ``ncols``, ``sharex``, ...). An exception in the body closes the figure and saves nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with _PYPLOT:
        fig, axes = plt.subplots(**subplots)
        try:
            yield fig, axes
            fig.tight_layout()
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=dpi)
        finally:
            plt.close(fig)
