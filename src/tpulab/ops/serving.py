"""Serving from the model registry: resolve ``models:/NAME@ALIAS``, refuse what may not be served,
verify the artifacts against the tags, follow the alias while serving, and point the drift
statistic at the training corpus.

Before anything listens (one ``error:`` line otherwise): the model URI parses, the store exists
(opening never creates one) and can be read, the alias names a version, and that version is not
retired and carries the tags a served version needs (its ``source`` equal to its ``ARTIFACTS``
tag). After the server listens, in the background, the loader checks the artifacts on disk as
the registry's own commands do (``load_recorded``: every file rehashed, the verification record
``register`` left) and compares their digests with the ``EXPORT_MANIFEST`` and ``CHECKPOINT`` tags:
tags are claims, the files are the evidence. A mismatch ends the service at once (nothing to wait
for: ``serve_http.run_server``).

A request's ``prompt_version`` is resolved against the prompt registry of the same store
(``prompts.PromptResolver``; with ``--artifacts``, the store ``--tracking-uri`` names, else none:
the label is then traced as given, with ``prompt_resolved: false``).

A rollback is picked up by a hot swap, not a restart: ``AliasWatcher`` reads the alias every
``poll_interval_s``; when it names another version, that version goes through the same checks and
is compiled and run once beside the one serving (which keeps answering), then ``Service.swap``
installs it between two batches. A request is answered by the version serving when its batch is
taken, and its response and trace say which. A version that fails the checks is refused (the old
one keeps serving, /v1/model says why) and retried only when the alias moves again.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
import traceback
from pathlib import Path

from tpulab.checkpoint.rundir import RunDir, read_json
from tpulab.data.drift import byte_histogram
from tpulab.errors import ExitCode, TpulabError
from tpulab.inference.config import ServeConfig
from tpulab.inference.serve import Service, artifacts_loader
from tpulab.inference.serve_batcher import Model
from tpulab.inference.serve_http import run_server
from tpulab.inference.serve_stop import StopSignals, exit_now
from tpulab.inference.serve_telemetry import TraceLog
from tpulab.inference.trust import load_recorded, read_key
from tpulab.ops import prompts as P
from tpulab.ops import registry_store as R
from tpulab.ops import tags as T

_MODEL_URI = re.compile(
    r"models:/(?P<name>[A-Za-z0-9][A-Za-z0-9._ -]{0,255})"
    r"(?:@(?P<alias>[A-Za-z][A-Za-z0-9_-]{0,254})|/(?P<version>[1-9][0-9]{0,9}))"
)


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """``models:/NAME@ALIAS`` (followed while serving) or ``models:/NAME/VERSION`` (pinned)."""

    name: str
    alias: str | None = None
    version: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        m = _MODEL_URI.fullmatch(text)
        if m is None:
            raise TpulabError(
                f"--model {text[:80]!r} is not models:/NAME@ALIAS or models:/NAME/VERSION"
            )
        return cls(m["name"], m["alias"], m["version"])

    def __str__(self) -> str:
        return (
            f"models:/{self.name}@{self.alias}"
            if self.alias
            else f"models:/{self.name}/{self.version}"
        )


@dataclasses.dataclass(frozen=True)
class Registered:
    """One model version as the registry describes it: claims, until the files are checked."""

    name: str
    version: str
    alias: str | None
    source: str
    tags: dict
    tracking_uri: str

    def describe(self) -> dict:
        t = self.tags
        return {
            "name": self.name,
            "version": self.version,
            "alias": self.alias,
            "tracking_uri": self.tracking_uri,
            "source": self.source,
            "export_manifest_sha256": t.get(T.EXPORT_MANIFEST),
            "checkpoint_digest": t.get(T.CHECKPOINT),
            "corpus": t.get(T.CORPUS),
            "run_id": t.get(T.RUN_ID),
            "resume_verdict": t.get(T.RESUME_VERDICT),
            "eval": {
                k[len(T.EVAL_PREFIX) :]: v for k, v in t.items() if k.startswith(T.EVAL_PREFIX)
            },
        }

    def __str__(self) -> str:
        return f"{self.name} version {self.version}" + (f" (@{self.alias})" if self.alias else "")


def _first_line(e: BaseException) -> str:
    text = str(getattr(e, "message", None) or e).strip()
    return (text.splitlines() or [type(e).__name__])[0][:200]


def resolve(registry: R.Registry, ref: ModelRef) -> Registered:
    """What the registry says ``ref`` is now (``registry_store.read_version``: one reader for the
    commands and the service)."""
    mv = R.read_version(registry, ref.name, version=ref.version, alias=ref.alias)
    return Registered(
        ref.name, str(mv.version), ref.alias, mv.source or "", dict(mv.tags), registry.uri
    )


def check_servable(reg: Registered) -> None:
    """What the registry itself says against serving ``reg`` (before any file is read)."""
    if reg.tags.get(T.RETIRED) == "true":
        raise TpulabError(f"{reg} is retired; it is not served")
    missing = [t for t in (T.ARTIFACTS, T.EXPORT_MANIFEST, T.CHECKPOINT) if not reg.tags.get(t)]
    if missing:
        raise TpulabError(
            f"{reg} has no tag {', '.join(missing)} (register it with tpulab registry register)"
        )
    if reg.tags[T.ARTIFACTS] != reg.source or not Path(reg.source).is_absolute():
        raise TpulabError(
            f"{reg}: source {reg.source!r} is not the absolute path its tag {T.ARTIFACTS} names "
            f"({reg.tags[T.ARTIFACTS]!r})"
        )


def load_registered(reg: Registered, run_dir=None, key: bytes | None = None) -> Model:
    """``reg``'s artifacts verified on disk (``load_recorded``), their digests equal to its tags."""
    check_servable(reg)
    art = load_recorded(reg.source, run_dir, key)
    on_disk = {
        T.EXPORT_MANIFEST: art.manifest_sha256,
        T.CHECKPOINT: art.manifest["source"]["checkpoint_manifest_sha256"],
    }
    for tag, value in on_disk.items():
        if reg.tags[tag] != value:
            raise TpulabError(
                f"{reg}: tag {tag}={reg.tags[tag][:16]} but the verified artifacts in {reg.source} "
                f"have {value[:16]}: the tag is not trusted, the version is not served"
            )
    return Model.of(art, {**reg.describe(), "tags_checked": sorted(on_disk)})


