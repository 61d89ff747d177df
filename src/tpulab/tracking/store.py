"""The MLflow store: which URI a run logs to, opening it (with a cached empty schema), probing that
it takes writes, listing its runs, attaching files, and the one-line cause of a store failure.

mlflow is imported only inside these functions, so `tpulab --help` never pays its ~2 s import.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from pathlib import Path

from tpulab.checkpoint.rundir import MLFLOW_RUN, RunDir, read_json
from tpulab.errors import TpulabError

RUN_FILE = MLFLOW_RUN  # in the run dir: which store and run this run dir logs to
EXPERIMENT = "tpulab"
STORE_NAME = "mlruns.db"
WRITE_CHECK_TAG = "tpulab.write_check"  # experiment tag the --require-tracking probe writes


def default_uri(run_dir: str | Path, explicit: str | None = None) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else a sqlite ``mlruns.db`` next to the run dir."""
    if explicit:
        return explicit
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return sqlite_uri(Path(run_dir).absolute().parent / STORE_NAME)


def sqlite_uri(path: str | Path) -> str:
    return "sqlite:///" + str(Path(path).absolute())


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI; None for any other store."""
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def cause(e: BaseException) -> str:
    """The root cause of a failure in one line: ``OperationalError: attempt to write a readonly
    database``, not SQLAlchemy's first line ("raised as a result of Query-invoked autoflush...")."""
    while True:
        inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if inner is None:
            break
        e = inner
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else type(e).__name__}"


def warn_tracking_off(uri: str, reason: str) -> None:
    """The one line a failing store costs a run (printed by whichever process saw it first)."""
    print(
        f"warning: MLflow tracking off for this process ({uri}): {reason}; training goes on",
        file=sys.stderr,
        flush=True,
    )


def read_run_link(run_dir: str | Path) -> dict | None:
    """``{"tracking_uri", "run_id", "experiment_id"}`` of the run a run dir logs to, or None."""
    try:
        return read_json(RunDir(run_dir).mlflow_run)
    except (OSError, ValueError):
        return None


def _artifact_root(uri: str) -> str | None:
    """Artifacts of a sqlite store live beside it (MLflow's default is ./mlruns under the cwd)."""
    db = sqlite_path(uri)
    return None if db is None else (db.parent / "mlartifacts").absolute().as_uri()


def quiet_mlflow_logging() -> None:
    """A failing store call is reported by one warning or error line of ours; MLflow's own logged
    tracebacks (a full disk, a corrupt db) and table-creation chatter are kept out of stderr."""
    for name in ("mlflow", "alembic", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def open_store(uri: str):
    """(client, experiment_id) of the tpulab experiment in ``uri``; raises what MLflow raises."""
    from mlflow.tracking import MlflowClient

    quiet_mlflow_logging()  # after the import: importing mlflow sets its logger's level
    db = sqlite_path(uri)
    fresh = db is not None and not db.exists()
    if db is not None:
        if not db.parent.is_dir():
            raise OSError(f"directory {db.parent} does not exist")
        if fresh:
            fresh = not _from_template(db)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    if fresh:
        _save_template(db)
    exp_id = (
        exp.experiment_id
        if exp is not None
        else client.create_experiment(EXPERIMENT, artifact_location=_artifact_root(uri))
    )
    return client, exp_id


def require_writable(uri: str) -> None:
    """Open the store and write to it (one experiment tag, overwritten each time), so a store that
    can be read but not written (a read-only file, a full disk) is refused before step 0."""
    try:
        client, exp = open_store(uri)
    except Exception as e:  # noqa: BLE001 - sqlite, alembic, permissions: all mean "no store"
        raise TpulabError(f"cannot open the MLflow tracking store {uri}: {cause(e)}") from None
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        client.set_experiment_tag(exp, WRITE_CHECK_TAG, now)
    except Exception as e:  # noqa: BLE001
        raise TpulabError(f"cannot write to the MLflow tracking store {uri}: {cause(e)}") from None


def _template_path() -> Path:
    """An empty store with MLflow's tables, per MLflow version: creating them (dozens of alembic
    migrations) takes 1.5-10 s, copying the result takes milliseconds. Only the schema and the
    Default experiment."""
    import mlflow

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpulab"
    return base / f"mlflow-{mlflow.__version__}-empty.db"


def _copy_store(src_path: Path, dst_path: Path) -> None:
    """A consistent copy of a sqlite store (sqlite's online backup: safe while another process
    writes)."""
    import sqlite3

    src, dst = sqlite3.connect(src_path), sqlite3.connect(dst_path)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


def _from_template(db: Path) -> bool:
    import sqlite3

    try:
        template = _template_path()
        if not template.exists():
            return False
        tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
        _copy_store(template, tmp)
        try:
            os.link(tmp, db)  # never replaces a store another process created meanwhile
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return True
    except (OSError, sqlite3.Error):
        return False


def _save_template(db: Path) -> None:
    import sqlite3

    try:
        template = _template_path()
        template.parent.mkdir(parents=True, exist_ok=True)
        tmp = template.with_name(f".{template.name}.{os.getpid()}.tmp")
        _copy_store(db, tmp)
        os.replace(tmp, template)
    except (OSError, sqlite3.Error):
        pass  # only a speed-up


def log_files_to_run(
    run_dir: str | Path, paths: list[Path], artifact_path: str | None = None
) -> bool:
    """Attach files (a report, plots) to the MLflow run a run dir logged to, if it has one.
    False otherwise."""
    stored = read_run_link(run_dir)
    if not stored:
        return False
    try:
        client, _ = open_store(stored["tracking_uri"])
        for p in paths:
            if Path(p).is_file():
                client.log_artifact(stored["run_id"], str(p), artifact_path)
        return True
    except Exception as e:  # noqa: BLE001
        print(
            f"warning: could not attach {len(paths)} file(s) to MLflow run "
            f"{stored.get('run_id')}: {cause(e)}",
            file=sys.stderr,
        )
        return False


def list_runs(uri: str) -> list[dict]:
    """Rows for `tpulab runs`: name, status, steps, final losses, resumes, backend."""
    try:
        client, exp = open_store(uri)
        runs = client.search_runs([exp], max_results=1000, order_by=["attributes.start_time DESC"])
    except Exception as e:  # noqa: BLE001
        raise TpulabError(f"cannot read the MLflow tracking store {uri}: {cause(e)}") from None
    rows = []
    for r in runs:
        m, t = r.data.metrics, r.data.tags
        rows.append(
            {
                "run_id": r.info.run_id,
                "name": r.info.run_name,
                "status": r.info.status,
                "kind": t.get("tpulab.kind", "?"),
                "steps": t.get("tpulab.final_step"),
                "final_loss": m.get("final_loss", m.get("loss")),
                "final_val_loss": m.get("final_val_loss"),
                "resumes": int(t.get("tpulab.resume_count", "0")),
                "backend": t.get("tpulab.backend", "?"),
                "goodput": m.get("goodput"),
                "run_dir": t.get("tpulab.run_dir"),
            }
        )
    return rows
