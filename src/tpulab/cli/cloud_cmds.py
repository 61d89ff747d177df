"""`tpulab receipt` and `tpulab tpu create|stage|run|fetch|delete|up` (and `worker-job`, run on a
worker). Each step runs inside ``CloudSession.interruptible``: SIGTERM acts like Ctrl-C, and the
error names the VM the step leaves (``up`` deletes it itself)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tpulab.checkpoint.rundir import METRICS, read_json
from tpulab.cli.args import add_repeatable
from tpulab.errors import ExitCode

CLOUD_CONFIG_COPY = "cloud_config.yaml"


def cmd_receipt(args) -> int:
    from tpulab.evidence.receipt import Target, run_receipt, table
    from tpulab.train.distributed import initialize_from_env

    initialize_from_env()  # a process of a multi-process job joins it: the collective spans all
    target = Target.parse(args.expect, args.expect_devices) if args.expect else None
    if target is None and args.expect_devices is not None:
        target = Target.parse(_backend_now(), args.expect_devices)
    receipt = run_receipt(args.out, target, matmul_size=args.matmul_size)
    print(table(receipt), end="")
    return ExitCode.OK


def _backend_now() -> str:
    import jax

    return jax.default_backend()


def _cloud_config(args):
    """--cloud-config/--set when given, else the copy create/up saved in DIR/cloud/."""
    import yaml

    from tpulab.checkpoint.files import atomic_write_bytes
    from tpulab.cloud.config import load_cloud_config
    from tpulab.config import to_dict

    saved = Path(args.dir) / "cloud" / CLOUD_CONFIG_COPY
    path = args.cloud_config or (saved if saved.exists() else None)
    shared = getattr(args, "shared_dir", None)
    cfg = load_cloud_config(
        path, args.overrides + ([f"shared_dir={json.dumps(shared)}"] if shared else [])
    )
    cfg.require_target()
    saved.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(saved, yaml.safe_dump({"cloud": to_dict(cfg)}, sort_keys=False).encode())
    return cfg


def _session(args):
    from tpulab.cloud.lifecycle import CloudSession

    return CloudSession(
        _cloud_config(args), args.dir, echo=lambda m: print(m, file=sys.stderr, flush=True)
    )


def _parse_env(items: list[str], what: str) -> dict:
    from tpulab.errors import TpulabError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise TpulabError(f"{what} expects NAME=VALUE, got {item!r}")
        out[key] = value
    return out


def _job(args, staged: dict | None = None):
    from tpulab.cloud.job import JobSpec
    from tpulab.errors import TpulabError

    worker_env: dict[int, dict] = {}
    for item in getattr(args, "worker_env", []):
        idx, sep, rest = item.partition(":")
        if not sep or not idx.isdigit():
            raise TpulabError(f"--worker-env expects WORKER:NAME=VALUE, got {item!r}")
        worker_env.setdefault(int(idx), {}).update(_parse_env([rest], "--worker-env"))
    config = getattr(args, "config", None) or (staged or {}).get("config")
    data = getattr(args, "data", None) or (staged or {}).get("data")
    return JobSpec(
        config=Path(config) if config else None,
        data=Path(data) if data else None,
        job=getattr(args, "job", None),
        run_name=getattr(args, "run_name", "run"),
        env=_parse_env(getattr(args, "env", []), "--env"),
        worker_env=worker_env,
    )


def _staged(args) -> dict | None:
    return read_json(Path(args.dir) / "cloud" / "staged.json", None)


def _step(args, step: str, *step_args, **step_kwargs):
    """One step command's VM step (``session.<step>``), interruptible: SIGTERM acts like Ctrl-C
    and the one-line error names the VM (``CloudSession.interruptible``)."""
    session = _session(args)
    with session.interruptible(step):
        return getattr(session, step)(*step_args, **step_kwargs)


def cmd_create(args) -> int:
    identity = _step(args, "create")
    print(
        f"{identity['name']} is {identity['state']}: {identity['accelerator_type']}, "
        f"{len(identity['network_endpoints'])} worker(s) -> "
        f"{Path(args.dir) / 'cloud' / 'resource.json'}"
    )
    return ExitCode.OK


def cmd_stage(args) -> int:
    job = _job(args)  # bad input fails before anything is written or called
    staged = _step(args, "stage", job)
    print(f"staged {staged['wheel']} on every worker")
    return ExitCode.OK


def cmd_run(args) -> int:
    job = _job(args, _staged(args))
    _step(args, "run", job, preempt_at=args.preempt_at)
    print(
        f"job finished on every worker (run dir {args.run_name}); next: tpulab tpu fetch "
        f"--dir {args.dir}"
    )
    return ExitCode.OK


def cmd_fetch(args) -> int:
    from tpulab.cloud.explog import write_experiment_log

    report = _step(args, "fetch", args.run_name)
    n = sum(len(w["checkpoints"]) for w in report["workers"])
    where = (
        f"the shared run dir and {len(report['worker_dirs'])} worker dir(s)"
        if report["shared_dir"]
        else f"{len(report['workers'])} worker run dir(s)"
    )
    print(
        f"retrieved {where}, {n} checkpoint manifest(s) verified; "
        f"log: {write_experiment_log(args.dir)}"
    )
    return ExitCode.OK


def cmd_delete(args) -> int:
    from tpulab.cloud.explog import write_experiment_log

    cleanup = _step(args, "delete")
    write_experiment_log(args.dir)
    print(f"{cleanup['name']} deleted; verified gone (describe: NOT_FOUND, list: absent)")
    return ExitCode.OK


def cmd_up(args) -> int:
    from tpulab.cloud.up import up

    job = _job(args)
    result = up(_session(args), job, preempt_at=args.preempt_at)
    print(f"done; VM deleted and verified gone. Log: {result['experiment_log']}")
    return ExitCode.OK


def cmd_worker_job(args) -> int:
    from tpulab.cloud.worker import run_with_preemption

    argv = list(args.job)
    if argv and argv[0] == "--":
        argv = argv[1:]
    result = run_with_preemption(
        [sys.executable, "-m", "tpulab.cli", *argv],
        args.run_dir,
        args.preempt_at,
        record=args.record,
    )
    print(
        f"preempted (SIGTERM) at step {result['preempted_at_step']}; checkpoint saved, "
        f"exit {result['job_rc']}"
    )
    return ExitCode.OK


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        required=True,
        type=Path,
        help="local run directory (cloud/, workers/, experiment.md)",
    )
    p.add_argument(
        "--cloud-config",
        type=Path,
        help="YAML with a cloud: section (default: the copy in DIR/cloud/)",
    )
    add_repeatable(
        p,
        "--set",
        "override a cloud config value, e.g. --set project=my-proj --set zone=us-central1-a",
        dest="overrides",
    )


def _shared_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shared-dir",
        metavar="PATH",
        help="a directory every worker sees (Filestore/NFS or gcsfuse mount point): the job's "
        "run dir becomes PATH/runs/NAME (short for --set shared_dir=PATH; kept in DIR/cloud/)",
    )


def _stage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        help="training config YAML to copy to every worker ({config} in the job)",
    )
    p.add_argument(
        "--data",
        type=Path,
        help="corpus file or directory to copy ({data} in the job; default: the shipped corpus)",
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    from tpulab.cloud.job import DEFAULT_JOB

    p.add_argument(
        "--job",
        help="the tpulab command line each worker runs; placeholders {run_dir} {config} "
        f"{{data}} (default: '{DEFAULT_JOB}', with --config/--data when staged)",
    )
    p.add_argument(
        "--run-name", default="run", help="run directory name on the workers (runs/NAME)"
    )
    add_repeatable(p, "--env", "env var for the job on all workers", "NAME=VALUE")
    add_repeatable(
        p,
        "--worker-env",
        "env var for worker I only (switches to one ssh per worker, in parallel)",
        "I:NAME=VALUE",
    )
    p.add_argument(
        "--preempt-at",
        type=int,
        help="rehearse a preemption: SIGTERM the job on all workers at this "
        "step, then run it again to resume",
    )


def register(sub) -> None:
    p = sub.add_parser(
        "receipt",
        help="verified runtime receipt (collective, matmul, round trip); --expect qualifies "
        "the target",
    )
    p.add_argument(
        "--out", required=True, type=Path, help="directory for receipt.json and receipt.md"
    )
    p.add_argument(
        "--expect", help="target to qualify: tpu:v5e, tpu:v5p, tpu:v6e, tpu, gpu[:name], cpu"
    )
    p.add_argument("--expect-devices", type=int, help="global device count the target must have")
    p.add_argument("--matmul-size", type=int, default=512, help="N of the timed NxN float32 matmul")
    p.set_defaults(handler=cmd_receipt)

    tpu = sub.add_parser(
        "tpu", help="TPU VM lifecycle through gcloud: create, stage, run, fetch, delete, up"
    )
    tsub = tpu.add_subparsers(dest="tpu_command", required=True, metavar="STEP")
    for name, handler, help_, extra in (
        ("create", cmd_create, "create the VM, wait for READY, record its identity", ()),
        (
            "stage",
            cmd_stage,
            "copy wheel, config and corpus to every worker; bootstrap the venv",
            (_stage_args,),
        ),
        (
            "run",
            cmd_run,
            "receipt --expect on every worker, then the job on every worker",
            (_run_args, _shared_arg),
        ),
        (
            "fetch",
            cmd_fetch,
            "retrieve the run dir(s) and verify the checkpoint manifests here",
            (_shared_arg,),
        ),
        ("delete", cmd_delete, "delete the VM and verify it is gone", ()),
        (
            "up",
            cmd_up,
            "create, stage, run, fetch, then delete whatever happened",
            (_stage_args, _run_args, _shared_arg),
        ),
    ):
        p = tsub.add_parser(name, help=help_)
        _common(p)
        for add in extra:
            add(p)
        if name == "fetch":
            p.add_argument("--run-name", default="run")
        p.set_defaults(handler=handler)

    p = tsub.add_parser("worker-job", help="(runs on a worker) the job, SIGTERM'd at --preempt-at")
    p.add_argument(
        "--run-dir",
        required=True,
        type=Path,
        help=f"the job's run dir (its {METRICS} is watched)",
    )
    p.add_argument("--preempt-at", required=True, type=int)
    p.add_argument(
        "--record",
        type=Path,
        help="where the rehearsal record goes (default: RUN_DIR/preempt.json)",
    )
    p.add_argument("job", nargs=argparse.REMAINDER, help="-- then the tpulab command line")
    p.set_defaults(handler=cmd_worker_job)