def with_reference(model: Model, run_dir=None, fixed: tuple | None = None) -> Model:
    """``model`` with its drift reference: ``fixed`` (--drift-reference) or the training documents
    of ``run_dir`` (default: the run dir its export manifest names)."""
    reference, source = fixed or training_reference(
        run_dir or model.art.manifest["source"]["run_dir"]
    )
    return dataclasses.replace(model, reference=reference, reference_source=source)


def training_reference(run_dir) -> tuple:
    """(byte counts of the training documents ``run_dir`` trained on, where they came from); with
    (None, why) when they cannot be rebuilt exactly (documents.json's sha256 per document)."""
    from tpulab.config import load
    from tpulab.data.corpus import load_corpus
    from tpulab.train.config import RunConfig

    run = RunDir(run_dir)
    try:
        recorded = read_json(run.documents)
        cfg = load(RunConfig, run.config)
        corpus = load_corpus(cfg.data.path)
        # Imported here: the pipeline needs grain, which the serving image leaves out (and the image
        # holds no run dir, so it never gets this far).
        from tpulab.data.pipeline import split_documents

        train, _ = split_documents(corpus, cfg.data)
    except (OSError, ValueError, ImportError, TpulabError) as e:
        return None, f"none: the training corpus of {run} cannot be rebuilt ({_first_line(e)})"
    want = [(d["name"], d["sha256"]) for d in recorded.get("train_documents", [])]
    if [(d.name, d.sha256) for d in train] != want:
        return None, f"none: the corpus differs from the documents {run} trained on"
    counts = sum(byte_histogram(d.data) for d in train)
    return counts, f"{len(train)} training documents of {corpus.source} (run {run})"


def text_reference(path) -> tuple:
    """(byte counts, description) of every document of a text file or directory of *.txt."""
    from tpulab.data.corpus import load_corpus

    corpus = load_corpus(str(path))
    counts = sum(byte_histogram(d.data) for d in corpus.documents)
    return counts, f"{len(corpus.documents)} documents of {path} (--drift-reference)"


