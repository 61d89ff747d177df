"""MLflow lineage for a run dir: one MLflow run per run dir, continued across kills and resumes.

Why a separate process: importing mlflow (about 2 s of CPU, nearly all Python under the GIL) and opening
a sqlite store cost seconds; in a thread of the trainer that time competes with the training loop for
the GIL. Every call the loop makes only appends to an in-memory buffer; a writer thread hands batches
as JSON lines to a helper process (``tpulab.tracking.worker``, in the trainer's process group, so a
kill of the group ends it too) that makes the MLflow calls. A store that fails never costs a checkpoint.

Why metrics are sent only up to the newest committed checkpoint: after a kill the run resumes from that
checkpoint and redoes the steps after it, so steps not yet covered by a checkpoint are held back until
one is (or the run ends). MLflow's metric history therefore stays one curve. Two edge cases are handled
from metrics.jsonl at resume time: steps the killed process committed but had not sent yet are
backfilled; steps MLflow already holds beyond the resume point (a resume from an older checkpoint) are
logged again under ``redone/<key>``, so the redo is marked, never silently duplicated.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tpulab.checkpoint.files import atomic_write_json
from tpulab.errors import TpulabError
from tpulab.evidence import metrics as M
from tpulab.train.hooks import Hooks

RUN_FILE = "mlflow_run.json"  # in the run dir: which store and run this run dir logs to
EXPERIMENT = "tpulab"
STORE_NAME = "mlruns.db"
METRIC_KEYS = ("loss", "lr", "grad_norm")
ARTIFACTS = (
    "config.yaml",
    "env.json",
    "documents.json",
)  # + summary.json, from the summary the loop hands over


def default_uri(run_dir: str | Path, explicit: str | None = None) -> str:
    """--tracking-uri, else MLFLOW_TRACKING_URI, else a sqlite store ``mlruns.db`` next to the run dir."""
    if explicit:
        return explicit
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return sqlite_uri(Path(run_dir).absolute().parent / STORE_NAME)


def sqlite_uri(path: str | Path) -> str:
    return "sqlite:///" + str(Path(path).absolute())


def _artifact_root(uri: str) -> str | None:
    """Artifacts of a sqlite store live beside it (MLflow's default is ./mlruns under the cwd)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").absolute().as_uri()
    return None


def open_store(uri: str):
    """(client, experiment_id) of the tpulab experiment in ``uri``; raises whatever MLflow raises."""
    import logging

    # Table-creation chatter is not the user's news, and a failing store call is reported by the tracker's
    # own one-line warning, so MLflow's logged tracebacks (a full disk, a corrupt db) are kept out of stderr.
    for name in ("mlflow", "alembic", "sqlalchemy"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    from mlflow.tracking import MlflowClient

    db = Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None
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


def _template_path() -> Path:
    """An empty store with MLflow's tables, per MLflow version: creating them (dozens of alembic migrations)
    takes 1.5-10 s, copying the result takes milliseconds. Only the schema and the Default experiment."""
    import mlflow

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tpulab"
    return base / f"mlflow-{mlflow.__version__}-empty.db"


def _copy_store(src_path: Path, dst_path: Path) -> None:
    """A consistent copy of a sqlite store (sqlite's online backup, safe while another process writes)."""
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


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def lineage_tags(run_dir: Path, env: dict | None) -> dict[str, str]:
    """Corpus identity, split hashes, tokenizer, backend/device kind, versions, commit: what makes runs comparable."""
    tags: dict[str, str] = {}
    docs_path = run_dir / "documents.json"
    if docs_path.exists():
        docs = json.loads(docs_path.read_text())
        tags.update(
            {
                "tpulab.corpus.source": str(docs.get("source")),
                "tpulab.corpus.identity": str(docs.get("identity")),
                "tpulab.split.train_sha256": _sha(docs.get("train_documents")),
                "tpulab.split.validation_sha256": _sha(docs.get("validation_documents")),
                "tpulab.split.train_documents": str(len(docs.get("train_documents", []))),
                "tpulab.split.validation_documents": str(len(docs.get("validation_documents", []))),
            }
        )
    try:
        from tpulab.data.tokenizer import DEFINITION

        tags["tpulab.tokenizer"] = json.dumps(DEFINITION, sort_keys=True)
    except ImportError:  # pragma: no cover - the data package is part of tpulab
        pass
    if env:
        for k in ("backend", "device_kind", "device_count", "process_count", "python", "platform"):
            if env.get(k) is not None:
                tags[f"tpulab.{k}"] = str(env[k])
        for name, ver in (env.get("packages") or {}).items():
            if ver:
                tags[f"tpulab.version.{name}"] = str(ver)
        if env.get("git_commit"):
            tags["tpulab.git_commit"] = env["git_commit"]
            tags["mlflow.source.git.commit"] = env["git_commit"].removesuffix("-dirty")
    tags["tpulab.run_dir"] = str(run_dir.absolute())
    return tags


class MlflowTracker(Hooks):
    """Logs one run dir to one MLflow run. Failures warn once and switch tracking off; training goes on.

    One class, two roles: in the trainer it buffers, decides what may be sent and feeds the helper
    process; in the helper (``tpulab.tracking.worker``) the same class executes the jobs (``execute``)."""

    def __init__(
        self,
        run_dir: str | Path,
        uri: str | None = None,
        *,
        kind: str = "transformer",
        extra_tags: dict | None = None,
        params: dict | None = None,
        join_timeout_s: float = 120.0,
    ):
        self.run_dir = Path(run_dir)
        self.uri = default_uri(self.run_dir, uri)
        self.kind = kind
        self.extra_tags = dict(extra_tags or {})
        self.params = params
        self.join_timeout_s = join_timeout_s
        self.run_id: str | None = None
        self.failed: str | None = None
        self._client = None
        self._lock = threading.Lock()
        self._buffer: list[tuple[str, float, int, int]] = []  # (key, value, step, timestamp ms)
        self._committed = 0  # steps up to here may be sent
        self._logged_max = 0  # highest step MLflow held when this process started
        self._jobs: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._child: subprocess.Popen | None = None
        self._ended = False
        self._enabled = True

    # ---- store access -------------------------------------------------------------------------
    def check(self) -> None:
        """Open the store now (for --require-tracking); TpulabError when it cannot be opened."""
        try:
            self._client, self._exp = open_store(self.uri)
        except Exception as e:  # noqa: BLE001 - sqlite, alembic, permissions: all mean "no store"
            raise TpulabError(
                f"cannot open the MLflow tracking store {self.uri}: {_short(e)}"
            ) from None

    def _fail(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = _short(e)
            print(
                f"warning: MLflow tracking off for this process ({self.uri}): {self.failed}; training goes on",
                file=sys.stderr,
                flush=True,
            )
        self._enabled = False

    def _run(self) -> None:
        """Writer thread: jobs become JSON lines on the helper's stdin until None (close() then ends input)."""
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if not self._enabled:
                continue
            try:
                self._child.stdin.write(json.dumps(job, default=str) + "\n")
                self._child.stdin.flush()
            except (OSError, ValueError) as e:  # the helper died: BrokenPipeError
                self._fail(e)

    def _submit(self, op: str, *args) -> None:
        if self._enabled and self._worker is not None:
            self._jobs.put([op, *args])

    def execute(self, op: str, args: list) -> None:
        """In the helper process: run one job the trainer's tracker sent."""
        if op not in ("_open_run", "_send", "_finish", "_terminate"):
            raise ValueError(f"unknown tracking job {op!r}")
        getattr(self, op)(*args)

    # ---- hooks --------------------------------------------------------------------------------
    def on_start(self, info: dict) -> None:
        env = info.get("env") or {}
        if int(info.get("process_index", env.get("process_index", 0)) or 0) != 0:
            self._enabled = False  # several processes: only process 0 logs
            return
        from tpulab.config import to_dict

        config = info.get("config")
        params = (
            self.params
            if self.params is not None
            else (to_dict(config) if config is not None else {})
        )
        self.begin(
            params=params,
            env=env,
            resumed_from=info.get("resumed_from"),
            digest=info.get("checkpoint_digest"),
        )

    def begin(
        self,
        *,
        params: dict,
        env: dict | None = None,
        resumed_from: int | None = None,
        digest: str | None = None,
    ) -> None:
        """Start the worker and queue: open store, find or create the run, tags, params, resume record."""
        if self._worker is not None or not self._enabled:
            return
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "tpulab.tracking.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        except OSError as e:
            self._fail(e)
            return
        self._jobs.put(
            {
                "run_dir": str(self.run_dir),
                "uri": self.uri,
                "kind": self.kind,
                "extra_tags": self.extra_tags,
            }
        )
        self._worker = threading.Thread(target=self._run, name="mlflow-tracker", daemon=True)
        self._worker.start()
        self._committed = resumed_from or 0
        self._submit("_open_run", params, env, resumed_from, digest)

    def _open_run(
        self, params: dict, env: dict | None, resumed_from: int | None, digest: str | None
    ) -> None:
        from mlflow.entities import Param, RunTag

        if self._client is None:
            self._client, self._exp = open_store(self.uri)
        c = self._client
        stored = _read_json(self.run_dir / RUN_FILE)
        run = None
        if stored and stored.get("tracking_uri") == self.uri:
            try:
                run = c.get_run(stored["run_id"])
            except Exception:  # noqa: BLE001 - the store no longer holds it: start a new one
                run = None
        new = run is None
        if new:
            run = c.create_run(
                self._exp, run_name=self.run_dir.name, tags={"tpulab.kind": self.kind}
            )
            atomic_write_json(
                self.run_dir / RUN_FILE,
                {"tracking_uri": self.uri, "run_id": run.info.run_id, "experiment_id": self._exp},
            )
        elif run.info.status != "RUNNING":
            c.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        tags = {
            **lineage_tags(self.run_dir, env),
            **{k: str(v) for k, v in self.extra_tags.items()},
        }
        have = (
            {} if new else run.data.params
        )  # a killed first process may have died before its params
        items = [Param(k, v[:6000]) for k, v in flatten(params).items() if k not in have]
        if items:
            for i in range(0, len(items), 100):
                c.log_batch(self.run_id, params=items[i : i + 100])
        if (
            resumed_from is not None
        ):  # also when an earlier process died before it could create the run
            existing = (
                {m.step for m in c.get_metric_history(self.run_id, "loss")} if not new else set()
            )
            self._logged_max = max(existing, default=0)
            n = int(run.data.tags.get("tpulab.resume_count", "0")) + 1
            redone = max(0, self._logged_max - resumed_from)
            tags["tpulab.resume_count"] = str(n)
            tags[f"tpulab.resume.{n}"] = json.dumps(
                {
                    "from_checkpoint_step": resumed_from,
                    "checkpoint_manifest_digest": digest,
                    "steps_already_logged": self._logged_max,
                    "steps_redone_marked": redone,
                    "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                }
            )
            self._backfill(resumed_from)
        items = [RunTag(k, v[:5000]) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            c.log_batch(self.run_id, tags=items[i : i + 100])

    def _backfill(self, upto: int) -> None:
        """Steps an earlier (killed) process committed but had not sent yet, read from metrics.jsonl."""
        if upto <= self._logged_max:
            return
        recs = M.read_records(self.run_dir)
        now = _now_ms()
        rows = []
        for key in METRIC_KEYS:
            for step, value in sorted(M.curve(recs, key).items()):
                if self._logged_max < step <= upto:
                    rows.append((key, float(value), step, now))
        for r in recs:
            if r.get("event") == "eval" and self._logged_max < r.get("step", 0) <= upto:
                rows.append(("val_loss", float(r["val_loss"]), r["step"], now))
        self._send(rows)
        self._logged_max = max(self._logged_max, upto) if rows else self._logged_max

    def _send(self, rows: list[tuple[str, float, int, int]]) -> None:
        """Batched: at most 1000 metrics per call. Steps MLflow already held go to redone/<key>."""
        from mlflow.entities import Metric

        if not rows or self.run_id is None:
            return
        metrics = [
            Metric(("redone/" + k) if s <= self._logged_max else k, v, ts, s)
            for k, v, s, ts in rows
        ]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def on_metrics(self, step: int, record: dict) -> None:
        if not self._enabled:
            return
        if (
            self._worker is None and self.params is not None
        ):  # a trainer without on_start (the bridge)
            self.begin(params=self.params, resumed_from=step - 1 if step > 1 else None)
        ts = _now_ms()
        with self._lock:
            self._buffer.extend((k, float(record[k]), step, ts) for k in METRIC_KEYS if k in record)
            for k, v in record.items():  # other numbers a trainer reports (the bridge: step_time_s)
                if k not in (*METRIC_KEYS, "wall_s", "tokens") and isinstance(v, (int, float)):
                    self._buffer.append((k, float(v), step, ts))

    def on_eval(self, step: int, metrics: dict) -> None:
        if self._enabled:
            with self._lock:
                for name, value in metrics.items():
                    self._buffer.append((name, float(value), step, _now_ms()))

    def on_checkpoint(self, step: int) -> None:
        """Called from the loop or the checkpoint thread: everything up to ``step`` may now be sent."""
        if not self._enabled:
            return
        with self._lock:
            self._committed = max(self._committed, step)
            ready = [r for r in self._buffer if r[2] <= self._committed]
            self._buffer = [r for r in self._buffer if r[2] > self._committed]
        self._submit("_send", ready)

    def flush_all(self) -> None:
        """The run ended normally: nothing will be redone, send everything."""
        with self._lock:
            ready, self._buffer = self._buffer, []
        self._submit("_send", ready)

    def on_end(self, summary: dict) -> None:
        if not self._enabled:
            return
        self.flush_all()
        self._submit("_finish", summary)
        self.close()

    def _finish(self, summary: dict) -> None:
        from mlflow.entities import Metric, RunTag

        c, rid = self._client, self.run_id
        if rid is None:
            return
        try:
            from tpulab.evidence.goodput import goodput

            g = goodput(self.run_dir)
        except Exception:  # noqa: BLE001 - goodput is a bonus here, never a reason to lose the run's end
            g = None
        step = int(summary.get("final_step") or 0)
        now = _now_ms()
        metrics = [
            Metric(k, float(summary[k]), now, step)
            for k in ("final_loss", "final_val_loss")
            if isinstance(summary.get(k), (int, float)) and math.isfinite(summary[k])
        ]  # NaN: no step ran
        if g is not None and g["total_s"] > 0:  # trainers whose records carry wall_s
            metrics.append(Metric("goodput", g["goodput"], now, step))
        tags = [
            RunTag("tpulab.final_step", str(step)),
            RunTag("tpulab.preempted", str(bool(summary.get("preempted")))),
        ]
        c.log_batch(rid, metrics=metrics, tags=tags)
        self.log_artifacts(
            [self.run_dir / n for n in ARTIFACTS] + [_latest_manifest(self.run_dir, summary)]
        )
        c.log_dict(
            rid, summary, "summary.json"
        )  # the loop writes its file only after on_end returns
        if g is not None and g["total_s"] > 0:
            c.log_dict(rid, g, "goodput.json")
        c.set_terminated(rid, "KILLED" if summary.get("preempted") else "FINISHED")

    def log_artifacts(self, paths: list[Path | None], artifact_path: str | None = None) -> None:
        for p in paths:
            if p is not None and Path(p).is_file():
                self._client.log_artifact(self.run_id, str(p), artifact_path)

    def _terminate(self, status: str) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, status)

    def close(self, status: str | None = None) -> None:
        """Drain and wait for the helper (bounded). ``status`` (e.g. FAILED) marks a run that ended by an error."""
        if self._worker is None or self._ended:
            return
        self._ended = True
        if status is not None and self._enabled:
            with self._lock:
                ready = [r for r in self._buffer if r[2] <= self._committed]
                self._buffer = []
            self._submit("_send", ready)
            self._submit("_terminate", status)
        self._jobs.put(None)
        self._worker.join(self.join_timeout_s)
        try:
            out, _ = self._child.communicate(
                timeout=self.join_timeout_s
            )  # closes stdin: end of jobs
            status_line = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
            self.run_id = status_line.get("run_id") or self.run_id
            self.failed = self.failed or status_line.get("failed")
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()
            print(
                f"warning: MLflow tracking did not finish within {self.join_timeout_s:.0f} s; "
                "some metrics may be missing from the store",
                file=sys.stderr,
                flush=True,
            )
        except (ValueError, OSError):
            pass


def _latest_manifest(run_dir: Path, summary: dict) -> Path | None:
    step = summary.get("latest_checkpoint")
    return None if step is None else run_dir / "checkpoints" / str(step) / "tpulab_manifest.json"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {text[:200]}"


def log_files_to_run(
    run_dir: str | Path, paths: list[Path], artifact_path: str | None = None
) -> bool:
    """Attach files (a report, plots) to the MLflow run a run dir logged to, if it has one. False otherwise."""
    stored = _read_json(Path(run_dir) / RUN_FILE)
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
            f"warning: could not attach {len(paths)} file(s) to MLflow run {stored.get('run_id')}: {_short(e)}",
            file=sys.stderr,
        )
        return False


def list_runs(uri: str) -> list[dict]:
    """Rows for `tpulab runs`: name, status, steps, final losses, resumes, backend."""
    try:
        client, exp = open_store(uri)
        runs = client.search_runs([exp], max_results=1000, order_by=["attributes.start_time DESC"])
    except Exception as e:  # noqa: BLE001
        raise TpulabError(f"cannot read the MLflow tracking store {uri}: {_short(e)}") from None
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
