"""Tracking and reporting subcommands: runs (the MLflow store), report (report.md + report.html)."""

from __future__ import annotations

from pathlib import Path

from tpulab.cli.args import add_run_dir
from tpulab.errors import ExitCode


def cmd_runs(args) -> int:
    from tpulab.errors import TpulabError
    from tpulab.tracking.store import STORE_NAME, default_uri, list_runs

    uri = args.tracking_uri or default_uri(Path.cwd() / "x")
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        raise TpulabError(
            f"no tracking store at {uri[len('sqlite:///') :]} (runs log to {STORE_NAME} next to "
            "their run dir; pass --tracking-uri sqlite:///PATH/TO/" + STORE_NAME + ")"
        )
    rows = list_runs(uri)
    if not rows:
        print(f"no runs in {uri}")
        return ExitCode.OK
    fmt = lambda v: "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))  # noqa: E731
    header = (
        "name",
        "status",
        "steps",
        "loss",
        "val loss",
        "resumes",
        "goodput",
        "backend",
        "run id",
    )
    table = [header] + [
        (
            r["name"],
            r["status"],
            fmt(r["steps"]),
            fmt(r["final_loss"]),
            fmt(r["final_val_loss"]),
            str(r["resumes"]),
            "-" if r["goodput"] is None else f"{100 * r['goodput']:.0f}%",
            r["backend"],
            r["run_id"][:12],
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return ExitCode.OK


def cmd_report(args) -> int:
    from tpulab.orchestrate.report import build_report, find_run_dir, write_reports

    md, page = write_reports(args.run_dir, build_report(args.run_dir))
    run_dir = find_run_dir(args.run_dir)
    if run_dir is not None and not args.no_track:
        from tpulab.tracking.store import log_files_to_run

        log_files_to_run(run_dir, [md, page, args.run_dir / "plots" / "curves.png"], "report")
    print(f"report: {md} and {page}")
    return ExitCode.OK


def register(sub) -> None:
    p = sub.add_parser("runs", help="list the runs in an MLflow tracking store")
    p.add_argument(
        "--tracking-uri", help="store to read (default: $MLFLOW_TRACKING_URI, else ./mlruns.db)"
    )
    p.set_defaults(handler=cmd_runs)

    p = sub.add_parser(
        "report",
        help="write report.md and a self-contained report.html from a run, proof or capstone dir",
    )
    add_run_dir(p)
    p.add_argument(
        "--no-track", action="store_true", help="do not attach the report to the run's MLflow run"
    )
    p.set_defaults(handler=cmd_report)
