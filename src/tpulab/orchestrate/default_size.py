"""What the demo's post-training numbers are, and the default-size results beside them.

At the demo's size (tens of steps and prompts) post-training shows that the machinery runs, not
what the methods reach: a reward model near or below chance, win rates of 0.500 with every reply
tied, replies that repeat one word. Read without a label that looks broken. So both post-training
sections of the capstone open with a "mechanics check" label saying what they do prove, and the
preference chain's section puts the committed default-size results beside its own numbers, read
from the results file ``benchmarks/preference_chain.py`` wrote (the one place those numbers are
written; ``RESULTS``), with that file's provenance.
"""

from __future__ import annotations

import json
from pathlib import Path

from tpulab.evidence.provenance import hardware_label
from tpulab.evidence.report_kit import table
from tpulab.orchestrate import recipe

# in a checkout (src/tpulab/orchestrate/ -> the repo root); absent from an installed wheel
RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "preference_chain.json"
RESULTS_NAME = "benchmarks/results/preference_chain.json"


def mechanics_label(proves: str, results_at: str) -> str:
    """The paragraph that opens a demo-size post-training section: what it proves (``proves``)
    and where the default-size results are (``results_at``)."""
    return (
        "**A mechanics check, not a quality result.** At the demo's size (a few steps, tens of "
        "prompts) these numbers cannot show what the method reaches: near-chance accuracies, "
        "tied win rates and repeated words are expected here. What this section proves: "
        f"{proves} The committed default-size results: {results_at}."
    )


def headline(reward_accuracy: float, reward_pairs: int, wins: dict[str, dict]) -> list[str]:
    """The chain's headline numbers in one column: the reward model's held-out accuracy, then
    DPO's and PPO's gold win rate against SFT, mean gold reward and stop rate (``wins``: per
    policy, ``posttrain.winrate.win_rate``'s fields)."""
    d, p = (wins[name] for name in recipe.chain()["win_rate"])

    def rate(w):
        return f"{w['win_rate']:.3f} ({w['wins']} / {w['ties']} / {w['losses']} of {w['prompts']})"

    def trio(field):  # DPO / PPO / SFT (SFT: the "against" of either comparison)
        return " / ".join(
            f"{x:.3f}" for x in (d[field]["policy"], p[field]["policy"], d[field]["against"])
        )

    reward = f"{reward_accuracy:.3f} ({reward_pairs} pairs)"
    return [reward, rate(d), rate(p), trio("gold_mean"), trio("stop_rate")]


ROWS = (
    "reward model, held-out pair accuracy",
    "gold win rate, DPO vs SFT (wins / ties / losses)",
    "gold win rate, PPO vs SFT (wins / ties / losses)",
    "mean gold reward r*: DPO / PPO / SFT",
    "greedy stop rate: DPO / PPO / SFT",
)


def committed_headline(results: dict) -> list[str]:
    """``headline`` of the default-size results file (its own layout: gold means and stop rates
    beside the win counts)."""
    wins = {
        k: {
            **results["win_rate"][k],
            "gold_mean": results["gold_mean"][k],
            "stop_rate": results["stop_rate"][k],
        }
        for k in recipe.chain()["win_rate"]
    }
    reward = results[recipe.chain()["scorer"]]["val_accuracy"]
    return headline(reward, results["pairs"]["eval"]["pairs"], wins)


def provenance(results: dict) -> str:
    """Where the default-size numbers come from: size, commits, date, hardware."""
    env = results["environment"]
    reused = sorted({r["git_commit"][:7] for r in results.get("reused", {}).values()})
    earlier = f", earlier stages reused from commit `{'`, `'.join(reused)}`" if reused else ""
    hardware = hardware_label(env["backend"], env["device_kind"], env["device_count"])
    rl = results[recipe.chain()["rl"]]
    return (
        f"Default size: `configs/default.yaml`, {results['steps']} steps a stage, PPO "
        f"{rl['rounds']} rounds; run at commit `{env['git_commit'][:7]}` on "
        f"{env['time_utc'][:10]} ({hardware}){earlier}; raw: `{RESULTS_NAME}` (and `.md`)."
    )


def comparison(demo: list[str], path: Path = RESULTS) -> str:
    """The demo's headline column (``headline``) beside the committed default-size one, with the
    committed file's provenance; where the file is absent (an installed wheel, not a checkout),
    the demo's column alone and one line saying so."""
    if not path.is_file():
        return "\n".join(
            [
                table(["quantity", "this demo run"], [[r, v] for r, v in zip(ROWS, demo)]),
                "",
                f"The default-size results (`{RESULTS_NAME}`) are in the repository, not in this "
                "install.",
            ]
        )
    results = json.loads(path.read_text())
    committed = committed_headline(results)
    return "\n".join(
        [
            table(
                ["quantity", "this demo run (mechanics check)", "default size (committed)"],
                [[r, v, c] for r, v, c in zip(ROWS, demo, committed)],
            ),
            "",
            provenance(results),
        ]
    )
