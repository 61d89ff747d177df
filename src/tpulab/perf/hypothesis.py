"""`tpulab hypothesis`: one profile-driven prediction, tested side by side with quality evidence.

The user states a prediction with a signed percentage for the step time (``"dropout RNG is 20% of
the step; dropout 0 removes it: step time -20%"``; the last percentage in the text is the predicted
change and must carry its sign, ``+N%`` or ``-N%``) and a config switch (``--change KEY=VALUE``).
The baseline and the changed config are built once each, start from the same seed, and train the
same steps on the same batches (the real data pipeline), alternating step by step so host-load
changes hit both; every step is synchronized and timed. Quality evidence: both validation losses
on the same held-out batches at the end, within a stated tolerance, and both training-loss curves
plotted together.

Verdict: ``confirmed`` when the measured median step-time change has the predicted sign and lies
within ``max(ABS_TOL_PP, REL_TOL x |predicted|)`` of it, ``refuted`` otherwise; a refuted
hypothesis is a result like any other. Quality outside tolerance is reported next to it.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tpulab.errors import TpulabError
from tpulab.evidence.report_kit import figure, table

if TYPE_CHECKING:
    from tpulab.train.config import RunConfig

ABS_TOL_PP = 5.0  # percentage points
REL_TOL = 0.5
# A percentage and the sign (ASCII plus or minus, or U+2212) that may stand right before it. The
# sign is an alternation, not a character class: "[+-−]" is the range U+002B..U+2212, which holds
# the digits and every ASCII letter, so "step time 15%" read "e 15" and "3 15%" read 315.
_PCT = re.compile(r"(?<![\d.])(?:(\+|-|\u2212)\s?)?(\d+(?:\.\d+)?)\s?%")


def predicted_change(text: str) -> float:
    """The last percentage of the prediction, which must carry its sign (+ or -)."""
    found = _PCT.findall(text or "")
    example = "e.g. 'step time -15%'"
    if not found:
        raise TpulabError(
            f"--predict must state the step-time change as a signed percentage ({example}), "
            f"got {text!r}"
        )
    sign, number = found[-1]
    if not sign:
        raise TpulabError(
            f"--predict must state the step-time change as a signed percentage ({example}): "
            f"its last percentage {number}% has no sign, so faster or slower is not said; "
            f"got {text!r}"
        )
    return -float(number) if sign in "-\u2212" else float(number)


def verdict(predicted_pct: float, measured_pct: float) -> dict:
    tol = max(ABS_TOL_PP, REL_TOL * abs(predicted_pct))
    same_sign = (predicted_pct == 0) or (predicted_pct * measured_pct > 0)
    ok = same_sign and abs(measured_pct - predicted_pct) <= tol
    return {"verdict": "confirmed" if ok else "refuted", "tolerance_pp": tol}


def run_hypothesis(
    base_config: RunConfig,
    change: str,
    predict: str,
    out_dir: str | Path,
    *,
    steps: int = 30,
    skip: int = 3,
    loss_tol: float = 0.05,
) -> dict:
    """Alternate baseline and changed train steps on the same batches; write
    hypothesis.{json,md,png}."""
    import jax

    from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
    from tpulab.config import load, to_dict
    from tpulab.data.corpus import load_corpus
    from tpulab.data.pipeline import build_splits, eval_batches, train_dataset
    from tpulab.perf.timing import benchmark_environment
    from tpulab.train.config import RunConfig
    from tpulab.train.loop import evaluate
    from tpulab.train.step import make_steps

    pred = predicted_change(predict)
    if "=" not in change:
        raise TpulabError(f"--change expects KEY=VALUE, got {change!r}")
    changed_config = load(RunConfig, None, [change], base=to_dict(base_config))
    if changed_config == base_config:
        raise TpulabError(f"--change {change} leaves the config as it is; nothing to compare")
    if steps < skip + 20:
        raise TpulabError(
            f"--steps {steps}: need at least {skip + 20} (warm-up {skip} plus 20 timed per side)"
        )
    splits = build_splits(load_corpus(base_config.data.path), base_config.data)
    data = iter(train_dataset(splits.train_windows, base_config.data))
    batches = [next(data) for _ in range(steps)]
    val = eval_batches(
        splits.val_windows, base_config.data.batch_size, base_config.train.eval_batches
    )

    sides = {}
    for name, cfg in (("baseline", base_config), ("changed", changed_config)):
        s = make_steps(cfg)
        sides[name] = {"steps": s, "state": s.init(), "times": [], "losses": []}
    for i, batch in enumerate(batches):
        order = ("baseline", "changed") if i % 2 == 0 else ("changed", "baseline")
        for name in order:
            side = sides[name]
            b = side["steps"].put_batch(batch)
            t0 = time.perf_counter()
            side["state"], metrics = side["steps"].train(side["state"], b)
            jax.block_until_ready((side["state"], metrics))
            side["times"].append(time.perf_counter() - t0)
            side["losses"].append(float(metrics["loss"]))
    for side in sides.values():
        side["val_loss"] = evaluate(side["steps"], side["state"].params, val)["val_loss"]
        side["median_step_s"] = statistics.median(side["times"][skip:])

    base_t, new_t = sides["baseline"]["median_step_s"], sides["changed"]["median_step_s"]
    measured = 100.0 * (new_t - base_t) / base_t
    dloss = abs(sides["changed"]["val_loss"] - sides["baseline"]["val_loss"])
    result = {
        "change": change,
        "prediction": predict,
        "predicted_step_time_change_pct": pred,
        "measured_step_time_change_pct": measured,
        **verdict(pred, measured),
        "baseline": {
            k: sides["baseline"][k] for k in ("median_step_s", "val_loss", "losses", "times")
        },
        "changed": {
            k: sides["changed"][k] for k in ("median_step_s", "val_loss", "losses", "times")
        },
        "steps": steps,
        "timed_steps_per_side": steps - skip,
        "loss_tolerance": loss_tol,
        "val_loss_difference": dloss,
        "quality_within_tolerance": dloss <= loss_tol,
        "method": "same seed, same batches, alternating order each step, synchronized steps",
        "config": to_dict(base_config),
        "environment": benchmark_environment(),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _plot(result, out / "hypothesis.png")
    atomic_write_json(out / "hypothesis.json", result)
    atomic_write_bytes(out / "hypothesis.md", (markdown(result) + "\n").encode())
    return result


def markdown(r: dict) -> str:
    b, c = r["baseline"], r["changed"]
    return "\n".join(
        [
            f"Hypothesis: {r['prediction']}",
            f"Change: `{r['change']}`",
            "",
            table(
                ["", "median step ms", "val loss"],
                [
                    (name, f"{1e3 * x['median_step_s']:.2f}", f"{x['val_loss']:.4f}")
                    for name, x in (("baseline", b), ("changed", c))
                ],
            ),
            "",
            f"Predicted step time {r['predicted_step_time_change_pct']:+.1f}%, measured "
            f"{r['measured_step_time_change_pct']:+.1f}% over {r['timed_steps_per_side']} "
            f"alternating steps per side (tolerance {r['tolerance_pp']:.1f} pp): "
            f"**{r['verdict'].upper()}**. Validation losses differ by "
            f"{r['val_loss_difference']:.4f} "
            f"({'within' if r['quality_within_tolerance'] else 'OUTSIDE'} the "
            f"{r['loss_tolerance']} tolerance).",
            "",
            "![curves](hypothesis.png)",
        ]
    )


def _plot(r: dict, path: Path) -> None:
    with figure(path, ncols=2, figsize=(10, 3.4)) as (fig, axes):
        for name, style in (("baseline", "-"), ("changed", "--")):
            axes[0].plot(
                range(1, r["steps"] + 1),
                r[name]["losses"],
                style,
                label=f"{name} (val {r[name]['val_loss']:.3f})",
            )
            axes[1].plot(
                range(1, r["steps"] + 1), [1e3 * t for t in r[name]["times"]], style, label=name
            )
        axes[0].set_xlabel("step")
        axes[0].set_ylabel("train loss")
        axes[0].legend(fontsize=8)
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("step time (ms)")
        axes[1].set_yscale("log")
        axes[1].legend(fontsize=8)
        fig.suptitle(
            f"{r['change']}: {r['verdict']} "
            f"(predicted {r['predicted_step_time_change_pct']:+.0f}%, "
            f"measured {r['measured_step_time_change_pct']:+.0f}%)",
            fontsize=10,
        )
