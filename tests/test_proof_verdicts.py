"""The proofs' verdicts on planted differences: metrics files written by hand and checkpoints
edited on disk, so each verdict is shown to name what differs (and where), not only to pass on a
clean run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tpulab.proofs.driver import judge, plot_proof, verdict_text


def _write(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _loss(step: int) -> float:
    return float(np.float32(3.0 / step))


def _nudged(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(10)))  # one float32 ulp up


def _proof_files(tmp_path, *, plant_killed: int | None = None, plant_resumed: int | None = None):
    """Reference 1..10; killed 1..7 (SIGKILL after 7); resumed from 5, trains 6..10."""
    ref, run = tmp_path / "reference", tmp_path / "interrupted"
    _write(
        ref,
        [{"event": "start", "segment": 0}]
        + [{"step": s, "segment": 0, "loss": _loss(s)} for s in range(1, 11)],
    )
    killed = [{"step": s, "segment": 0, "loss": _loss(s)} for s in range(1, 8)]
    resumed = [{"step": s, "segment": 1, "loss": _loss(s)} for s in range(6, 11)]
    for seg, step in ((killed, plant_killed), (resumed, plant_resumed)):
        for r in seg:
            if step is not None and r["step"] >= step:  # a drift persists once it starts
                r["loss"] = _nudged(r["loss"])
    _write(
        run,
        [{"event": "start", "segment": 0}, *killed]
        + [{"event": "start", "segment": 1, "resumed_from": 5}, *resumed],
    )
    return ref, run


def test_judge_on_identical_segments(tmp_path):
    ref, run = _proof_files(tmp_path)
    v = judge(ref, run, steps=10, kill_step=7)
    assert v["identical"] and v["first_differing_step"] is None
    assert v["first_differing_step_before_kill"] is None
    assert v["first_differing_step_after_resume"] is None


def test_judge_names_a_difference_in_the_killed_segment_first(tmp_path):
    """The killed run drifted from step 3 (before the kill at 7, before the checkpoint at 5), so the
    resumed run differs too from step 6: the verdict must say step 3, before the kill (the old judge
    said 6, "after the resume", blaming the resume for run-to-run drift)."""
    ref, run = _proof_files(tmp_path, plant_killed=3, plant_resumed=6)
    v = judge(ref, run, steps=10, kill_step=7)
    assert v["identical"] is False
    assert v["first_differing_step_before_kill"] == 3
    assert v["first_differing_step_after_resume"] == 6
    assert v["first_differing_step"] == 3
    text = verdict_text(v)
    assert "already differs from the reference at step 3, before the kill" in text, text
    assert "resumed run differs from step 6" in text, text
    plot_proof(ref, run, v, tmp_path / "overlay.png", title="planted")  # its title is verdict_text
    assert (tmp_path / "overlay.png").stat().st_size > 10_000


def test_judge_names_a_difference_after_the_resume_only(tmp_path):
    ref, run = _proof_files(tmp_path, plant_resumed=8)
    v = judge(ref, run, steps=10, kill_step=7)
    assert v["identical"] is False
    assert v["first_differing_step_before_kill"] is None
    assert v["first_differing_step_after_resume"] == v["first_differing_step"] == 8
    text = verdict_text(v)
    assert "resumed run differs from step 8" in text and "before the kill" not in text, text


@pytest.mark.parametrize("where", ["killed", "resumed"])
def test_judge_nan_is_a_difference(tmp_path, where):
    ref, run = _proof_files(tmp_path)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    target = next(r for r in recs if r.get("step") == (4 if where == "killed" else 9))
    target["loss"] = float("nan")
    _write(run, recs)
    v = judge(ref, run, steps=10, kill_step=7)
    key = (
        "first_differing_step_before_kill"
        if where == "killed"
        else ("first_differing_step_after_resume")
    )
    assert v["identical"] is False and v[key] == (4 if where == "killed" else 9)


def _copy_run(trained_run, dst):
    import shutil

    shutil.copytree(trained_run, dst)
    step_dir = max((dst / "checkpoints").iterdir(), key=lambda p: int(p.name))
    return dst, step_dir


def test_whole_state_verdict_names_an_edited_data_position(trained_run, tmp_path):
    """Control of the data-position part: only the saved Grain position of the final checkpoint
    is changed (one byte, manifest rewritten so the checkpoint still verifies); model and optimizer
    state are untouched, so the position must be named as the first differing leaf."""
    from tpulab.checkpoint.files import write_manifest
    from tpulab.proofs.state import final_state_verdict

    run, step_dir = _copy_run(trained_run, tmp_path / "run")
    same = final_state_verdict(trained_run, run)
    assert same["final_state_identical"] is True and same["data_position_files"] == 1
    pos = step_dir / "data" / "process_0-of-1.json"
    raw = pos.read_bytes()
    i = raw.index(b"40")  # the position after 40 steps: {"next_index": 40}
    pos.write_bytes(raw[: i + 1] + b"1" + raw[i + 2 :])  # 40 -> 41, one byte
    write_manifest(step_dir, {"step": int(step_dir.name)})
    v = final_state_verdict(trained_run, run)
    assert v["final_state_identical"] is False
    assert v["first_differing_leaf"] == "data position (Grain iterator state): process_0-of-1.json"


@pytest.mark.parametrize("how", ["removed", "emptied"])
def test_a_checkpoint_without_a_data_position_is_refused(trained_run, tmp_path, how):
    """Two checkpoints without Grain state would hash to nothing on both sides and compare equal."""
    from tpulab.checkpoint.files import write_manifest
    from tpulab.errors import TpulabError
    from tpulab.proofs.state import final_state_verdict

    ref, ref_step = _copy_run(trained_run, tmp_path / "ref")
    run, run_step = _copy_run(trained_run, tmp_path / "run")
    for step_dir in (ref_step, run_step):  # both sides alike: the old verdict said identical
        pos = step_dir / "data" / "process_0-of-1.json"
        pos.unlink() if how == "removed" else pos.write_bytes(b"")
        write_manifest(step_dir, {"step": int(step_dir.name)})
    with pytest.raises(TpulabError, match=f"checkpoint {ref_step}.* Grain data position"):
        final_state_verdict(ref, run)
