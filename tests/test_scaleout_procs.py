"""Scale-out proofs 1-5 with real processes (tpulab launch, gloo over loopback), tiny sizes.

One module fixture trains the same run on three layouts (proof 1); its 2 processes x 2 devices run
is the uninterrupted reference of the kill (2, 4), stall (2), reshard (3) and ledger (5) proofs. The
corpus is small enough that an epoch lasts about four steps, so every resume crosses an epoch
boundary. Every child runs in a process group that is killed on exit (Proc), and launched trainers
die with their launcher (PR_SET_PDEATHSIG). No test here checks MLflow (test_tracking*.py does):
every trainer runs with --no-track (~2.2 CPU-s saved per process).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import tiny_config
from tpulab.errors import ExitCode
from tpulab.evidence.ledger import read_ledger

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY = 12, 5  # saves at 5, 10, 12: the kill (9) and the reshard (10) fit


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("small-corpus")
    for i in range(7):  # every word unique, so every window is unique and a hash names one window
        (d / f"doc{i}.txt").write_text(" ".join(f"d{i}w{j}" for j in range(30 + 5 * (i % 3))))
    return d


@pytest.fixture(scope="module")
def config(corpus):
    return tiny_config(
        f"data.path={corpus}",
        f"train.steps={STEPS}",
        f"checkpoint.save_every={SAVE_EVERY}",
        "train.eval_every=10",
        "checkpoint.keep=3",
    )


@pytest.fixture(scope="module")
def layouts(config, tmp_path_factory):
    from tpulab.proofs.scaleout import prove_layouts

    out = tmp_path_factory.mktemp("layouts")
    return out, prove_layouts(config, out, track=False)


def _epoch_of_step(config, step: int) -> int:
    """The epoch that the last window of ``step``'s global batch comes from."""
    from tpulab.data.corpus import load_corpus
    from tpulab.data.pipeline import build_splits

    n = len(build_splits(load_corpus(config.data.path), config.data).train_windows)
    return (step * config.data.batch_size - 1) // n


def test_same_math_on_every_layout(layouts):
    out, v = layouts
    assert v["passed"], (out / "layouts.md").read_text()
    assert all(r["steps"] == STEPS for r in v["rows"])
    # the two {2,2} layouts compile the same partitioned program; only the all-reduce's transport
    # differs
    four_vs_two = v["rows"][2]
    assert four_vs_two["a"].startswith("1 proc x 4") and four_vs_two["b"].startswith("2 proc x 2")
    assert four_vs_two["within_tolerance"]
    # negative control: the judge notices a curve that is off by more than the tolerance
    from tpulab.evidence.metrics import curve, read_records
    from tpulab.proofs.scaleout import compare_layout

    ref = curve(read_records(out / "p1d1"))
    assert not compare_layout(ref, {s: x * (1 + 10 * v["rtol"]) for s, x in ref.items()})[
        "within_tolerance"
    ]


def test_kill_one_of_two_processes_and_resume_bitwise_across_an_epoch(config, layouts, tmp_path):
    from tpulab.proofs.scaleout import GRACE_S, _with_mesh, prove_multiprocess_resume

    out, _ = layouts
    v = prove_multiprocess_resume(
        _with_mesh(config, 2, 2),
        tmp_path,
        mode="kill",
        kill_at=9,
        reference_dir=out / "p2d2",
        stall_timeout_s=60,
        track=False,
    )
    assert v["identical"], v
    assert v["final_state_identical"] and v["leaves_compared"] == 46
    assert (
        v["event"]["launcher_exit_code"] == ExitCode.PEER_FAILED
        and v["event"]["survivors_after"] == []
    )
    assert v["event"]["job_end_s"] < GRACE_S + 5  # the survivor is gone within the stated bound
    assert v["resumed_from_step"] == 5 and v["kill_step"] == 9
    # proof 4: an epoch (about 4 steps here) ends between the checkpoint and the kill, so the
    # redone steps cross into the next epoch's shuffle
    assert _epoch_of_step(config, 9) > _epoch_of_step(config, 5)
    assert (tmp_path / "proof-kill" / "overlay.png").stat().st_size > 10_000


def test_stall_one_process_watchdog_tears_down_and_resume_is_bitwise(config, layouts, tmp_path):
    from tpulab.proofs.scaleout import _with_mesh, prove_multiprocess_resume

    out, _ = layouts
    timeout = 15.0
    v = prove_multiprocess_resume(
        _with_mesh(config, 2, 2),
        tmp_path,
        mode="stall",
        kill_at=9,
        reference_dir=out / "p2d2",
        stall_timeout_s=timeout,
        track=False,
    )
    assert v["event"]["launcher_exit_code"] == ExitCode.STALLED, v
    assert v["stack_dumped"] and v["event"]["survivors_after"] == []
    assert (
        timeout <= v["event"]["job_end_s"] < timeout + 10
    )  # detected by the watchdog, not by luck
    assert v["identical"], v


