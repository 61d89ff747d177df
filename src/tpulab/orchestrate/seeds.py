"""`tpulab seeds`: train N seeds of one config on the one loop, score each final policy on held-out
episodes, and aggregate as rliable does (``evidence.intervals``): the IQM with a 95%
stratified-bootstrap interval, the mean, each seed's score, the median steps to first reach a
target return, and, with a second config trained on the same seeds, the probability of
improvement. Curves that are identical across seeds (every seed given one key) fail the run.

Generic over objectives: one names the ``Config`` field that trains seeds together
(``Objective.seeds_option``), the per-seed curves its steps log (``seed_curves``, ``lane_metric``)
and scores a state's seeds (``seed_scores``). ``vmapped`` trains the N seeds as one run (one
program, a lane axis in the state: ``D/run``); ``sequence`` trains N runs of one seed each
(``D/seed<i>``, seed ``seed + i``, the same lanes). ``D/seeds.json`` holds the numbers;
``D/seeds.md`` and ``D/plots/seeds.png`` are the report section ``tpulab report`` includes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json, check_out
from tpulab.config import from_dict, to_dict
from tpulab.errors import ConfigError, ExitCode, TpulabError
from tpulab.evidence import intervals
from tpulab.evidence.metrics import read_records
from tpulab.evidence.report_kit import figure, section, table
from tpulab.orchestrate.report import build_report, write_reports
from tpulab.train.objective import lane_metric
from tpulab.train.registry import objective_class

MODES = ("vmapped", "sequence")
BOOTSTRAP = {"method": "percentile, runs resampled within each task", "reps": 50_000, "seed": 0}


def seed_count(value: Any) -> int:
    """``--seeds`` as given (a string from the command line): a positive integer, else one line."""
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"--seeds {value!r} must be a positive integer")
    return int(text)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One config trained on the seeds: its runs, and what they gave."""

    name: str
    lane_seeds: list[int]
    scores: list[float]
    curves: list[dict[str, list[float]]]  # per seed: seed_x and every seed curve, per step
    train_s: float
    score_s: float

    def steps_to(self, x: str, target: float) -> list[float | None]:
        out: list[float | None] = []
        for c in self.curves:
            hit = [xv for xv, y in zip(c[x], c["score"]) if y >= target]
            out.append(hit[0] if hit else None)
        return out


def _with(config, seed: int, **objective_options):
    """``config`` with another seed and objective options, checked again as a whole."""
    from tpulab.train.config import OBJECTIVE_SECTIONS

    d = {**to_dict(config), "seed": seed}
    name, _ = OBJECTIVE_SECTIONS.resolve(config.objective.kind)
    d["objective"][name].update(objective_options)
    return from_dict(type(config), d)


def _lane_configs(config, n: int, mode: str) -> list[tuple[str, Any]]:
    """(run dir name, config) of each run of an arm, every config checked before anything runs."""
    objective = objective_class(config.objective.kind)
    option = objective.seeds_option
    if option is None:
        raise ConfigError(f"objective.kind={config.objective.kind} does not train seeds")
    if mode == "vmapped":
        return [("run", _with(config, config.seed, **{option: n}))]
    return [(f"seed{i}", _with(config, config.seed + i, **{option: 1})) for i in range(n)]


def _curves(run_dir: Path, objective, lanes: int) -> list[dict[str, list[float]]]:
    records = [r for r in read_records(run_dir) if "step" in r and objective.seed_curves[0] in r]
    by_step = {r["step"]: r for r in records}  # a redone step: its last record
    steps = sorted(by_step)
    out = []
    for i in range(lanes):
        names = {n: (lane_metric(n, i) if lanes > 1 else n) for n in objective.seed_curves}
        c = {n: [float(by_step[s][key]) for s in steps] for n, key in names.items()}
        c["score"] = c[objective.seed_curves[0]]
        c[objective.seed_x] = [float(by_step[s][objective.seed_x]) for s in steps]
        out.append(c)
    return out


