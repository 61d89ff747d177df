"""The demo's post-training sections say they are a mechanics check and show the committed
default-size results beside their own, read from the committed results file, not retyped."""

from __future__ import annotations

import copy
import json

from tpulab.orchestrate import default_size
from tpulab.orchestrate.default_size import RESULTS, comparison, headline, mechanics_label


def _wins(rate: float, wins: int, ties: int) -> dict:
    return {
        "prompts": 16,
        "wins": wins,
        "ties": ties,
        "losses": 16 - wins - ties,
        "win_rate": rate,
        "gold_mean": {"policy": 1.5, "against": 1.25},
        "stop_rate": {"policy": 0.0, "against": 0.0},
    }


DEMO = headline(0.375, 15, {"dpo": _wins(0.5, 0, 16), "ppo": _wins(0.5, 0, 16)})


def test_the_committed_results_are_read_from_their_file():
    text = comparison(DEMO)
    assert "| this demo run (mechanics check) | default size (committed) |" in text
    assert "| 0.500 (0 / 16 / 0 of 16) | 0.754 (130 / 126 / 0 of 256) |" in text
    assert "| 0.500 (0 / 16 / 0 of 16) | 0.854 (181 / 75 / 0 of 256) |" in text
    assert "| 0.375 (15 pairs) | 0.609 (254 pairs) |" in text
    assert "commit `e12d22e` on 2026-12-01" in text and "reused from commit `7c924b5`" in text
    assert "200 steps a stage, PPO 200 rounds" in text


def test_other_results_in_the_file_show_as_they_are(tmp_path):
    """Negative control: the same renderer on a changed copy of the file shows the copy's numbers
    and provenance, so nothing in the section is typed in by hand."""
    results = copy.deepcopy(json.loads(RESULTS.read_text()))
    results["win_rate"]["dpo"].update(win_rate=0.125, wins=1, ties=2, losses=13, prompts=16)
    results["environment"]["git_commit"] = "0123456789abcdef"
    path = tmp_path / "preference_chain.json"
    path.write_text(json.dumps(results))
    text = comparison(DEMO, path)
    assert "0.125 (1 / 2 / 13 of 16)" in text and "0.754" not in text
    assert "commit `0123456`" in text and "e12d22e" not in text


def test_without_the_file_the_demo_column_stands_alone(tmp_path):
    text = comparison(DEMO, tmp_path / "absent.json")
    assert "| quantity | this demo run |" in text and "default size (committed)" not in text
    assert text.splitlines()[-1].endswith("are in the repository, not in this install.")


def test_the_label_says_what_the_section_proves():
    text = mechanics_label("DPO resumes bitwise.", "below")
    assert text.startswith("**A mechanics check, not a quality result.**")
    assert "What this section proves: DPO resumes bitwise." in text
    assert text.endswith("The committed default-size results: below.")
    assert len(DEMO) == len(default_size.ROWS) == 5