def test_reshard_two_processes_onto_one_and_continue(config, layouts, tmp_path):
    from tpulab.proofs.scaleout import prove_reshard

    out, _ = layouts
    v = prove_reshard(config, tmp_path, at_step=10, reference_dir=out / "p2d2", track=False)
    assert v["reshard"]["bitwise_equal"] and v["reshard"]["leaves"] == 46
    assert v["reshard"]["from"].startswith("2 proc x 4 dev") and v["reshard"]["to"].startswith(
        "1 proc x 2 dev"
    )
    assert v["passed"], v
    from tpulab.checkpoint import rundir as R
    from tpulab.checkpoint.rundir import ReshardVerdict, RunDir

    assert RunDir(tmp_path).read(R.VERDICT) == ReshardVerdict.from_dict(v).to_dict() == v
    meta = json.loads(
        (tmp_path / "resharded" / "checkpoints" / "10" / "meta" / "metadata").read_text()
    )
    assert (
        meta["topology"]["mesh"] == {"data": 1, "fsdp": 2} and meta["resharded_from"]["step"] == 10
    )
    assert (tmp_path / "overlay.png").stat().st_size > 10_000


def ledger_verdict(multi_dir: Path, single_dir: Path) -> dict:
    """Proof 5 (no duplicated data) from what the runs really drew (window sha256 per process and
    step): in each step no window hash appears in two processes' rows, and the processes' rows
    together equal, as a multiset, the single-process run's batch. (A corpus with repeated text has
    equal windows; give it unique ones.) A corrupt ledger line fails it."""
    multi, single = read_ledger(multi_dir), read_ledger(single_dir)
    per_process = [{s: set(h) for s, h in p.items()} for p in multi["per_process"]]
    steps = sorted(set(multi["train"]) & set(single["train"]))
    overlap = [
        s
        for s in steps
        if any(
            a.get(s, set()) & b.get(s, set())
            for i, a in enumerate(per_process)
            for b in per_process[i + 1 :]
        )
    ]
    differ = [s for s in steps if sorted(multi["train"][s]) != sorted(single["train"][s])]
    return {
        "steps_compared": len(steps),
        "process_files": multi["files"],
        "steps_with_overlap": overlap[:10],
        "steps_where_union_differs": differ[:10],
        "corrupt_lines": multi["corrupt"] + single["corrupt"],
        "passed": bool(steps) and not (overlap or differ or multi["corrupt"] or single["corrupt"]),
    }


def test_windows_of_a_step_are_disjoint_across_processes_and_equal_the_single_process_batch(
    layouts, tmp_path
):
    out, _ = layouts
    v = ledger_verdict(out / "p2d2", out / "p1d1")
    assert v["passed"] and v["process_files"] == 2 and v["steps_compared"] == STEPS, v
    # negative control: process 1 drawing process 0's windows at step 3 is caught
    bad = tmp_path / "bad"
    shutil.copytree(out / "p2d2", bad, ignore=shutil.ignore_patterns("checkpoints"))
    lines = [json.loads(x) for x in (bad / "windows.p1.jsonl").read_text().splitlines()]
    p0 = {
        r["step"]: r["train"]
        for r in map(json.loads, (bad / "windows.p0.jsonl").read_text().splitlines())
        if "step" in r
    }
    lines = [{**r, "train": p0[3]} if r.get("step") == 3 else r for r in lines]
    (bad / "windows.p1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    v = ledger_verdict(bad, out / "p1d1")
    assert not v["passed"] and v["steps_with_overlap"] == [3]


def test_sigterm_to_the_launcher_preempts_every_process_at_the_same_step(config, tmp_path):
    import signal
    import time

    from tpulab.checkpoint.store import scan
    from tpulab.evidence.metrics import curve, read_records
    from tpulab.proofs.driver import Proc
    from tpulab.proofs.scaleout import _with_mesh, launch_argv
    from tpulab.proofs.transformer import write_child_config

    cfg = write_child_config(_with_mesh(config, 2, 2), tmp_path / "c.yaml")
    run = tmp_path / "run"
    with Proc(
        launch_argv(cfg, run, processes=2, devices=2, extra=("--steps", "400", "--no-track")),
        tmp_path / "log",
    ) as proc:
        deadline = time.monotonic() + 300
        while 10 not in curve(read_records(run)):  # both processes past compile and warm-up
            assert proc.p.poll() is None and time.monotonic() < deadline, proc.tail()
            time.sleep(0.05)
        proc.p.send_signal(signal.SIGTERM)
        assert proc.p.wait(timeout=120) == 0, proc.tail()
    records = read_records(run)
    stopped = [r for r in records if r.get("event") == "preempted"]
    assert len(stopped) == 1 and stopped[0]["step"] < 400
    step = stopped[0]["step"]
    assert scan(run / "checkpoints").latest == step  # both processes saved that step together
    assert sorted(p.name for p in (run / "checkpoints" / str(step) / "data").glob("process_*")) == [
        "process_0-of-2.json",
        "process_1-of-2.json",
    ]