class AliasWatcher:
    """Follows ``ref``'s alias: ``poll`` once (tests call it), or every ``interval_s`` in a thread
    that starts when the service is ready."""

    def __init__(
        self,
        service: Service,
        registry: R.Registry,
        serving: Registered,
        interval_s: float,
        load,
        *,
        clock=time.monotonic,
    ):
        self.service, self.registry, self.serving = service, registry, serving
        self.interval_s, self.load, self.clock = interval_s, load, clock
        self.refused: tuple | None = None  # (version, source, why) of the last refusal
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="alias-watcher", daemon=True)
        service.on_close.append(self.stop)
        self.status = {
            "alias": serving.alias,
            "poll_interval_s": interval_s,
            "polls": 0,
            "last_poll": None,
            "last_error": None,
            "refused": None,
        }
        service.notes["watch"] = self.status

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.service.ready.is_set() and not self.service.draining:
                self.poll()

    def poll(self) -> str:
        """Read the alias; swap to the version it names if that one passes every check."""
        self.status["polls"] += 1
        self.status["last_poll"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        ref = ModelRef(self.serving.name, self.serving.alias)
        try:
            reg = resolve(self.registry, ref)
        except TpulabError as e:
            if self.status["last_error"] != str(e):
                print(f"warning: {e}; still serving {self.serving}", flush=True)
            self.status["last_error"] = str(e)
            return f"unreadable: {e}"
        self.status["last_error"] = None
        if reg.version == self.serving.version:
            self.refused = None
            self.status["serving_retired"] = reg.tags.get(T.RETIRED) == "true"
            return "unchanged"
        if self.refused is not None and self.refused[:2] == (reg.version, reg.source):
            return f"refused: {self.refused[2]}"  # tried again once the alias moves elsewhere
        t0 = self.clock()
        try:
            model = self.service.prepare(self.load(reg))
        except Exception as e:
            why = str(e) if isinstance(e, TpulabError) else f"{type(e).__name__}: {e}"
            self.refused = (reg.version, reg.source, why)
            self.status["refused"] = {"version": reg.version, "why": why}
            print(f"error: not swapping to {reg}: {why}; still serving {self.serving}", flush=True)
            return f"refused: {why}"
        record = self.service.swap(model, why=f"alias {reg.alias} moved to version {reg.version}")
        record["verify_and_compile_s"] = round(self.clock() - t0, 3)
        print(
            f"swapped to {reg} (manifest {model.art.manifest_sha256[:12]}) after "
            f"{record['verify_and_compile_s']:.1f} s of verification and compiles",
            flush=True,
        )
        self.serving, self.refused = reg, None
        self.status["refused"] = None
        return f"swapped to {reg.version}"


def serve(
    *,
    artifacts=None,
    model_uri: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    cfg: ServeConfig | None = None,
    run_dir=None,
    key_file=None,
    tracking_uri: str | None = None,
    poll_interval_s: float = 10.0,
    trace_log="serve_traces.jsonl",
    drift_reference=None,
    compile_cache_dir=None,
    stop: StopSignals | None = None,
) -> None:
    """``tpulab serve``: check what was asked for, then listen (``run_server``) while the model is
    verified, compiled and probed in the background; follow an alias while serving.

    ``compile_cache_dir``: the persistent compilation cache (default ``compile_cache.default_dir``),
    so a restart of the same artifacts on the same host compiles nothing. ``stop``: the CLI's
    signal latch, installed before the imports. Once the server has run, the process leaves by
    ``serve_stop.exit_now`` (the service closed, stdout flushed): the interpreter's own exit took
    2.8 s more here and aborts when a thread is inside XLA."""
    from tpulab import compile_cache
    from tpulab.tracking.store import default_uri

    if (artifacts is None) == (model_uri is None):
        raise TpulabError("serve needs exactly one of --artifacts and --model")
    if not 0.1 <= poll_interval_s <= 3600:
        raise TpulabError(f"poll_interval={poll_interval_s} must be in [0.1, 3600] seconds")
    key = read_key(key_file)
    fixed = text_reference(drift_reference) if drift_reference is not None else None
    follow, registry = None, None
    if model_uri is not None:
        ref = ModelRef.parse(model_uri)
        registry = R.open_registry(default_uri(Path(run_dir or Path.cwd() / "x"), tracking_uri))
        reg = resolve(registry, ref)
        check_servable(reg)

        def load(r: Registered) -> Model:
            return with_reference(load_registered(r, run_dir, key), run_dir, fixed)

        loader, describe = (lambda: load(reg)), f"{ref} ({reg})"
        follow = (reg, load) if ref.alias is not None else None
    else:
        if not (Path(artifacts) / "manifest.json").is_file():
            raise TpulabError(f"artifacts {artifacts}: no manifest.json (run: tpulab export)")
        if tracking_uri is not None:  # the prompt registry to resolve prompt_version against
            registry = R.open_registry(tracking_uri)
        plain = artifacts_loader(artifacts, run_dir, key)
        loader, describe = (
            (lambda: with_reference(plain(), run_dir, fixed)),
            f"artifacts {artifacts}",
        )
    try:
        cache_dir = compile_cache.enable(compile_cache_dir)
    except OSError as e:
        raise TpulabError(f"compile cache {compile_cache_dir}: {e.strerror or e}") from None
    service = Service(
        loader,
        cfg or ServeConfig(),
        describe=describe,
        trace_log=TraceLog(trace_log),
        prompts=P.PromptResolver(registry, poll_interval_s) if registry is not None else None,
        cache_dir=cache_dir,
    )
    if follow is not None:
        reg, load = follow
        watcher = AliasWatcher(service, registry, reg, poll_interval_s, load)
        service.on_ready.append(watcher.start)
    try:
        run_server(service, host, port, stop)
    except TpulabError as e:
        exit_now(e.exit_code, str(e))
    except BaseException:  # a bug: its traceback, then out (an interpreter exit hung here once)
        traceback.print_exc()
        exit_now(ExitCode.FAILED)
    exit_now(ExitCode.OK)
