"""`tpulab capstone`: the main job. Train, prove the resume, run the checks, add the later stages, report.

Stages run in order and each leaves its evidence under ``out``; report.md is written even when a
stage fails (the failure is in it), and the command then exits non-zero.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.errors import TpulabError
from tpulab.evidence import report
from tpulab.evidence.proof import run_to_completion


def _prepare_out(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TpulabError(f"--out {out} already exists and is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_capstone(args, out: Path) -> Path:
    from tpulab.cli.train_cmds import child_train_argv, load_run_config
    from tpulab.evidence.checks import run_checks
    from tpulab.train.proof import prove_transformer_resume

    config = load_run_config(args)
    out = _prepare_out(Path(out))
    run_dir = out / "run"
    sections: list[str] = []
    failures: list[str] = []
    timings: dict[str, float] = {}

    def stage(name: str, fn):
        t0 = time.monotonic()
        print(f"[capstone] {name} …", flush=True)
        try:
            sections.append(fn())
        except TpulabError as e:
            failures.append(f"{name}: {e}")
            sections.append(f"## {name}\n\n**FAILED**: {e}")
        timings[name] = round(time.monotonic() - t0, 1)
        print(f"[capstone] {name} done in {timings[name]:.0f} s", flush=True)

    def train_stage() -> str:
        run_to_completion(child_train_argv(args, run_dir), out / "train.log", dict(os.environ), 3600, "training run")
        return report.provenance_section(json.loads((run_dir / "env.json").read_text())) + "\n\n" + \
            report.run_section(run_dir)

    def proof_stage() -> str:
        verdict = prove_transformer_resume(args, out, reference_dir=run_dir)
        if not verdict["identical"]:
            raise TpulabError(f"the resumed run is not identical (max |diff| {verdict['max_abs_diff']:g}); "
                              f"see {out / 'proof'}")
        return report.proof_section(out / "proof", "proof")

    def checks_stage() -> str:
        results = run_checks(config, run_dir=run_dir)
        atomic_write_json(out / "checks.json", {"rows": results})
        failed = [r["check"] for r in results if not r["passed"]]
        text = report.checks_section(results)
        if failed:
            failures.append(f"checks failed: {', '.join(failed)}")
        return text

    stage("train", train_stage)
    if not failures:
        stage("resume proof", proof_stage)
        stage("checks", checks_stage)
        if not getattr(args, "skip_inference", False):
            from tpulab.inference import capstone_stage as inference_stage

            stage("inference", lambda: inference_stage(run_dir, out / "inference"))
    if not getattr(args, "skip_bridge", False):
        from tpulab.bridge import capstone_stage as bridge_stage

        stage("bridge", lambda: bridge_stage(out))

    header = ["# tpulab capstone report", "",
              "Every number below was measured by this run and carries its provenance; the raw evidence sits "
              "beside this file.", "",
              f"Status: **{'PASS' if not failures else 'FAIL'}**" + ("" if not failures else " — " + "; ".join(failures)),
              "", "Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())]
    path = out / "report.md"
    atomic_write_bytes(path, ("\n".join(header) + "\n\n" + "\n\n".join(sections) + "\n").encode())
    if failures:
        raise TpulabError(f"capstone failed ({'; '.join(failures)}); report: {path}", exit_code=1)
    return path
