"""`tpulab capstone` end to end at the CI size (the bridge, inference, scale-out, dossier and
post-training stages have their own tests)."""

import json
import re

import pytest

from conftest import TINY, run_cli, tiny_config
from tpulab.errors import TpulabError

pytestmark = pytest.mark.slow


def test_capstone_writes_report_overlay_and_verdict(tmp_path):
    out = tmp_path / "cap"
    result = run_cli(
        "capstone",
        "--out",
        str(out),
        "--config",
        str(TINY),
        "--skip-bridge",
        "--skip-inference",
        "--chaos-kills",
        "1",
        "--skip-scaleout",
        "--skip-dossier",
        "--skip-posttrain",
    )  # each has its own slow test
    assert result.returncode == 0, result.stderr
    report = (out / "report.md").read_text()
    assert "Status: **PASS**" in report and "bitwise identical" in report and "not a TPU" in report
    assert (
        "## Runtime receipt" in report
        and json.loads((out / "receipt" / "receipt.json").read_text())["runtime"]["backend"]
        == "cpu"
    )
    # the receipt's key/value block is a table in the page, not one run-on paragraph
    page = (out / "report.html").read_text()
    assert "<tr><td>platform version</td>" in page and "<tr><td>device-&gt;host</td>" in page
    assert json.loads((out / "proof" / "verdict.json").read_text())["identical"] is True
    assert (out / "proof" / "overlay.png").stat().st_size > 10_000
    assert all(r["passed"] for r in json.loads((out / "checks.json").read_text())["rows"])
    chaos = json.loads((out / "chaos" / "verdict.json").read_text())
    assert (
        chaos["identical"] is True
        and chaos["kills"] == 1
        and "Chaos: SIGKILL at random moments" in report
    )
    # proof, chaos and checks ran together, in the fixed order; the report says so
    times = next(line for line in report.splitlines() if line.startswith("Stage times: "))
    assert "train " in times and ", resume proof " in times and " s with chaos " in times, times
    assert " s with checks " in times, times
    heads = [h for h in report.splitlines() if h.startswith("## ")]
    order = ["## Kill/resume proof", "## Chaos: SIGKILL at random moments", "## Independent checks"]
    assert [h for h in heads if h in order] == order, heads
    cpu = r"^CPU seconds: receipt \d+ s, train \d+ s, resume proof \+ chaos \+ checks "
    assert re.search(cpu, report, re.M)
    # each group's wall beside its CPU seconds, with the host's CPU model (and in stages.json)
    rec = json.loads((out / "stages.json").read_text())
    groups = [[x["name"] for x in g["stages"]] for g in rec["groups"]]
    assert groups[:3] == [["receipt"], ["train"], ["resume proof", "chaos", "checks"]], groups
    assert all(g["cpu_s"] > 0 and g["wall_s"] > 0 for g in rec["groups"][1:3]), rec["groups"]
    assert rec["host"]["cpu_model"] in report and "| resume proof + chaos + checks | " in report
    # the proof's resumed process compiled from a fresh, empty cache (JAX's events); chaos's
    # lifetimes share one (control: it loaded what the reference compiled, so it is not cold)
    proof = json.loads((out / "proof" / "verdict.json").read_text())
    resumed = proof["compile_cache"]["processes"]["resumed"]
    assert resumed["cold"] is True and resumed["hits"] in (0, None), resumed
    assert resumed.get("cold_confirmed") is True, resumed
    lifetime = chaos["compile_cache"]["processes"]["lifetime-1"]
    assert lifetime["hits"] > 0 and lifetime["entries_at_first_lookup"] > 0, lifetime
    # the untracked children are named, the tracked main run audited
    assert "Run with `--no-track`" in report and "`proof/`, `chaos/`" in report
    assert "**1 of 1** runs complete" in report
    from tpulab.orchestrate.capstone import run_capstone  # a used --out is refused in one line

    with pytest.raises(TpulabError, match="already exists and is not empty"):
        run_capstone(tiny_config(), out)
    assert (out / "report.md").read_text() == report  # nothing overwritten
