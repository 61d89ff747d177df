"""tpulab.evidence.intervals beside rliable itself on fixed cases: the IQM, its 95% stratified
bootstrap interval (50,000 resamples), the probability of improvement and its interval.

    PYTHONPATH=<rliable, arch, pandas<3, statsmodels> python benchmarks/rliable_agreement.py \
        [--out benchmarks/results/rliable_agreement]

rliable is not a tpulab dependency (it pulls arch, pandas, statsmodels, seaborn): without it the
output says so. The point estimates must agree exactly; the intervals to Monte-Carlo noise (the two
draw different resamples). A check, not a test: tests/test_intervals.py holds the tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def cases() -> dict[str, np.ndarray]:
    return {
        "ten_seeds_near_cap": np.array([500, 500, 500, 492.3, 500, 471.2, 500, 500, 212.5, 500.0])[
            :, None
        ],
        "normal_10": np.random.default_rng(1).normal(300, 80, size=(10, 1)),
        "two_tasks_8": np.random.default_rng(2).uniform(0, 500, size=(8, 2)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    args = parser.parse_args()
    from tpulab.evidence import intervals, report_kit
    from tpulab.evidence.provenance import git_commit, package_versions

    try:
        from rliable import library, metrics
    except ImportError as e:
        raise SystemExit(f"rliable: not measured, `import rliable` failed ({e})") from None
    rows = []
    for name, s in cases().items():
        point, ci = library.get_interval_estimates(
            {"x": s},
            lambda x: np.array([metrics.aggregate_iqm(x)]),
            reps=50_000,
            random_state=np.random.RandomState(0),
        )
        lo, hi = intervals.stratified_bootstrap(s)
        rows.append(
            {
                "case": f"IQM {name}",
                "rliable": [float(point["x"][0]), *map(float, ci["x"][:, 0])],
                "tpulab": [intervals.iqm(s), lo, hi],
            }
        )
    x = np.random.default_rng(3).integers(400, 501, size=(10, 1)).astype(float)
    y = np.random.default_rng(4).integers(380, 501, size=(10, 1)).astype(float)
    point, ci = library.get_interval_estimates(
        {"xy": [x, y]},
        lambda a, b: np.array([metrics.probability_of_improvement(a, b)]),
        reps=20_000,
        random_state=np.random.RandomState(0),
    )
    lo, hi = intervals.probability_of_improvement_interval(x, y, reps=20_000)
    rows.append(
        {
            "case": "P(improvement) 10 vs 10, ties",
            "rliable": [float(point["xy"][0]), *map(float, ci["xy"][:, 0])],
            "tpulab": [intervals.probability_of_improvement(x, y), lo, hi],
        }
    )
    versions = package_versions(("rliable", "arch", "pandas", "statsmodels", "numpy"))

    def cell(v: list[float]) -> str:
        return f"{v[0]:.4f} [{v[1]:.3f}, {v[2]:.3f}]"

    lines = [
        f"rliable beside tpulab.evidence.intervals ({versions}); commit {git_commit()}; "
        "rliable draws its resamples from numpy's global RNG (its random_state does not reach "
        "them), so its intervals move by Monte-Carlo noise from run to run",
        "",
        report_kit.table(
            ["case", "rliable: point [95% CI]", "tpulab: point [95% CI]"],
            [[r["case"], cell(r["rliable"]), cell(r["tpulab"])] for r in rows],
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(
            json.dumps({"rows": rows, "versions": versions, "commit": git_commit()}, indent=2)
            + "\n"
        )
        args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
