"""Shared fixtures: a tiny-config factory, one compilation cache for every process, one trained run,
and the preference tests' SFT policy and sampled pairs.

Under pytest-xdist each worker is its own process with its own session fixtures; the fixtures here
are built once for the whole run (``built_once``: the first worker builds, the others wait on a file
lock and reuse it), and every worker and child shares one compilation cache.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tpulab.libtpu_env import quiet_libtpu_off_tpu, set_explicitly

# libtpu is installed for the AOT tests; off a TPU it must not print on every jax init
quiet_libtpu_off_tpu()

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


# The longest modules first (per-file setup + call + teardown seconds of the a9c6697 whole-suite
# profile, 2 workers): pytest-xdist hands out modules in collection order, so a long module
# collected last runs alone at the end while the other worker idles (there the capstone ran alone
# for its last ~2 min); a module that builds a shared fixture comes before the one that reads it.
LONGEST_FIRST = (
    "test_dpo",  # 262: builds the preference chain (124 s) that test_sft_eval reads later
    "test_scaleout_procs",  # 244
    "test_cloud_rehearsal",  # 201
    "test_serve",  # 192
    "test_serve_ready",  # new in 77ce712: four real service starts and six signal trials
    "test_export",  # 168
    "test_rl_objective",  # new: ~125 CPU-s at load 7 (chaos, prove-resume, learning check)
    "test_digits_vision",  # new: ~100 CPU-s (two prove-resumes, audits, probe)
    "test_mlm",  # new: ~100 CPU-s (audits' 4-device child, prove-resume)
    "test_image",  # 157
    "test_ppo",  # 147
    "test_kvcache",  # 139
    "test_bridge_proofs",  # 137
    "test_sft",  # 136
    "test_resume_proof",  # 130
    "test_budget",  # 128
    "test_sft_eval",  # 127
    "test_registry",  # 107: builds the registry flow that test_serve_registry reads
    "test_serve_registry",  # 103
    "test_tracking",  # 99
    "test_hardening",  # 92
    "test_dossier",  # 88
    "test_generate",  # 77
    "test_capstone",  # 74
    "test_rl_seeds",  # new: ~60 CPU-s
)


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: file order


def run_root(tmp_path_factory) -> Path:
    """The directory every xdist worker of this pytest run shares (the base temp without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``build(dir)`` run once per pytest run, whichever worker asks first; the others block on the
    lock and get the finished dir. Users must treat it as read only."""
    root = run_root(tmp_path_factory)
    out, done = root / f"once-{name}", root / f"once-{name}.done"
    with open(root / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session", autouse=True)
def compile_cache_env(tmp_path_factory) -> dict:
    """One persistent JAX compilation cache for this process, the other workers and every child
    they start (JAX skips an entry it cannot read and compiles, so concurrent writers are safe)."""
    cache = os.environ.get("TPULAB_COMPILE_CACHE") or str(
        run_root(tmp_path_factory) / "jax-compile-cache"
    )
    os.environ["TPULAB_COMPILE_CACHE"] = cache
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    from tpulab import compile_cache

    compile_cache.enable(cache)
    return {"TPULAB_COMPILE_CACHE": cache, "JAX_COMPILATION_CACHE_DIR": cache}


def tiny_config(*overrides: str):
    """The CI-size RunConfig (configs/tiny.yaml) with ``--set``-style overrides."""
    from tpulab.config import load
    from tpulab.train.config import RunConfig

    return load(RunConfig, TINY, list(overrides))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A run dir trained with configs/tiny.yaml for 40 steps (checkpoints at 20, 30, 40)."""
    from tpulab.train.loop import train

    def build(d: Path) -> None:
        train(tiny_config(), d / "run", progress=False)

    return built_once(tmp_path_factory, "trained", build) / "run"


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> Path:
    """configs/default.yaml (the demo's model) trained for the first 100 of its 300 scheduled
    steps, once per pytest run: the pretraining golden and the KV-cache bounds read it."""
    from tpulab.config import load
    from tpulab.train.config import RunConfig
    from tpulab.train.loop import train

    def build(d: Path) -> None:
        cfg = load(RunConfig, REPO / "configs" / "default.yaml", ["train.steps=100"])
        train(cfg, d / "run", progress=False)

    return built_once(tmp_path_factory, "default-100", build) / "run"


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m tpulab.cli ARGS` in a real subprocess (same venv), output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tpulab.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=set_explicitly(dict(os.environ), env or {}),
        cwd=cwd or REPO,
    )


@pytest.fixture(scope="session")
def sft_policy(trained_run, tmp_path_factory) -> Path:
    """A tiny SFT run (12 steps from ``trained_run``): the policy and reference of the preference
    tests (tests/test_reward.py, tests/test_dpo.py), read only."""
    from tpulab.train.loop import train

    sets = ("objective.kind=sft", f"objective.init={trained_run}", "train.steps=12")

    def build(d: Path) -> None:
        cfg = tiny_config(*sets, "train.eval_every=6", "checkpoint.save_every=6")
        train(cfg, d / "run", progress=False)

    return built_once(tmp_path_factory, "sft-policy", build) / "run"


@pytest.fixture(scope="session")
def sampled_pairs(sft_policy, tmp_path_factory) -> Path:
    """``tpulab pairs`` output from ``sft_policy``: 64 training and 16 held-out prompts."""
    from tpulab.posttrain.pairs import PairsConfig, make_pairs

    def build(d: Path) -> None:
        make_pairs(sft_policy, d / "pairs", PairsConfig(train_prompts=64, eval_prompts=16))

    return built_once(tmp_path_factory, "pairs", build) / "pairs"


def verified_export(trained_run: Path, tmp_path_factory, step: int) -> Path:
    """Artifacts of ``trained_run``'s ``step`` exported and verified once per pytest run (the serve,
    registry-serving and image modules share them, read only)."""
    from tpulab.inference.export import export_artifacts
    from tpulab.inference.trust import verify_export
    from tpulab.train.restore import load_model

    def build(d: Path) -> None:
        export_artifacts(load_model(trained_run, step), trained_run, d / "art")
        assert verify_export(d / "art", trained_run)["passed"]

    return built_once(tmp_path_factory, f"verified-export-{step}", build) / "art"


@pytest.fixture(scope="session")
def tiny_proof(trained_run, tmp_path_factory) -> Path:
    """The run dir of one `tpulab prove-resume --config configs/tiny.yaml` per pytest run (its
    proof/ and the command's output in proof.out): the proof test and the goodput test read it.
    Its reference is ``trained_run`` (the same config, finished, uninterrupted: ``--reference``);
    tests/test_resume_proof.py's whole-state control trains its own. No MLflow (``--no-track``):
    a proof's lineage is tests/test_capstone.py's."""

    def build(d: Path) -> None:
        result = run_cli(
            *("prove-resume", "--run-dir", str(d / "run"), "--config", str(TINY)),
            *("--reference", str(trained_run), "--no-track"),
        )
        (d / "proof.out").write_text(f"{result.returncode}\n{result.stdout}{result.stderr}")
        assert result.returncode == 0, result.stderr

    return built_once(tmp_path_factory, "tiny-proof", build) / "run"


@pytest.fixture(scope="session")
def preference_chain(sft_policy, tmp_path_factory) -> Path:
    """The capstone's preference-chain stage (``orchestrate.chain.chain_stage``: pairs, reward
    model, DPO, PPO and the DPO kill/resume proof, five `tpulab train` children) from a copy of
    ``sft_policy`` (``sft/``), tracked in ``mlruns.db`` beside it, once per pytest run: the chain
    section's test (tests/test_sft_eval.py) and the DPO proof's (tests/test_dpo.py) read it.
    Returns the out dir (the chain in ``posttrain/chain``); read only."""
    from tpulab.orchestrate.chain import chain_stage
    from tpulab.tracking.store import sqlite_uri

    def build(d: Path) -> None:
        # a copy: the chain test's control changes a copy of it, and the session's policy is shared
        shutil.copytree(sft_policy, d / "sft")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLFLOW_TRACKING_URI", sqlite_uri(d / "mlruns.db"))
            (d / "section.md").write_text(chain_stage(d / "sft", d))

    return built_once(tmp_path_factory, "preference-chain", build)


# --- One registry flow for tests/test_registry.py and tests/test_serve_registry.py ---------------


def registry_cli(uri: str, *args: str) -> tuple[int, str, str]:
    """``tpulab registry ARGS --tracking-uri URI`` in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    from tpulab.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["registry", *args, "--tracking-uri", uri])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def registry_flow(trained_run, tmp_path_factory) -> tuple[Path, list[str]]:
    """A registry store once per pytest run (``store/``: the sqlite MLflow store and the ledger):
    model ``tiny``, v1 = ``trained_run``'s step-20 verified export, v2 = step 40's, champion
    promoted to v1 then to v2, all through the CLI's ``main`` in process (each command verifies
    against the checkpoint and runs the behaviour suite: ~10 s apiece here); with each command's
    stdout. Read only: a test that writes copies ``store/``."""
    import json

    exports = {step: verified_export(trained_run, tmp_path_factory, step) for step in (20, 40)}

    def build(d: Path) -> None:
        uri, outputs = f"sqlite:///{d / 'store'}/mlruns.db", []
        (d / "store").mkdir()
        register = ("register", "--name", "tiny", "--artifacts")
        for args in (
            (*register, str(exports[20]), "--reason", "first cut"),
            (*register, str(exports[40])),
            ("promote", "tiny", "1", "--to", "champion", "--reason", "first champion"),
            ("promote", "tiny", "2"),
        ):
            rc, out, err = registry_cli(uri, *args)
            assert rc == 0, err
            outputs.append(out)
        (d / "outputs.json").write_text(json.dumps(outputs))

    d = built_once(tmp_path_factory, "registry-flow", build)
    return d / "store", json.loads((d / "outputs.json").read_text())


def copy_registry_store(src: Path, dst: Path) -> Path:
    """A private copy of a registry store (the sqlite file, the ledger), its experiments' artifact
    location moved into the copy (MLflow keeps it absolute), so that what a test logs there (a
    promotion's behaviour.json) lands in the copy, never in the shared original."""
    import sqlite3

    shutil.copytree(src, dst, dirs_exist_ok=True)
    db = sqlite3.connect(dst / "mlruns.db")
    with db:
        location = (dst / "mlartifacts").absolute().as_uri()
        db.execute("UPDATE experiments SET artifact_location = ?", (location,))
    db.close()
    return dst


# --- The CLI in this process, for argument validation and one-line errors ------------------------


def run_main(capture, *args) -> subprocess.CompletedProcess:
    """``tpulab ARGS`` in this process (``tpulab.cli.main.main``, what ``python -m tpulab.cli``
    runs): its exit code and what it printed, read through ``capture`` (the test's ``capfd``, so
    lines from helper processes count too). For argument validation and one-line errors, where no
    process boundary is under test: each saves a child's ~3 CPU-s of imports. argparse's usage
    errors exit 2 as in a process; the SIGTERM handler ``train`` installs is put back."""
    import signal

    from tpulab.cli.main import main

    capture.readouterr()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse: --help and usage errors
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    out, err = capture.readouterr()
    return subprocess.CompletedProcess(["tpulab", *map(str, args)], code, out, err)


# --- Proofs and negative controls the objectives' tests share -----------------------------------


def frozen_tamper_error(cfg, run_dir: Path, at_step: int, edit: Callable[[dict], None]):
    """The negative control of the loop's frozen-weights check, in this process: ``cfg`` trained
    with a hook that calls ``edit`` on the objective's frozen weights (in place) after step
    ``at_step``. The loop must refuse the run at its end; the error it raised is returned."""
    from tpulab.errors import TpulabError
    from tpulab.train.hooks import Hooks
    from tpulab.train.loop import train
    from tpulab.train.objectives import build

    obj = build(cfg)
    real_steps = obj.steps

    class Tamper(Hooks):
        def after_step(self, step, state, metrics):
            if step == at_step:
                edit(self.frozen)
            return state, metrics

    tamper = Tamper()

    def steps(mesh):
        s = real_steps(mesh)
        tamper.frozen = s.frozen
        return s

    obj.steps = steps
    with pytest.raises(TpulabError, match="frozen weights changed") as e:
        train(cfg, run_dir, progress=False, hooks=[tamper], objective=obj)
    return e.value


def one_kill_chaos(cfg, out: Path, reference: Path, seed: int) -> dict:
    """`tpulab chaos`'s driver, called in this process: one random SIGKILL (a test's fixed-point
    proof covers the rest) against ``reference``, the same config trained uninterrupted; the
    resumed processes share the warm compile cache (the cold resume is tests/test_sft.py's
    full-SFT proof) and are untracked (tracking is tests/test_tracking.py's). Its verdict.json,
    as on disk, once it has passed: identical to the end, the final state too, one kill."""
    import json

    from tpulab.proofs.chaos import run_chaos

    run_chaos(
        cfg,
        out,
        kills=1,
        seed=seed,
        reference_dir=reference,
        warm_resume_cache=True,
        track=False,
    )
    v = json.loads((out / "chaos" / "verdict.json").read_text())
    assert v["reference_dir"] == str(reference) and not (out / "chaos" / "reference").exists()
    assert v["identical"] and v["final_state_identical"] and v["kills"] == 1
    return v
