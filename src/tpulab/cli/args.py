"""The argument shapes the subcommands share, and the flags they parse into objects: one place
for each (a run dir flag, the config flags, a repeatable ``KEY=VALUE`` flag, tracking, a proof's
verdict line and exit code).

Path flags use ``path_arg`` and are checked before use (``check_paths``, for every handler, or
``checked_path``): ``Path("")`` would silently mean the current directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from tpulab.checkpoint.rundir import ResumeVerdict
from tpulab.errors import ExitCode

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "default.yaml"


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=path_arg, help="YAML config (default: configs/default.yaml)")
    add_repeatable(
        p,
        "--set",
        "override one config value, e.g. --set model.d_model=256 (repeatable)",
        dest="overrides",
    )
    p.add_argument("--steps", type=int, help="train until this step (train.steps)")
    p.add_argument("--data", help="text file or directory of *.txt to train on (data.path)")
    p.add_argument("--compile-cache", type=Path, help="JAX persistent compilation cache dir")


def path_arg(value: str) -> Path | str:
    """argparse type: ``Path(value)``; an empty value stays ``""`` (``Path("")`` means ``.``)."""
    return Path(value) if value else value


def checked_path(value: Path | str, flag: str) -> Path:
    """The path of ``flag``, or a one-line error if it is empty or too long for the OS."""
    from tpulab.config import check_path

    check_path(str(value), flag)
    return Path(value)


PATH_FLAGS = ("run_dir", "out", "artifacts", "key_file", "trace_log", "drift_reference")


def check_paths(args: argparse.Namespace) -> argparse.Namespace:
    """Every path flag of ``PATH_FLAGS`` that was given: one error line if it is "" or too long,
    else a ``Path``. The dispatcher (``cli.main``) calls it before every handler."""
    for name in PATH_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            setattr(args, name, checked_path(value, "--" + name.replace("_", "-")))
    return args


def load_run_config(args):
    from tpulab import load_config

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.data is not None:
        overrides.append(
            f"data.path={json.dumps(args.data)}"
        )  # quoted: a path, never YAML (null, yes, 1e3)
    if args.config is not None:
        path = checked_path(args.config, "--config")
    else:
        path = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
    return load_config(path, overrides)


def from_flags(cls, args: argparse.Namespace, **flag_of: str):
    """The config dataclass ``cls`` with every field that has a flag of its name set from it (or
    from the flag ``flag_of`` names for it, which must exist); the others keep their defaults, and
    the config's own checks run as usual."""
    missing = sorted(name for name in flag_of.values() if not hasattr(args, name))
    if missing:
        raise AttributeError(f"{cls.__name__}: no flag {missing[0]} among the parsed arguments")
    values = {}
    for f in dataclasses.fields(cls):
        flag = flag_of.get(f.name, f.name)
        if hasattr(args, flag):
            values[f.name] = getattr(args, flag)
    return cls(**values)


def add_run_dir(p: argparse.ArgumentParser, help: str | None = None, required: bool = True):
    """``--run-dir``: a path flag (checked before use), required unless said."""
    p.add_argument("--run-dir", required=required, type=path_arg, help=help)


def add_repeatable(
    p: argparse.ArgumentParser, flag: str, help: str, metavar: str = "KEY=VALUE", **kwargs
) -> None:
    """A flag that may be given several times, collected in order into a list (default empty)."""
    p.add_argument(flag, action="append", default=[], metavar=metavar, help=help, **kwargs)


def verdict_exit(v: ResumeVerdict, line: str, *, ok: bool | None = None, subject: str = "") -> int:
    """Print a proof's line, ``[subject: ]IDENTICAL: ...`` or ``NOT IDENTICAL: ...``, and return
    its exit code: FAILED whenever the proof did not pass (``ok``; default: identical)."""
    said = "IDENTICAL" if v.identical else "NOT IDENTICAL"
    print(f"{subject}: {said}: {line}" if subject else f"{said}: {line}")
    return ExitCode.OK if (v.identical if ok is None else ok) else ExitCode.FAILED


