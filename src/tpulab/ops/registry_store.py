"""The registry's store and its locking: the sqlite MLflow store, opened and probed, one change at
a time, and the one reader of its models and versions.

A store sqlite cannot write within ``LOCK_WAIT_S`` is refused up front (MLflow itself waits 20 s
on a locked sqlite store, then prints a traceback: measured with mlflow-skinny 3.17.2). Changes
are committed under ``registry_ledger.lock`` (flock) beside the store; readers take it shared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import re
import sqlite3
import time
import urllib.parse
from pathlib import Path

from tpulab.errors import TpulabError
from tpulab.ops import ledger
from tpulab.ops import tags as T
from tpulab.tracking.store import cause

LOCK_WAIT_S = 5.0
LOCK_NAME = "registry_ledger.lock"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclasses.dataclass
class Registry:
    uri: str
    db: Path
    client: object  # mlflow.tracking.MlflowClient
    experiment_id: str

    @property
    def ledger_path(self) -> Path:
        return self.db.parent / ledger.LEDGER_NAME


def check_name(name: str, what: str = "model name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TpulabError(
            f"{what} {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit"
        )
    return name


def check_alias(alias: str) -> str:
    check_name(alias, "alias")
    if re.fullmatch(r"[vV]\d+|latest", alias):
        raise TpulabError(f"alias {alias!r} is reserved by MLflow (v<number>, latest)")
    return alias


def store_errors():
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    return (MlflowException, SQLAlchemyError, sqlite3.Error, OSError)


@contextlib.contextmanager
def store_call(reg_or_db, what: str):
    """MLflow, SQLAlchemy, sqlite and OS errors of one store call as one line naming the store."""
    db = reg_or_db.db if isinstance(reg_or_db, Registry) else reg_or_db
    try:
        yield
    except TpulabError:
        raise
    except store_errors() as e:
        raise TpulabError(f"registry store {db}: {what} failed ({cause(e)})") from None


def _probe(db: Path, wait_s: float) -> None:
    """Refuse a file that is not a sqlite database, or that another process holds a write lock on,
    before MLflow touches it."""
    url = "file:" + urllib.parse.quote(str(db.absolute())) + "?mode=rw"
    try:
        con = sqlite3.connect(url, uri=True, timeout=wait_s, isolation_level=None)
    except sqlite3.Error as e:
        raise TpulabError(f"registry store {db} cannot be opened ({cause(e)})") from None
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        con.execute("BEGIN IMMEDIATE")
        con.execute("ROLLBACK")
    except sqlite3.OperationalError as e:
        if "locked" in str(e) or "busy" in str(e):
            raise TpulabError(
                f"registry store {db} is locked by another process (no write within {wait_s:g} s); "
                "nothing was changed"
            ) from None
        raise TpulabError(f"registry store {db} is unusable ({cause(e)})") from None
    except sqlite3.DatabaseError as e:
        raise TpulabError(
            f"registry store {db} is not a readable sqlite database ({cause(e)}); "
            "nothing was changed"
        ) from None
    finally:
        con.close()


def store_uri(explicit: str | None, run_dir: str | Path | None = None) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI, else the trainer's store: ``mlruns.db`` beside
    ``run_dir`` (register), or in the current directory (the other commands, as ``tpulab runs``)."""
    from tpulab.tracking.store import default_uri

    return default_uri(Path(run_dir) if run_dir else Path.cwd() / "x", explicit)


def open_registry(uri: str, *, create: bool = False, wait_s: float = LOCK_WAIT_S) -> Registry:
    """The registry in the sqlite store ``uri`` (created only when ``create``), probed first."""
    if not uri.startswith("sqlite:///"):
        raise TpulabError(
            f"the registry needs a sqlite MLflow store (its ledger lives beside it), not {uri}"
        )
    db = Path(uri[len("sqlite:///") :])
    if not db.exists():
        if not create:
            raise TpulabError(
                f"no registry store at {db} (pass --tracking-uri sqlite:///PATH/mlruns.db or set "
                "MLFLOW_TRACKING_URI)"
            )
        if not db.parent.is_dir():
            raise TpulabError(f"cannot create the registry store {db}: no directory {db.parent}")
    else:
        _probe(db, wait_s)
    from tpulab.tracking.store import open_store

    with store_call(db, "opening"):
        client, exp = open_store(uri)
    return Registry(uri, db, client, exp)


@contextlib.contextmanager
def locked(reg: Registry, wait_s: float = LOCK_WAIT_S, *, shared: bool = False):
    """One registry change at a time per store (flock on a file beside it); ``shared`` for readers,
    so they never see a change half made. Held only while state is read again and committed, not
    while artifacts are verified (seconds): a reader waits well under a second."""
    path = reg.db.parent / LOCK_NAME
    if shared and not path.exists():  # no change was ever made here (a writer creates it first)
        yield
        return
    try:
        f = open(path, "r" if shared else "a")
    except OSError as e:
        raise TpulabError(f"cannot open the registry lock {path} ({e.strerror})") from None
    with f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TpulabError(
                        f"registry store {reg.db} is locked by another tpulab registry command "
                        f"(waited {wait_s:g} s for {path}); nothing was changed"
                    ) from None
                time.sleep(0.05)
        yield


# ---- reading the store ------------------------------------------------------------------------
def not_found(e) -> bool:
    return getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def registered_model(reg: Registry, name: str):
    from mlflow.exceptions import MlflowException

    with store_call(reg, f"reading model {name}"):
        try:
            return reg.client.get_registered_model(name)
        except MlflowException as e:
            if not not_found(e):
                raise
    return None


def model_version(reg: Registry, name: str, version, *, required: bool = True):
    from mlflow.exceptions import MlflowException

    with store_call(reg, f"reading {name} v{version}"):
        try:
            return reg.client.get_model_version(name, str(version))
        except MlflowException as e:
            if not not_found(e):
                raise
    if required:
        raise TpulabError(f"model {name} has no version {version} in {reg.db}")
    return None


def read_version(reg: Registry, name: str, *, version=None, alias: str | None = None):
    """The model version ``version`` of ``name``, or the one ``alias`` names: the one reader of a
    single version (commands and the service). Absent: one line naming the store."""
    from mlflow.exceptions import MlflowException

    if alias is None:
        return model_version(reg, name, version)
    with store_call(reg, f"reading {name}@{alias}"):
        try:
            return reg.client.get_model_version_by_alias(name, alias)
        except MlflowException as e:
            # An unknown alias is INVALID_PARAMETER_VALUE, an unknown model RESOURCE_DOES_NOT_EXIST
            # (mlflow-skinny 3.17.2); anything else is the store failing.
            if not_found(e):
                raise TpulabError(f"no model {name} in {reg.db}") from None
            if getattr(e, "error_code", None) != "INVALID_PARAMETER_VALUE":
                raise
    raise TpulabError(f"model {name} has no alias {alias} in {reg.db}")


def aliases_of(model) -> dict[str, str]:
    return {a: str(v) for a, v in (model.aliases or {}).items()} if model is not None else {}


def is_retired(mv) -> bool:
    return mv.tags.get(T.RETIRED) == "true"