def _train_arm(name: str, runs: list[tuple[str, Any]], base: Path, progress: bool) -> Arm:
    from tpulab.train.loop import train
    from tpulab.train.restore import load_model

    objective = objective_class(runs[0][1].objective.kind)
    seeds, scores, curves = [], [], []
    train_s = score_s = 0.0
    for dirname, cfg in runs:
        run_dir = base / dirname
        t0 = time.perf_counter()
        train(cfg, run_dir, progress=progress)
        t1 = time.perf_counter()
        restored = load_model(run_dir)
        scores += objective.seed_scores(restored.config, restored.state)
        score_s += time.perf_counter() - t1
        train_s += t1 - t0
        lanes = getattr(cfg.objective.options, objective.seeds_option)
        seeds += [cfg.seed + i for i in range(lanes)]
        curves += _curves(run_dir, objective, lanes)
    return Arm(name, seeds, scores, curves, train_s, score_s)


def identical_pairs(arm: Arm) -> list[list[int]]:
    """Seeds whose every curve is equal to another seed's, step for step (one key for all)."""
    keys = [tuple(tuple(v) for k, v in sorted(c.items()) if k != "score") for c in arm.curves]
    return [[i, j] for i in range(len(keys)) for j in range(i + 1, len(keys)) if keys[i] == keys[j]]


def _median(values: list[float | None]) -> float | None:
    """The median, a seed that never reached the target counted as never (infinitely late)."""
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else m


def _summary(arm: Arm, x: str, target: float) -> dict:
    scores = np.asarray(arm.scores)
    lo, hi = intervals.stratified_bootstrap(scores, reps=BOOTSTRAP["reps"], seed=BOOTSTRAP["seed"])
    reach = arm.steps_to(x, target)
    pairs = identical_pairs(arm)
    tag = f"{target:g}"
    env_steps = sum(c[x][-1] for c in arm.curves if c[x])
    return {
        "seeds": arm.lane_seeds,
        "iqm": intervals.iqm(scores),
        "ci_low": lo,
        "ci_high": hi,
        "mean": float(scores.mean()),
        "per_seed": arm.scores,
        f"steps_to_{tag}": _median(reach),
        f"steps_to_{tag}_per_seed": reach,
        "reached": sum(v is not None for v in reach),
        "curves_distinct": not pairs,
        "identical_pairs": pairs,
        "train_s": round(arm.train_s, 2),
        "score_s": round(arm.score_s, 2),
        x: env_steps,
        f"{x}_per_s": env_steps / arm.train_s if arm.train_s > 0 else None,
    }


def run_seeds(
    config,
    seeds: Any,
    out: str | Path,
    *,
    compare=None,
    mode: str = "vmapped",
    target: float = 475.0,
    progress: bool = False,
) -> dict:
    """Train ``seeds`` seeds of ``config`` (and of ``compare``, on the same seeds), score them,
    write ``out``/seeds.json, seeds.md and plots/seeds.png; raise when curves repeat across seeds.
    Every input is checked before anything is written."""
    from tpulab.evidence.provenance import git_commit
    from tpulab.perf.timing import host_cpu

    n = seed_count(seeds)
    if mode not in MODES:
        raise ConfigError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if not math.isfinite(target):
        raise ConfigError(f"--target {target} must be a finite number")
    arms = {"config": config} if compare is None else {"config": config, "compare": compare}
    plans = {name: _lane_configs(cfg, n, mode) for name, cfg in arms.items()}
    out = check_out(out)
    objective = objective_class(config.objective.kind)
    x = objective.seed_x
    load_before = [round(v, 2) for v in os.getloadavg()]
    trained = {
        name: _train_arm(name, runs, out if name == "config" else out / name, progress)
        for name, runs in plans.items()
    }
    record: dict[str, Any] = {
        "objective": config.objective.kind,
        "mode": mode,
        "target_return": target,
        "bootstrap": {**BOOTSTRAP, "size": 0.95},
        **_summary(trained["config"], x, target),
        "provenance": {
            "cpu": host_cpu(),
            "cpu_count": os.cpu_count(),
            "commit": git_commit(),
            "load_avg_before": load_before,
            "load_avg_after": [round(v, 2) for v in os.getloadavg()],
        },
    }
    if compare is not None:
        other = trained["compare"]
        mine = np.asarray(trained["config"].scores)
        lo, hi = intervals.probability_of_improvement_interval(
            mine, np.asarray(other.scores), reps=BOOTSTRAP["reps"], seed=BOOTSTRAP["seed"]
        )
        record["compare"] = {
            **_summary(other, x, target),
            "probability_of_improvement": intervals.probability_of_improvement(
                mine, np.asarray(other.scores)
            ),
            "poi_ci_low": lo,
            "poi_ci_high": hi,
        }
    failed = [name for name, arm in trained.items() if identical_pairs(arm)]
    record["passed"] = not failed
    atomic_write_json(out / "seeds.json", record)
    draw_curves(trained, x, target, out / "plots" / "seeds.png")
    atomic_write_bytes(out / "seeds.md", seeds_section(record, trained, x).encode())
    write_reports(out, build_report(out), title="tpulab seeds")
    if failed:
        pairs = identical_pairs(trained[failed[0]])
        raise TpulabError(
            f"seeds {pairs[0][0]} and {pairs[0][1]} of {failed[0]} trained identical curves "
            f"({len(pairs)} identical pair(s)): every seed got the same key; see {out}/seeds.json",
            exit_code=ExitCode.FAILED,
        )
    return record


