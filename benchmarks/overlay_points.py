"""Read the per-step |run - reference| values back from a proof's overlay.png.

For results whose metrics were not kept (``benchmarks/results/gpu_h200/``: the tarballs carried the
verdicts and the plots, not ``metrics.jsonl``), the lower panel of ``overlay.png``
(``tpulab.proofs.driver.plot_overlay``) is the raw record of every step: one purple marker per step,
on a symlog axis (linear below 1e-8, one decade per major tick above). This script finds that
panel's axes from the pixels (its frame, its x and y tick marks), maps each step to its column and
reads the marker's row back to a value. Values are read to the pixel: about 4% of a decade, and
"0" means on the zero line.

    .venv/bin/python benchmarks/overlay_points.py PNG [--steps 300] [--xticks 0,50,...] [--first N]

Prints the first step whose value is above 0, the steps at 0 after it, and a step/value table.
"""

from __future__ import annotations

import argparse

import numpy as np
from PIL import Image

from tpulab.evidence.report_kit import table

PURPLE = np.array([148, 103, 189])  # matplotlib's tab:purple, the colour of the difference panel
LINTHRESH = 1e-8  # plot_overlay's symlog linear threshold


def _runs(mask_row: np.ndarray) -> list[int]:
    return list(np.flatnonzero(mask_row))


def read(path: str, steps: int, xticks: list[float]) -> dict[int, float]:
    rgb = np.asarray(Image.open(path).convert("RGB")).astype(int)
    dark = rgb.sum(axis=2) < 200
    purple = (np.abs(rgb - PURPLE) < 40).all(axis=2)
    h, w = dark.shape
    # The axes frames are the long dark horizontal lines; the lower panel is the last pair.
    frame_rows = [y for y in range(h) if dark[y].sum() > 0.5 * w]
    bottom = frame_rows[-1]
    top = max(y for y in frame_rows if y < bottom - 20)
    # The frame's vertical lines: columns dark over (nearly) the whole panel height.
    left_frame, right_frame = np.flatnonzero(dark[top:bottom].sum(axis=0) > 0.9 * (bottom - top))[
        [0, -1]
    ]
    # x tick marks: short dark marks just below the bottom frame line, inside the frame.
    below = next(y for y in range(bottom + 1, h) if 0 < dark[y].sum() < 0.2 * w)
    ticks_x = _centres([c for c in _runs(dark[below]) if left_frame <= c <= right_frame])
    if len(ticks_x) != len(xticks):
        raise SystemExit(f"found {len(ticks_x)} x ticks, expected {len(xticks)} ({xticks})")
    px_per_step = (ticks_x[-1] - ticks_x[0]) / (xticks[-1] - xticks[0])
    # y tick marks: short dark marks just left of the left frame line, from the bottom: 0, 1e-8, ...
    ticks_y = sorted(
        (_centres(_runs(dark[top : bottom + 2, left_frame - 2])) + top).tolist(), reverse=True
    )
    zero_y, thresh_y = ticks_y[0], ticks_y[1]
    decade = (ticks_y[1] - ticks_y[-1]) / (len(ticks_y) - 2)
    values = {}
    for s in range(1, steps + 1):
        x = int(round(ticks_x[0] + (s - xticks[0]) * px_per_step))
        window = purple[top:bottom, x - 1 : x + 2].sum(axis=1)  # marker rows are the widest
        if not window.any():
            continue
        y = top + float(np.mean(np.flatnonzero(window == window.max())))
        if y >= zero_y - 1:
            values[s] = 0.0
        elif y >= thresh_y:
            values[s] = LINTHRESH * (zero_y - y) / (zero_y - thresh_y)
        else:
            values[s] = LINTHRESH * 10 ** ((thresh_y - y) / decade)
    return values


def _groups(cols: list[int]) -> list[list[int]]:
    """Runs of consecutive indices."""
    groups, cur = [], []
    for c in cols:
        if cur and c != cur[-1] + 1:
            groups.append(cur)
            cur = []
        cur.append(c)
    return groups + [cur] if cur else groups


def _centres(cols: list[int]) -> np.ndarray:
    return np.array([np.mean(g) for g in _groups(cols)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("png")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--xticks", default="0,50,100,150,200,250,300")
    ap.add_argument("--first", type=int, default=60, help="steps to list in the table")
    args = ap.parse_args()
    values = read(args.png, args.steps, [float(t) for t in args.xticks.split(",")])
    nonzero = [s for s, v in sorted(values.items()) if v > 0]
    if not nonzero:
        print(f"{args.png}: all {len(values)} steps read at 0")
        return
    first = nonzero[0]
    zeros_after = [s for s, v in sorted(values.items()) if s > first and v == 0]
    print(f"{args.png}: {len(values)} steps read; first step above 0: {first}")
    print(f"steps at 0 after it: {zeros_after}")
    shown = sorted(values)[: args.first]
    print(table(["step", "abs(run - reference)"], [(s, f"{values[s]:.2g}") for s in shown]))


if __name__ == "__main__":
    main()
