"""Byte-histogram drift: how far the bytes a service is asked about are from its training corpus.

The statistic is the Jensen-Shannon divergence (base 2, so in [0, 1]) between the byte histogram
of the most recent ``window_bytes`` prompt bytes and the training corpus's byte histogram. JSD is
symmetric, bounded and finite when either side has empty bins (a KL divergence is infinite the
first time a prompt holds a byte the corpus never had), so it needs no smoothing constant.

The window and threshold are measured with this statistic as the service feeds it, prompts one
line each (``benchmarks/drift_threshold.py``; raw values in ``benchmarks/results/drift_threshold``):
at 8192 bytes, every window position of the default corpus's training plays stays at or below JSD
0.033 (158988 windows) and of its held-out plays at or below 0.023 (15858), while English prose
that is not Shakespeare (this repository's docs) starts at 0.053 and Python source at 0.067:
0.045 sits in that gap, and no play window crosses it. Legal English (GPL-3) is nearer the plays:
421 of its 513 windows cross. Smaller windows overlap (at 4096 bytes training windows reach 0.047,
at 2048 0.10): a sample's JSD grows with its sampling noise over 256 bins, so no alarm is raised on
fewer than ``window_bytes``. The statistic sees the prompts' format too: lines sent without their
newline read about 0.02 higher (held-out plays then reach 0.041, and 598 of 158548 training windows
cross 0.045).
"""

from __future__ import annotations

import collections
import threading

import numpy as np

BINS = 256
WINDOW_BYTES = 8192  # the prompt bytes the statistic looks at (the newest ones)
THRESHOLD = 0.045  # JSD (bits) above which the alarm fires (measured: see the module docstring)


def byte_histogram(data: bytes) -> np.ndarray:
    """Counts of each byte value, int64[256]."""
    return np.bincount(np.frombuffer(data, np.uint8), minlength=BINS).astype(np.int64, copy=False)


def js_divergence(p_counts, q_counts) -> float:
    """Jensen-Shannon divergence in bits between two count (or probability) vectors."""
    p, q = np.asarray(p_counts, np.float64), np.asarray(q_counts, np.float64)
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"histograms of shapes {p.shape} and {q.shape} are not comparable")
    if (p < 0).any() or (q < 0).any() or p.sum() <= 0 or q.sum() <= 0:
        raise ValueError("a histogram needs non-negative counts and at least one count")
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a):  # sum of a * log2(a / m) over a > 0 (where a > 0, m > 0 too)
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return min(1.0, max(0.0, (kl(p) + kl(q)) / 2))


class DriftWindow:
    """The newest ``window_bytes`` bytes seen (whole prompts; the oldest dropped once the rest still
    fill the window) and their JSD against a reference histogram (None: no statistic, NaN).
    Thread-safe: the service observes in its event loop and a scrape reads from any thread."""

    def __init__(
        self, reference_counts=None, window_bytes: int = WINDOW_BYTES, threshold: float = THRESHOLD
    ):
        if window_bytes < 1 or not 0 < threshold < 1:
            raise ValueError(f"window_bytes={window_bytes} and threshold={threshold} out of range")
        self.window_bytes, self.threshold = int(window_bytes), float(threshold)
        self._items: collections.deque[tuple[np.ndarray, int]] = collections.deque()
        self._sum = np.zeros(BINS, np.int64)
        self._n = 0  # bytes in the window (kept as an int: observe runs on every request)
        self._lock = threading.Lock()
        self.reference: np.ndarray | None = None
        self.set_reference(reference_counts)

    def set_reference(self, reference_counts) -> None:
        ref = None
        if reference_counts is not None:
            ref = np.asarray(reference_counts, np.int64)
            if ref.shape != (BINS,) or (ref < 0).any() or ref.sum() == 0:
                raise ValueError("a reference is 256 non-negative byte counts, not all zero")
        with self._lock:
            self.reference = ref

    def observe(self, data: bytes) -> None:
        if not data:
            return
        h = byte_histogram(data)
        with self._lock:
            self._items.append((h, len(data)))
            self._sum += h
            self._n += len(data)
            while len(self._items) > 1 and self._n - self._items[0][1] >= self.window_bytes:
                old, n = self._items.popleft()
                self._sum -= old
                self._n -= n

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._n

    def value(self) -> float:
        """JSD of the window against the reference; NaN before any byte, or without a reference."""
        with self._lock:
            counts, ref, n = self._sum.copy(), self.reference, self._n
        if ref is None or not n:
            return float("nan")
        return js_divergence(counts, ref)

    def alarm(self) -> bool:
        """True while a full window's JSD exceeds the threshold."""
        return self.bytes >= self.window_bytes and self.value() > self.threshold