def _fmt(v: float | None) -> str:
    return "never" if v is None else f"{v:,.0f}"


def seeds_section(record: dict, arms: dict[str, Arm], x: str) -> str:
    """The report section: the table, each seed's row, the curves across seeds."""
    tag = f"{record['target_return']:g}"
    rows = []
    for name, arm in arms.items():
        s = record if name == "config" else record["compare"]
        rows.append(
            [
                name,
                len(arm.scores),
                f"{s['iqm']:.1f} [{s['ci_low']:.1f}, {s['ci_high']:.1f}]",
                f"{s['mean']:.1f}",
                f"{_fmt(s[f'steps_to_{tag}'])} ({s['reached']}/{len(arm.scores)} reached)",
                f"{s['train_s']:.1f}",
                "yes" if s["curves_distinct"] else "**no**",
            ]
        )
    head = [
        "config",
        "seeds",
        "IQM [95% CI]",
        "mean",
        f"median {x} to {tag}",
        "train s",
        "curves distinct",
    ]
    per_seed = [
        [name, seed, f"{score:.1f}", _fmt(steps)]
        for name, arm in arms.items()
        for seed, score, steps in zip(arm.lane_seeds, arm.scores, arm.steps_to(x, float(tag)))
    ]
    blocks = [
        f"`{record['objective']}`, {record['mode']}: each seed's greedy policy scored on the same "
        "held-out episodes; IQM and its interval as rliable computes them "
        f"({record['bootstrap']['reps']:,} stratified bootstrap resamples, percentile).",
        table(head, rows),
        table(["config", "seed", "score", f"{x} to {tag}"], per_seed),
    ]
    if "compare" in record:
        c = record["compare"]
        blocks.append(
            f"Probability of improvement of `config` over `compare`: "
            f"{c['probability_of_improvement']:.2f} "
            f"[{c['poi_ci_low']:.2f}, {c['poi_ci_high']:.2f}]."
        )
    blocks.append("![curves across seeds](plots/seeds.png)")
    return section("Seeds", *blocks) + "\n"


def draw_curves(arms: dict[str, Arm], x: str, target: float, png: Path) -> None:
    """Each arm's score curve of every seed over ``x``, the target dashed."""
    with figure(png, figsize=(5 * len(arms), 3.6), ncols=len(arms), squeeze=False) as (_, axes):
        for ax, (name, arm) in zip(axes[0], arms.items()):
            for seed, c in zip(arm.lane_seeds, arm.curves):
                ax.plot(c[x], c["score"], lw=1, label=f"seed {seed}")
            ax.axhline(target, ls="--", color="k", lw=0.8)
            ax.set(title=name, xlabel=x, ylabel="episode return")
            if len(arm.curves) <= 10:
                ax.legend(fontsize=7)


def summary_line(record: dict) -> str:
    """One line: the IQM, its interval, the mean, the median steps to the target, the time."""
    tag = f"{record['target_return']:g}"
    line = (
        f"{len(record['per_seed'])} seeds ({record['mode']}): IQM {record['iqm']:.1f} "
        f"[{record['ci_low']:.1f}, {record['ci_high']:.1f}], mean {record['mean']:.1f}, median "
        f"steps to {tag}: {_fmt(record[f'steps_to_{tag}'])}, trained in {record['train_s']:.1f} s"
    )
    if "compare" in record:
        poi = record["compare"]["probability_of_improvement"]
        line += f"; P(improvement over compare) {poi:.2f}"
    return line
