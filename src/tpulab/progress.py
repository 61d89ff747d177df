"""Progress over a loop of items (export endpoints, KV-cache policies, benchmark cases): a bar on a
terminal, one plain line per item in logs and subprocesses. The training loop's steps have their
own bar and lines (``tpulab.train.step_progress``): they print by time, not per item.

Written to stdout, like the training loop's progress lines: stderr stays for the one ``error:``
line."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], what: str, total: int | None = None, stream=None) -> Iterator[T]:
    """Yield ``items``: on a terminal a tqdm bar, else a ``[progress] what: i/n`` line per item."""
    stream = stream or sys.stdout
    items = list(items) if total is None else items
    total = len(items) if total is None else total
    if hasattr(stream, "isatty") and stream.isatty():
        from tqdm import tqdm

        yield from tqdm(items, desc=what, total=total, file=stream, dynamic_ncols=True)
        return
    for i, item in enumerate(items, 1):
        yield item
        print(f"[progress] {what}: {i}/{total}", file=stream, flush=True)
