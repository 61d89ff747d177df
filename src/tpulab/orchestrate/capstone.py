"""`tpulab capstone`: the main job. Train, prove the resume, run the checks, add the later stages,
report.

Stages run in a fixed order, after training two at a time where they read only the
trained run (``Stages.together``), and each leaves its evidence under ``out``; report.md is written
even when a stage fails (the failure is in it), and the command then exits non-zero. The last stage
checks that every tracked training run the stages started is in the MLflow store with its metrics.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

from tpulab.checkpoint import rundir
from tpulab.checkpoint.files import atomic_write_bytes, atomic_write_json
from tpulab.checkpoint.rundir import ResumeVerdict, RunDir
from tpulab.errors import TpulabError
from tpulab.evidence.report_kit import table
from tpulab.orchestrate import recipe, report
from tpulab.orchestrate.stages import Stages, prepare_out
from tpulab.proofs.driver import run_to_completion
from tpulab.proofs.transformer import train_child_argv, write_child_config
from tpulab.train.config import RunConfig


@dataclasses.dataclass(frozen=True)
class CapstoneOptions:
    skip_bridge: bool = False
    skip_inference: bool = False
    chaos_kills: int = 3  # 0 leaves the chaos stage out
    skip_scaleout: bool = False  # the 2-process kill/resume stage
    skip_dossier: bool = (
        False  # the decision dossier (bench, profile, TPU budget, precision, hypothesis)
    )
    skip_posttrain: bool = False  # SFT and LoRA from the pretrained run, merge, evaluation
    compile_cache: Path | None = None


def chaos_config(config: RunConfig) -> RunConfig:
    """The demo's chaos run: the tiny CI shapes, frequent saves, so kills often land mid-save."""
    from tpulab.config import from_dict, to_dict

    d = to_dict(config)
    d["model"].update(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
    d["data"].update(seq_len=32, batch_size=8)
    d["optim"].update(warmup_steps=5, schedule_steps=60)
    d["train"].update(steps=60, eval_every=30, eval_batches=2)
    d["checkpoint"].update(save_every=5, keep=3)
    return from_dict(RunConfig, d)


PROOF_STEPS, PROOF_SAVE_EVERY = 60, 20


def proof_config(config: RunConfig) -> RunConfig:
    """The resume proof's run: the main run's model, data, optimizer and schedule, at most
    ``PROOF_STEPS`` steps with a checkpoint at least every ``PROOF_SAVE_EVERY``. At the default
    size that is 60 steps, so the proof trains 60 (its reference) + 45 (killed) + 20 (resumed)
    = 125 steps, against 310 with the 300-step main run as the reference. A config already that
    short is the main run's, and the main run is the reference (``proof_kill_step``)."""
    t, c = config.train, config.checkpoint
    steps, every = min(t.steps, PROOF_STEPS), min(c.save_every, PROOF_SAVE_EVERY)
    return dataclasses.replace(
        config,
        train=dataclasses.replace(t, steps=steps, eval_every=min(t.eval_every, steps // 2)),
        checkpoint=dataclasses.replace(c, save_every=every),
    )


def proof_kill_step(config: RunConfig) -> int:
    """The proof's kill: a quarter of a save interval after the checkpoint at about two thirds of
    the run (step 45 of 60, resumed from 40; the 60% default kills after 36 and redoes 16 steps).
    The quarter (5 steps, ~1.5 s at the default size) lets the async save of step 40 commit
    first; if it did not, the resume starts from the one before, which the verdict records."""
    from tpulab.proofs.transformer import default_kill_step

    steps, every = config.train.steps, config.checkpoint.save_every
    k = max(every, 2 * steps // 3 // every * every) + max(1, every // 4)
    return k if k < steps else default_kill_step(steps, every)


def scaleout_config(config: RunConfig) -> RunConfig:
    """The demo's 2-process kill/resume: the tiny shapes of ``chaos_config``, 20 steps, mesh
    {data: 2, fsdp: 2}."""
    import dataclasses

    from tpulab.train.config import MeshConfig

    c = chaos_config(config)
    return dataclasses.replace(
        c,
        train=dataclasses.replace(c.train, steps=20, eval_every=10),
        mesh=MeshConfig(data=2, fsdp=2),
    )


def scaleout_section(v: ResumeVerdict, rel: str) -> str:
    e = v.details["event"]
    return "\n".join(
        [
            "## Multi-process kill/resume (2 processes x 2 host devices, mesh data=2 fsdp=2)",
            "",
            "Two trainer processes on JAX's distributed runtime (tpulab launch, gloo over "
            f"loopback). Process {e['victim_process']} was killed with **{e['signal']}** after "
            f"step {e['last_logged_step']}; the launcher tore the job down in "
            f"**{e['job_end_s']:.1f} s** (exit {e['launcher_exit_code']}, bound: poll + "
            f"{v.details['grace_s']:g} s grace; survivors: {len(e['survivors_after'])}). A fresh "
            f"2-process launch resumed from step {v.resumed_from_step}: {v.summary}.",
            "",
            f"![overlay]({rel}/overlay.png)",
            "",
            f"Evidence: `{rel}/{rundir.VERDICT}`.",
        ]
    )


def posttrain_configs(config: RunConfig, base: Path) -> dict[str, RunConfig]:
    """stage name -> run config of the recipe's fine-tuning stages (``recipe.finetune``: full SFT
    and LoRA) from the pretrained ``base``: a sixth of the pretraining run's steps (50 at the
    default size: 100 cost the two children ~30 CPU-s more; 25 saved them nothing measurable,
    60.0 against 61.3 CPU-s at 2026-12-05's load: their cost is start-up, compiles and the
    tracker), the same learning rate with a tenth of them as warm-up, validation every quarter."""
    steps = max(12, config.train.steps // 6)
    values = {
        "base": str(Path(base).absolute()),
        "steps": steps,
        "warmup": max(1, steps // 10),
        "eval_every": max(1, steps // 4),
        "save_every": max(1, steps // 2),
    }
    stages = recipe.finetune()
    return {name: recipe.stage_config(config, stage, values) for name, stage in stages.items()}


def posttrain_stage(
    config: RunConfig,
    base: Path,
    out: Path,
    compile_cache: Path | None = None,
    env: dict | None = None,
) -> str:
    """The recipe's fine-tuning stages from ``base`` (each a tracked `tpulab train` child, ``env``
    added to its environment), merge-lora of the LoRA ones, the evaluation of each against the
    base (logged to their MLflow runs; the first measures the base too), the report section.
    Raises TpulabError when a run fails, a merged model's greedy generations differ from the
    adapter model's, or the evaluation cannot be logged to a run."""
    from tpulab.posttrain import evaluate_sft, log_to_run
    from tpulab.train.merge import merge_lora

    d = Path(out) / "posttrain"
    configs = posttrain_configs(config, base)
    runs = {name: d / name for name in configs}
    for name, cfg in configs.items():
        recipe.train_stage(name, cfg, d, compile_cache, env)
    merges, evals, problems = {}, {}, []
    for i, (name, cfg) in enumerate(configs.items()):
        merged = d / f"{name}-merged" if cfg.objective.lora.rank else None
        if merged is not None:
            merges[name] = merge_lora(runs[name], merged)
        evals[name] = evaluate_sft(
            runs[name],
            merged=merged,
            with_base=i == 0,
            loss_pairs=EVAL_LOSS_PAIRS,
            prompts=EVAL_PROMPTS,
        )
        path = d / f"eval_{name}.json"
        atomic_write_json(path, evals[name])
        if not log_to_run(runs[name], evals[name], [path]):
            problems.append(f"the {name} evaluation is not in its MLflow run")
        m = evals[name].get("merged", {"generations": 0, "identical_generations": 0})
        if m["identical_generations"] != m["generations"]:
            problems.append(
                f"the merged model's greedy generations differ from the adapter model's on "
                f"{m['generations'] - m['identical_generations']} of {m['generations']} prompts"
            )
    section = report.posttrain_section(d, runs, evals, merges, "posttrain")
    atomic_write_bytes(d / "posttrain.md", section.encode())
    if problems:
        raise TpulabError(f"post-training: {'; '.join(problems)} (see {d})")
    return section


# Held-out pairs the capstone's response loss covers (of 1,166 at seq 128) and prompts its greedy
# stop rate generates from (64 by default): a mechanics check's sizes; the merged model's replies
# are still compared token for token on every prompt.
EVAL_LOSS_PAIRS, EVAL_PROMPTS = 128, 32


def tracking_section(
    out: Path, uri: str, untracked: tuple[Path, ...] = ()
) -> tuple[str, list[str]]:
    """The report's MLflow section and the failures it found: each run dir under ``out`` must be
    a run in ``uri`` holding every metric its metrics.jsonl logged. Left out: the dossier's runs
    (it trains in-process, for its measurements, with no tracker) and the ``untracked`` trees,
    whose children ran with ``--no-track``."""
    from tpulab.tracking.audit import audit_runs, run_dirs

    untracked = tuple(d for d in untracked if d.is_dir())
    rows = audit_runs(run_dirs(out, exclude=(out / "dossier", *untracked)), uri)
    rel = lambda p: p.relative_to(out).as_posix()  # noqa: E731
    bad = [r for r in rows if r.problem]
    lines = [
        "## MLflow tracking",
        "",
        f"Every training run above must be an MLflow run in `{uri}` holding every metric its "
        f"{rundir.METRICS} logged (a failing store only warns while training goes on; this is "
        f"where it would show): **{len(rows) - len(bad)} of {len(rows)}** runs complete.",
        "",
        table(
            ["run dir", "MLflow run", "steps", "in the store"],
            [
                (
                    f"`{rel(r.run_dir)}`",
                    r.run_id[:12] if r.run_id else "-",
                    r.steps,
                    "yes" if r.problem is None else f"**NO**: {r.problem}",
                )
                for r in rows
            ],
        ),
    ]
    if (out / "dossier").is_dir():
        lines += ["", "Not tracked: the dossier's runs (`dossier/`), trained in-process."]
    if untracked:
        resumed = [f"`{rel(r.run_dir)}`" for r in rows if r.run_dir.name == rundir.INTERRUPTED]
        lines += [
            "",
            "Run with `--no-track` (an MLflow writer costs a child ~5.7 CPU-s): "
            + ", ".join(f"`{rel(d)}/`" for d in untracked)
            + "."
            + (f" Killed and resumed, and audited here: {', '.join(resumed)}." if resumed else ""),
        ]
    if not rows:
        failures = [f"tracking: no training run under {out} to look up in {uri}"]
    elif bad:
        missing = "; ".join(f"{rel(r.run_dir)} ({r.problem})" for r in bad)
        failures = [f"tracking: runs missing from the MLflow store {uri}: {missing}"]
    else:
        failures = []
    return "\n".join(lines), failures


def run_capstone(
    config: RunConfig, out: Path, options: CapstoneOptions = CapstoneOptions()
) -> Path:
    from tpulab.proofs.checks import run_checks
    from tpulab.proofs.transformer import prove_transformer_resume
    from tpulab.tracking.store import STORE_NAME, sqlite_uri

    out = prepare_out(out)
    # This process's own compiles (checks, the post-training evaluation, pairs, win rates,
    # inference) go to the children's cache too: the LoRA evaluation's 5 compiles then cost 13.4
    # CPU-s instead of 17.5, its programs being SFT's.
    from tpulab import compile_cache

    compile_cache.enable(options.compile_cache)
    run_dir = out / "run"
    run = RunDir(out)
    config_path = write_child_config(config, run.config)
    stages = Stages("capstone")
    stage, failures = stages.run, stages.failures
    # One MLflow store for every run the capstone starts (training, proof, chaos, ...): the given
    # one, else mlruns.db here; it reaches each child in the environment the child is given
    # (``tracked``), and this process's own environment is left as it was.
    uri = os.environ.get("MLFLOW_TRACKING_URI") or sqlite_uri(out.absolute() / STORE_NAME)
    tracked = {"MLFLOW_TRACKING_URI": uri}

    def receipt_stage() -> str:
        from tpulab.evidence.receipt import collective_summary, hardware_line, markdown, run_receipt

        receipt = run_receipt(out / "receipt")
        return "\n".join(
            [
                "## Runtime receipt",
                "",
                f"What JAX reported and proved on this machine: **{hardware_line(receipt)}** "
                f"({collective_summary(receipt)}; a timed matmul checked against NumPy; a "
                "device-to-host round trip). Every chip named in this report comes from it.",
                "",
                markdown(receipt),
                "",
                "Evidence: `receipt/receipt.json`.",
            ]
        )

    def train_stage() -> str:
        run_to_completion(
            train_child_argv(config_path, run_dir, compile_cache=options.compile_cache),
            out / "train.log",
            {**os.environ, **tracked},
            3600,
            "training run",
        )
        return (
            report.provenance_section(RunDir(run_dir).read_env())
            + "\n\n"
            + report.run_section(run_dir)
            + "\n\n"
            + report.curves_section(run_dir, out / "plots" / "curves.png", "plots/curves.png")
            + "\n\n"
            + report.goodput_section(run_dir, "Goodput of the training run")
        )

    def proof_stage() -> str:
        # Untracked children (--no-track, ~5.7 CPU-s each): the tracking stage checks a proof's
        # lineage on the preference chain's DPO proof. The resumed process compiles from a fresh,
        # empty cache: the demo's one cold-cache resume.
        cfg = proof_config(config)
        verdict = prove_transformer_resume(
            cfg,
            out,
            reference_dir=run_dir if cfg == config else None,
            kill_at=proof_kill_step(cfg),
            compile_cache=options.compile_cache,
            track=False,
        )
        verdict = ResumeVerdict.from_dict(verdict)
        if not verdict.identical:
            raise TpulabError(
                f"the resumed run is not identical (max |diff| {verdict.max_abs_diff:g}, first "
                f"differing leaf {verdict.details.get('first_differing_leaf')}); see {run.proof}"
            )
        what = (
            "The proof's reference is the main run (`run/`)."
            if cfg == config
            else f"The proof's run is the main run's model, data and schedule for "
            f"{cfg.train.steps} steps, a checkpoint every {cfg.checkpoint.save_every} "
            f"(`{rundir.PROOF}/{rundir.CONFIG}`); its reference trained uninterrupted beside it "
            f"(`{rundir.PROOF}/{rundir.REFERENCE}/`)."
        )
        return (
            report.proof_section(run.proof.root, rundir.PROOF)
            + "\n\n"
            + what
            + "\n\n"
            + report.goodput_section(
                run.proof.interrupted.root, "Goodput of the killed-and-resumed run"
            )
        )

    def chaos_stage() -> str:
        from tpulab.proofs.chaos import run_chaos

        # Every lifetime shares the capstone's cache (the resume proof is the cold one) and is
        # untracked: a kill costs a process start, not a compile and an MLflow writer too.
        verdict = run_chaos(
            chaos_config(config),
            out,
            kills=options.chaos_kills,
            seed=0,
            compile_cache=options.compile_cache,
            warm_resume_cache=True,
            track=False,
        )
        verdict = ResumeVerdict.from_dict(verdict)
        if not verdict.identical:
            raise TpulabError(f"the chaos run is not identical: {verdict.summary}; see {run.chaos}")
        return (
            report.chaos_section(run.chaos.root, rundir.CHAOS)
            + "\n\n"
            + report.chaos_goodput(run.chaos.root)
        )

    def checks_stage() -> str:
        results = run_checks(config, run_dir=run_dir)
        atomic_write_json(out / "checks.json", {"rows": results})
        failed = [r["check"] for r in results if not r["passed"]]
        text = report.checks_section(results)
        if failed:
            failures.append(f"checks failed: {', '.join(failed)}")
        return text

    def scaleout_stage() -> str:
        from tpulab.proofs.scaleout import prove_multiprocess_resume

        v = prove_multiprocess_resume(
            scaleout_config(config),
            out / "scaleout",
            mode="kill",
            kill_at=8,
            stall_timeout_s=120,
            track=False,
        )
        v = ResumeVerdict.from_dict(v)
        if not (v.identical and v.details["teardown_ok"]):
            raise TpulabError(
                f"the 2-process resume is not identical or the teardown failed; see "
                f"{out / 'scaleout' / 'proof-kill'}"
            )
        return scaleout_section(v, "scaleout/proof-kill")

    # The bridge beside the dossier starts once the dossier's timed stages have ended: at
    # ddc421b it ran beside them all, and the profiled step was 13.6% off the unprofiled one
    # (goal 10%; 0.1% in that day's run with the dossier alone, though the host was busy).
    timed, interrupted = threading.Event(), []

    def dossier_stage() -> str:
        from tpulab.orchestrate.dossier import DEMO_PLAN, build_dossier

        try:  # raises, naming what failed
            build_dossier(config, out / "dossier", DEMO_PLAN, timed=timed.set)
        except TpulabError:
            raise
        except BaseException:  # Ctrl-C or a bug: the bridge must not start its children
            interrupted.append(True)
            raise
        finally:
            timed.set()
        return (
            "## Decision dossier\n\nBench, profile, TPU memory budgets compiled for real TPU "
            "targets, precision policy and one tested hypothesis, each with its evidence: "
            "[dossier/dossier.md](dossier/dossier.md) ([html](dossier/dossier.html))."
        )

    def tracking_stage() -> str:
        from tpulab.bridge.capstone import proof_dirs

        untracked = (run.proof.root, run.chaos.root, out / "scaleout", *proof_dirs(out))
        text, missing = tracking_section(out, uri, untracked)
        failures.extend(missing)
        return text

    # After train, stages go in groups that run at once (each mostly waits on its own children;
    # one at a time the demo used 1.4 of 2 cores), the report keeps this order. The dossier runs
    # in this (main) thread: it trains in-process, and the loop's SIGTERM handler can only be
    # installed there (in a worker thread it raised ValueError at 4c0564e). Beside it only the
    # bridge, whose JAX work is all in its children: the dossier's bench counts this process's
    # compiles (a stage compiling in-process would read as its recompile) and its profile traces
    # this process. Its 1.4 cores alone left 0.6 idle for 145 s at a9c6697; the bridge waits for
    # its timed stages (``timed``) and fills the rest (precision, budget: accuracy and compiles).
    together = stages.together
    stage("receipt", receipt_stage)
    stage("train", train_stage)
    trained = not failures
    if trained:
        proof = [("resume proof", proof_stage)]
        if options.chaos_kills > 0:
            proof.append(("chaos", chaos_stage))
        together(*proof, ("checks", checks_stage))
        post = []
        if not options.skip_posttrain:
            post.append(
                (
                    "post-training",
                    lambda: posttrain_stage(config, run_dir, out, options.compile_cache, tracked),
                )
            )
        if not options.skip_scaleout:
            post.append(("multi-process resume", scaleout_stage))
        if post:
            together(*post)
    lone = []
    if trained and not options.skip_dossier:
        lone.append(("dossier", dossier_stage))
    if not options.skip_bridge:
        from tpulab.bridge import capstone_stage as bridge_stage

        beside_dossier = bool(lone)

        def bridge_after_timed() -> str:
            if beside_dossier:
                timed.wait()
            if interrupted:
                raise TpulabError("not started: the dossier beside it was interrupted")
            return bridge_stage(out, tracked)

        lone.append(("bridge", bridge_after_timed))
    if lone:
        together(*lone, first_here=True)
    last = []
    sft = out / "posttrain" / recipe.chain()["source"]
    if RunDir(sft).summary.exists():  # the chain's source stage ended
        from tpulab.orchestrate.chain import chain_stage

        last.append(
            ("preference chain", lambda: chain_stage(sft, out, options.compile_cache, tracked))
        )
    if trained and not options.skip_inference:
        from tpulab.inference import capstone_stage as inference_stage

        last.append(("inference", lambda: inference_stage(run_dir, out / "inference")))
    if last:
        together(*last)
    stage("tracking", tracking_stage)

    def write() -> Path:
        record = stages.record()
        atomic_write_json(out / "stages.json", record)
        host = record["host"]
        header = [
            "# tpulab capstone report",
            "",
            "Every number below was measured by this run and carries its provenance; the raw "
            "evidence sits beside this file.",
            "",
            stages.status(),
            "",
            stages.times(),
            "",
            stages.cpu(),
            "",
            f"Each group's wall and CPU seconds on this host ({host['cpu_model']}, "
            f"{host['cpu_count']} cores, load average {host['load_avg_1m_5m_15m'][1]:g} over the "
            "last 5 minutes at the end; `stages.json`):",
            "",
            stages.table(),
        ]
        text = "\n".join(header) + "\n\n" + stages.body() + "\n"
        path, page = report.write_reports(out, text, "tpulab capstone report")
        if RunDir(run_dir).mlflow_run.exists():
            from tpulab.tracking.store import log_files_to_run

            log_files_to_run(run_dir, [path, page, out / "plots" / "curves.png"], "report")
        return path

    return stages.finish(write, "capstone failed", see="report:")
