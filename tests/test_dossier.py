"""`tpulab dossier`: every stage at a tiny size, dossier.md + a self-contained dossier.html."""

from __future__ import annotations

import json
import re

import pytest

from conftest import run_cli


@pytest.mark.slow
def test_dossier_writes_decisions_with_their_evidence(tmp_path):
    pytest.importorskip("libtpu")
    out = tmp_path / "dossier"
    r = run_cli("dossier", "--out", str(out), "--config", "configs/tiny.yaml", "--train-steps", "20",
                "--batch-sweep", "data.batch_size=4,8", "--target", "v5e:2x2", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (out / "dossier.md").read_text()
    for needle in ("**Slice**: v5e:2x2", "**Precision**: train with", "**Batch**:", "**Hypothesis**:",
                   "Status: **complete**", "## Receipt", "## Bench", "## Profile", "## TPU budget",
                   "## Precision policy", "## Hypothesis from the profile", "not a TPU"):
        assert needle in md, needle
    page = (out / "dossier.html").read_text()
    assert page.count("data:image/png;base64,") >= 3  # sweep, budget and hypothesis plots embedded
    assert not re.search(r"""src=["'](?!data:)""", page)  # nothing loaded from elsewhere
    decisions = json.loads((out / "dossier.json").read_text())
    assert decisions["recommendation"]["target"] == "v5e:2x2" and not decisions["failures"]


def test_dossier_refuses_bad_input_before_writing(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("keep")
    r = run_cli("dossier", "--out", str(tmp_path / "used"), "--config", "configs/tiny.yaml")
    assert r.returncode == 2 and "not empty" in r.stderr and (tmp_path / "used" / "x").read_text() == "keep"
    for extra, expect in ((["--target", "v9:2x2"], "unknown TPU target"),
                          (["--batch-sweep", "data.batch_size=4,x"], "must be an integer")):
        r = run_cli("dossier", "--out", str(tmp_path / "new"), "--config", "configs/tiny.yaml", *extra)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and expect in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (tmp_path / "new").exists()