def add_tracking_args(p: argparse.ArgumentParser, stall: bool = True) -> None:
    g = p.add_argument_group("tracking and run health")
    g.add_argument(
        "--tracking-uri",
        help="MLflow tracking store (default: $MLFLOW_TRACKING_URI, else "
        "sqlite:///<parent of --run-dir>/mlruns.db)",
    )
    g.add_argument("--no-track", action="store_true", help="no MLflow tracking")
    g.add_argument(
        "--require-tracking",
        action="store_true",
        help="fail before training when the tracking store cannot be opened or written "
        "(default: warn, train on)",
    )
    if not stall:
        return
    from tpulab.train.watchdog import STARTUP_S  # no jax: --help stays quick

    g.add_argument(
        "--stall-timeout",
        type=float,
        metavar="S",
        help="seconds without a completed step that count as a stall, from the first step on "
        "(default: 20x the median step time, at least 120 s; 300 s with several processes)",
    )
    g.add_argument(
        "--stall-startup-timeout",
        type=float,
        metavar="S",
        default=STARTUP_S,
        help="seconds allowed for start-up: restore, compile and the first step (default: "
        f"{STARTUP_S:g})",
    )
    g.add_argument(
        "--stall-exit",
        action="store_true",
        help=f"on a stall, exit with code {int(ExitCode.STALLED)} after dumping stacks "
        "(so a supervisor restarts the run)",
    )


def add_warm_resume_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--warm-resume-cache",
        action="store_true",
        help="let each resumed process share the compilation cache of the runs before it (faster); "
        "by default it gets a fresh, empty one, as after a preemption onto a new machine",
    )


def add_children_no_track_arg(p: argparse.ArgumentParser, trainer: str = "tpulab train") -> None:
    """A proof's ``--no-track``: its child trainers (``trainer``) log no MLflow runs."""
    p.add_argument(
        "--no-track",
        action="store_true",
        help=f"no MLflow tracking of the child trainers (default: each tracks, as `{trainer}`)",
    )


def add_reference_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reference",
        type=path_arg,
        help="reuse this finished, uninterrupted run of the same config as the reference "
        "(read only) instead of training one",
    )


def add_proof_children_args(
    p: argparse.ArgumentParser, *, reference: bool = True, trainer: str = "tpulab train"
) -> None:
    """The flags about a proof's child trainers (read back by ``proof_children``): the reference
    run to reuse, whether a resumed child shares the compilation cache, tracking."""
    if reference:
        add_reference_arg(p)
    add_warm_resume_cache_arg(p)
    add_children_no_track_arg(p, trainer)


def proof_children(args) -> dict:
    """What a one-process proof's flags say about its child trainers, as the keyword arguments
    ``prove_transformer_resume`` and ``run_chaos`` share: the reference run to reuse, the
    compilation cache and whether a resumed child shares it, tracking."""
    return {
        "reference_dir": (
            None if args.reference is None else checked_path(args.reference, "--reference")
        ),  # "" is an error, never "no reference"
        "compile_cache": args.compile_cache,
        "warm_resume_cache": args.warm_resume_cache,
        "track": not args.no_track,
    }


def tracker_for(args, run_dir: Path, **kwargs):
    """The MLflow tracker a command's flags ask for, or None. --require-tracking opens the store
    and writes to it now, so a store that cannot take the run's records stops it before step 0."""
    if args.no_track:
        if args.require_tracking:
            from tpulab.errors import TpulabError

            raise TpulabError("--no-track and --require-tracking contradict each other")
        return None
    from tpulab.tracking.hook import MlflowTracker

    tracker = MlflowTracker(run_dir, args.tracking_uri, **kwargs)
    if args.require_tracking:
        tracker.check()
    return tracker
