"""HTTP generation service over verified exported endpoints (FastAPI + uvicorn): readiness, request
batching, model swaps, Prometheus metrics, request ids and a trace per request.

Lifecycle. ``run_server`` listens at once, so ``/livez`` is 200 from the first moment. In the
background the service calls its loader (``trust.load_recorded``: rehashes every file,
deserializes and shape-checks every artifact, requires a passing verification record and, given a
run dir, re-verifies the set against its checkpoint; ``tpulab.ops.serving`` adds the registry's
checks), compiles the loop for every cache policy and batch bucket (each compile a real greedy
generation), and sends one request through the batcher, whose tokens must equal the direct call's.
Only then is ``/readyz`` (and ``/healthz``, its older name) 200. A failure at any stage is
permanent (nothing retries it): ``run_server`` stops on its next tick and exits 1 with the reason,
at once rather than at the deadline. Still verifying or compiling is the only wait: a server not
ready ``ready_timeout_s`` after it started exits 1 with the stage it was in.

Stopping. SIGTERM (or SIGINT) closes the listener and drains: requests in flight finish, bounded
by ``drain_timeout_s`` (past it, what is still waiting for its body or its batch is answered 503),
then the process exits 0. uvicorn itself re-raises the signal after its graceful shutdown, which
made a drained stop exit 143; ``_Server`` keeps the signal. Every wait of a handler (the body, the
batch) is an ``asyncio.timeout`` the drain reschedules, so uvicorn's own bound (which cancels tasks
and logs a traceback for each) is only a backstop. A client that disconnects before its body has
arrived is counted and traced (status 499), with no traceback.

Requests: the body is read under ``body_timeout_s`` (a client trickling bytes is answered 408),
parsed here (UTF-8, JSON without NaN/Infinity/overflowing numbers), typed by a pydantic contract and
validated by ``sampling`` (the bounds the CLI uses too); every refusal is a 4xx with a reason. Valid
requests join a bounded queue (full: 503 with Retry-After). One batcher thread takes every waiting
request of the oldest one's cache policy (up to ``max_batch``; requests that arrived while the
previous batch ran are all there), optionally waiting ``batch_window_ms`` for more (default 0:
measured on CPU, a 5 ms window cost more than it gathered), and runs them as one dispatch of the
compiled loop, each row with its own prompt length, max_new, temperature, top_k and seed; a row's
tokens do not depend on its batch-mates. A request not answered within ``request_timeout_s`` gets
504 (a queued one is dropped; a running batch cannot be interrupted, its result is discarded).

Swaps: ``Service.swap`` replaces the model between batches; a batch already taken finishes on the
model it was taken with, and every response and trace names the model that produced it.

Every response carries ``X-Request-ID`` (the client's, when it sent a sane one) and every JSON body
its ``request_id``; each /v1/generate request appends one JSON line to the trace log (model
identity, prompt sha256 and version, token counts, queue and compute time, output sha256). A JSONL
file rather than MLflow tracing: one trace costs 0.012 ms appended to a file here against 3.8 ms
in the handler plus 74 ms of sqlite writes behind it with MLflow 3.17 (measured on this 2-core
host), which would cap the service near 13 traced requests/s and contend with the registry's store.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tpulab.config import check, field
from tpulab.data.drift import DriftWindow
from tpulab.errors import ExitCode, TpulabError
from tpulab.inference.generate import Request as GenerationRequest
from tpulab.inference.generate import decode_text, generate_batch
from tpulab.inference.trust import load_recorded
from tpulab.model import kvcache as kv
from tpulab.model.decode import MAX_BATCH, batch_bucket
from tpulab.model.policies import Policy
from tpulab.model.sampling import SamplingConfig

if TYPE_CHECKING:
    import uvicorn

    from tpulab.inference.artifacts import ArtifactSet
    from tpulab.model.decode import Engine

MAX_BODY_BYTES = 64 * 1024
DRAIN_MARGIN_S = 0.5  # answers cut by the drain are written this long before uvicorn's own bound
CLIENT_CLOSED = 499  # nginx's code for "the client closed the request": metrics and traces only
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _seconds(value: float, name: str, lo: float = 0.0) -> None:
    check(
        isinstance(value, (int, float)) and math.isfinite(value) and lo < value <= 3600,
        f"{name}={value} must be in ({lo:g}, 3600] seconds",
    )


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Batching, queueing, time limits, readiness and drain bounds of the service."""

    max_batch: int = field(16, f"requests decoded together, at most (1..{MAX_BATCH})")
    batch_window_ms: float = field(
        0.0,
        "how long the first request of a batch waits for company (requests "
        "arriving while a batch runs join the next one anyway)",
    )
    max_queue: int = field(64, "requests waiting beyond this are answered 503 with Retry-After")
    request_timeout_s: float = field(60.0, "server-side time limit of one request (504 after it)")
    retry_after_s: int = field(1, "the Retry-After a 503 carries")
    body_timeout_s: float = field(
        10.0, f"time a client has to send its whole body (at most {MAX_BODY_BYTES} bytes): 408"
    )
    drain_timeout_s: float = field(
        20.0,
        "after SIGTERM, how long requests in flight may take (then 503); under Kubernetes' "
        "default 30 s grace period, so the stop ends before a SIGKILL",
    )
    ready_timeout_s: float = field(600.0, "still starting this long after start: exit 1")

    def __post_init__(self):
        check(
            isinstance(self.max_batch, int) and 1 <= self.max_batch <= MAX_BATCH,
            f"max_batch={self.max_batch} must be in [1, {MAX_BATCH}]",
        )
        check(
            math.isfinite(self.batch_window_ms) and 0 <= self.batch_window_ms <= 1000,
            f"batch_window_ms={self.batch_window_ms} must be in [0, 1000]",
        )
        check(
            isinstance(self.max_queue, int) and 1 <= self.max_queue <= 100_000,
            f"max_queue={self.max_queue} must be in [1, 100000]",
        )
        _seconds(self.request_timeout_s, "request_timeout")
        check(
            1 <= self.retry_after_s <= 3600,
            f"retry_after_s={self.retry_after_s} must be in [1, 3600]",
        )
        _seconds(self.body_timeout_s, "body_timeout")
        _seconds(self.drain_timeout_s, "drain_timeout", lo=2 * DRAIN_MARGIN_S)
        _seconds(self.ready_timeout_s, "ready_timeout")

    def buckets(self) -> list[int]:
        return sorted({batch_bucket(n) for n in range(1, self.max_batch + 1)})


class GenerateBody(BaseModel):
    """POST /v1/generate body: types only (the bounds are sampling's); unknown fields refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    prompt: str
    max_new: int = 32
    temperature: float = 0.8
    top_k: int = 0
    seed: int = 0
    cache: Policy = "fp32"
    # The registered prompt template version the prompt was rendered from, when the client names
    # one: recorded in the trace next to the sha256 of the prompt actually served.
    prompt_version: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = None


class QueueFull(Exception):
    pass


def _reject_constant(name: str):
    raise TpulabError(f"request holds the non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise TpulabError(f"request holds the number {text[:32]}, which is not finite in float64")
    return value


def _too_large(n: int) -> str:
    return f"request body is {n} bytes, at most {MAX_BODY_BYTES}"


def parse_request(body: bytes, max_len: int) -> tuple[GenerateBody, GenerationRequest]:
    """POST body -> (its typed fields, the validated generation request); TpulabError says why."""
    if len(body) > MAX_BODY_BYTES:
        raise TpulabError(_too_large(len(body)))
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TpulabError(f"request body is not UTF-8 (bad byte at offset {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # bad JSON, huge ints, nesting past the stack
        raise TpulabError(
            f"request body is not valid JSON ({str(e).splitlines()[0][:120]})"
        ) from None
    try:
        req = GenerateBody.model_validate(obj)
    except ValidationError as e:
        errs = e.errors(include_url=False, include_input=False, include_context=False)
        reasons = [f"{'.'.join(map(str, x['loc'])) or 'body'}: {x['msg']}" for x in errs[:4]]
        raise TpulabError("; ".join(reasons)) from None
    sampling = SamplingConfig(
        max_new=req.max_new, temperature=req.temperature, top_k=req.top_k, seed=req.seed
    )
    return req, GenerationRequest.of(req.prompt, sampling, max_len)


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


@dataclasses.dataclass(frozen=True)
class Model:
    """One verified model: its artifact set, one engine per cache policy, what the registry says it
    is (``registry``: None when served from a plain artifacts dir) and the byte histogram of its
    training corpus for the drift statistic (None, with the reason in ``reference_source``)."""

    art: ArtifactSet
    engines: dict[str, Engine]  # one per cache policy
    registry: dict | None = None
    reference: np.ndarray | None = None
    reference_source: str = "none"

    @classmethod
    def of(
        cls,
        art: ArtifactSet,
        registry: dict | None = None,
        reference: np.ndarray | None = None,
        reference_source: str = "none",
    ) -> Model:
        engines = {p: art.engine(p) for p in kv.POLICIES}
        return cls(art, engines, registry, reference, reference_source)

    @property
    def max_len(self) -> int:
        return self.art.max_len

    def identity(self) -> dict:
        """What a response and a trace name: enough to find the exact weights and endpoints."""
        reg = self.registry or {}
        src = self.art.manifest["source"]
        return {
            "name": reg.get("name"),
            "version": reg.get("version"),
            "alias": reg.get("alias"),
            "manifest_sha256": self.art.manifest_sha256,
            "checkpoint_manifest_sha256": src["checkpoint_manifest_sha256"],
            "checkpoint_step": src["checkpoint_step"],
        }


def artifacts_loader(
    artifacts: str | Path, run_dir: str | Path | None = None, key: bytes | None = None
) -> Callable[[], Model]:
    """The loader of a plain artifacts dir: ``load_recorded`` (every file rehashed, every artifact
    deserialized and shape-checked, a passing record required, verified against the checkpoint
    too when given ``run_dir``)."""
    return lambda: Model.of(load_recorded(artifacts, run_dir, key))


@dataclasses.dataclass
class _Job:
    req: GenerationRequest
    policy: str
    future: concurrent.futures.Future
    enqueued: float
    deadline: float


class Batcher:
    """The bounded queue and the one thread that turns queued requests into device batches."""

    def __init__(
        self, cfg: ServeConfig, *, clock: Callable[[], float] = time.monotonic, on_batch=None
    ):
        self.cfg, self.clock, self.on_batch = cfg, clock, on_batch
        self.model: Model | None = None  # installed before start; replaced by ``swap``
        self.queue: collections.deque[_Job] = collections.deque()
        self.cond = threading.Condition()
        self.stopped = False
        self.batches = collections.Counter()  # batch size -> count, for /v1/stats
        self.thread = threading.Thread(target=self._run, name="batcher", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def swap(self, model: Model) -> Model | None:
        """Serve ``model`` from the next batch on; the batch running now finishes on the old one."""
        with self.cond:
            old, self.model = self.model, model
        return old

    def submit(self, req: GenerationRequest, policy: str) -> concurrent.futures.Future:
        now = self.clock()
        job = _Job(req, policy, concurrent.futures.Future(), now, now + self.cfg.request_timeout_s)
        with self.cond:
            if len(self.queue) >= self.cfg.max_queue:
                raise QueueFull
            self.queue.append(job)
            self.cond.notify_all()
        return job.future

    def _take(self) -> tuple[list[_Job], Model | None]:
        """Wait for a request, then for its window (or a full batch); pop up to max_batch of its
        policy, with the model that will run them."""
        with self.cond:
            while not self.queue and not self.stopped:
                self.cond.wait()
            if self.stopped:
                return [], None
            first = self.queue[0]
            close = first.enqueued + self.cfg.batch_window_ms / 1000
            while not self.stopped:
                same = sum(1 for j in self.queue if j.policy == first.policy)
                left = close - self.clock()
                if same >= self.cfg.max_batch or left <= 0:
                    break
                self.cond.wait(left)
            jobs, keep = [], collections.deque()
            for j in self.queue:
                (
                    jobs if j.policy == first.policy and len(jobs) < self.cfg.max_batch else keep
                ).append(j)
            self.queue = keep
            model = self.model
        now = self.clock()
        live = []
        for j in jobs:
            if j.future.cancelled() or not j.future.set_running_or_notify_cancel():
                continue
            if now > j.deadline:
                j.future.set_exception(TimeoutError("expired in the queue"))
                continue
            if len(j.req.ids) + j.req.sampling.max_new > model.max_len:  # validated before a swap
                j.future.set_exception(
                    TpulabError(
                        f"prompt plus max_new exceeds the {model.max_len} positions of the model "
                        "now served (swapped while the request waited)"
                    )
                )
                continue
            live.append(j)
        return live, model

    def _run(self):
        while not self.stopped:
            jobs, model = self._take()
            if not jobs:
                continue
            t0 = self.clock()
            try:
                outs = generate_batch(model.engines[jobs[0].policy], [j.req for j in jobs])
            except (
                Exception
            ) as e:  # reported to every waiting client (500), never kills the batcher
                for j in jobs:
                    j.future.set_exception(e)
                continue
            t1 = self.clock()
            self.batches[len(jobs)] += 1
            if self.on_batch is not None:
                self.on_batch(len(jobs))
            for j, ids in zip(jobs, outs):
                j.future.set_result(
                    {
                        "ids": ids,
                        "model": model,
                        "batch": len(jobs),
                        "queue_ms": (t0 - j.enqueued) * 1e3,
                        "compute_ms": (t1 - t0) * 1e3,
                    }
                )


class TraceLog:
    """One JSON line per /v1/generate request, written as it is answered (line-buffered: a crash
    loses no answered request's trace)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8", buffering=1)
        except OSError as e:
            raise TpulabError(f"trace log {self.path}: {e.strerror or e}") from None
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            self._f.write(line)

    def close(self) -> None:
        with self._lock:
            self._f.close()


class Metrics:
    """The service's Prometheus metrics, in a registry of its own (two services in one process,
    as in the tests, do not collide)."""

    def __init__(self, service: Service):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tpulab_requests", "HTTP requests answered, by path and status", ["path", "code"],
            registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "tpulab_request_latency_seconds",
            "/v1/generate: arrival to response, every status",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "tpulab_queue_seconds", "answered requests: time queued before their batch ran",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.compute_time = Histogram(
            "tpulab_compute_seconds", "answered requests: the device time of their batch",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch = Histogram(
            "tpulab_batch_size", "requests per device dispatch",
            buckets=tuple(2.0**i for i in range(9)), registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "tpulab_tokens", "tokens of answered requests: prompt (with BOS) and generated",
            ["kind"], registry=r,
        )  # fmt: skip
        self.disconnects = Counter(
            "tpulab_client_disconnects", "clients gone before their request body arrived",
            registry=r,
        )  # fmt: skip
        self.swaps = Counter("tpulab_model_swaps", "models swapped in while serving", registry=r)
        self.model = Info("tpulab_model", "the model being served", registry=r)
        Gauge("tpulab_queue_depth", "requests waiting for a batch", registry=r).set_function(
            lambda: len(service.batcher.queue)
        )
        Gauge("tpulab_ready", "1 when /readyz is 200", registry=r).set_function(
            lambda: float(service.ready.is_set() and not service.draining)
        )
        drift = service.drift
        Gauge(
            "tpulab_prompt_drift_jsd",
            "Jensen-Shannon divergence (bits) of the newest prompt bytes' histogram against the "
            "training corpus's (NaN: no prompt yet, or no reference)",
            registry=r,
        ).set_function(service.drift_value)
        Gauge(
            "tpulab_prompt_drift_alarm", "1 when a full window's JSD exceeds the threshold",
            registry=r,
        ).set_function(lambda: float(service.drift_alarm()))  # fmt: skip
        Gauge(
            "tpulab_prompt_drift_window_bytes", "prompt bytes in the drift window", registry=r
        ).set_function(lambda: drift.bytes)
        Gauge("tpulab_prompt_drift_threshold", "the alarm threshold (JSD, bits)", registry=r).set(
            drift.threshold
        )

    def set_model(self, model: Model) -> None:
        self.model.info({k: "" if v is None else str(v) for k, v in model.identity().items()})

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _BodyTooLarge(Exception):
    pass


async def _read_body(request: HttpRequest) -> bytes:
    """The request body, refusing more than MAX_BODY_BYTES without reading them all."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _BodyTooLarge(int(declared))
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > MAX_BODY_BYTES:
            raise _BodyTooLarge(n)
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(e: BaseException) -> str:
    return str(e) if isinstance(e, TpulabError) else f"{type(e).__name__}: {e}"


class Service:
    """The model being served, the batcher, readiness, swaps, the drain, metrics and traces.

    ``loader`` returns a verified ``Model``; it runs in the background (``start``), so the server
    is live while it works. ``clock`` times queueing, the ready deadline and probes.
    """

    def __init__(
        self,
        loader: Callable[[], Model],
        cfg: ServeConfig = ServeConfig(),
        *,
        describe: str = "",
        trace_log: TraceLog | None = None,
        drift: DriftWindow | None = None,
        prompts: Callable[[str, str], dict] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.loader, self.cfg, self.describe, self.clock = loader, cfg, describe, clock
        # (prompt_version, prompt) -> the trace's prompt fields, as the prompt registry resolves
        # them (``ops.prompts.PromptResolver``); TpulabError: refused (422). None: traced as given.
        self.prompts = prompts
        self.trace_log = trace_log
        self.drift = drift or DriftWindow(None)
        self.started_at = clock()
        self.stage = "starting"
        self.failure: str | None = None
        self.readiness: dict | None = None
        self.ready = threading.Event()
        self.draining = False
        self.notes: dict = {}  # extra /v1/model sections its driver keeps current (``ops.serving``)
        self.swaps: list[dict] = []
        self.drain = {"in_flight_at_stop": 0, "answered": 0, "cut": 0}
        self.on_ready: list[Callable[[], None]] = []
        self._in_flight = 0
        self._timeouts: set = set()
        self._drain_at: float | None = None
        self.metrics = Metrics(self)
        self.batcher = Batcher(cfg, clock=clock, on_batch=self.metrics.batch.observe)

    @property
    def model(self) -> Model | None:
        return self.batcher.model

    # --- readiness ---------------------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._bring_up, name="bring-up", daemon=True).start()

    def _bring_up(self) -> None:
        """Verify, compile, run one real request through the batcher; only then ready."""
        try:
            self.stage = "verifying"
            model = self.loader()
            self.stage = "compiling"
            t0 = self.clock()
            want = self.warm(model)
            self._install(model)
            self.batcher.swap(model)
            self.batcher.start()
            self.stage = "probing"
            probe = self.probe_request(model)
            out = self.batcher.submit(probe, "fp32").result(timeout=self.cfg.ready_timeout_s)
            if out["ids"] != want:
                raise TpulabError(
                    f"the readiness probe through the batcher gave {out['ids']}, the direct "
                    f"call {want}"
                )
            self.readiness = {
                "verified": model.art.verification,
                "compiled": {p: e.compiled_variants() for p, e in model.engines.items()},
                "compile_s": round(self.clock() - t0, 3),
                "probe": {"prompt": "a", "tokens": len(want), "batch_ms": out["compute_ms"]},
                "ready_after_s": round(self.clock() - self.started_at, 3),
            }
            self.stage = "ready"
            self.ready.set()
            print(
                f"ready after {self.readiness['ready_after_s']:.1f} s: {self.describe} "
                f"(manifest {model.art.manifest_sha256[:12]}, verified by "
                f"{model.art.verification['mode']})",
                flush=True,
            )
            for callback in self.on_ready:
                callback()
        except Exception as e:  # not swallowed: on /readyz, and ``run_server``'s one error line
            self.failure = _reason(e)
            self.stage = "failed"

    def probe_request(self, model: Model) -> GenerationRequest:
        new = max(1, min(4, model.max_len - 2))
        return GenerationRequest.of(
            "a", SamplingConfig(max_new=new, temperature=0.0), model.max_len
        )

    def warm(self, model: Model) -> list[int]:
        """Compile ``model``'s loop for every policy and batch bucket (one executable each, reused
        after); each compile runs a real greedy generation. Returns fp32's batch-1 tokens."""
        probe = self.probe_request(model)
        want = None
        for policy, engine in model.engines.items():
            for b in self.cfg.buckets():
                outs = generate_batch(engine, [probe] * b)
                if policy == "fp32" and b == 1:
                    want = outs[0]
        return want

    def overdue(self) -> bool:
        """Not ready ``ready_timeout_s`` after start: the server should exit 1."""
        return not self.ready.is_set() and self.clock() - self.started_at > self.cfg.ready_timeout_s

    def failed(self) -> bool:
        """Bring-up failed: nothing will make it ready, so the server should exit 1 now."""
        return self.stage == "failed"

    def not_ready_reason(self) -> str:
        return self.failure or f"{self.stage} ({self.clock() - self.started_at:.1f} s since start)"

    # --- swaps -------------------------------------------------------------------------------

    def _install(self, model: Model) -> None:
        self.metrics.set_model(model)
        self.drift.set_reference(model.reference)

    def swap(self, model: Model, why: str = "") -> dict:
        """Serve ``model`` (verified and ``warm``ed by the caller) from the next batch on."""
        self._install(model)
        old = self.batcher.swap(model)
        record = {
            "at": _utc_now(),
            "from": old.identity() if old else None,
            "to": model.identity(),
            "why": why,
        }
        self.swaps.append(record)
        self.metrics.swaps.inc()
        return record

    # --- the drain ---------------------------------------------------------------------------

    def begin_drain(self, bound_s: float) -> None:
        """SIGTERM: every handler wait ends by ``bound_s`` - DRAIN_MARGIN_S from now (called in the
        event loop by ``_Server.shutdown``)."""
        loop = asyncio.get_running_loop()
        self.draining = True
        self._drain_at = loop.time() + bound_s - DRAIN_MARGIN_S
        self.drain["in_flight_at_stop"] = self._in_flight
        for t in list(self._timeouts):
            if t.when() is None or t.when() > self._drain_at:
                t.reschedule(self._drain_at)
        print(
            f"stopping: draining {self._in_flight} request(s) in flight (bound {bound_s:g} s)",
            flush=True,
        )

    @asynccontextmanager
    async def _bounded(self, seconds: float):
        """An asyncio timeout the drain can shorten."""
        when = asyncio.get_running_loop().time() + seconds
        if self._drain_at is not None:
            when = min(when, self._drain_at)
        async with asyncio.timeout_at(when) as t:
            self._timeouts.add(t)
            try:
                yield
            finally:
                self._timeouts.discard(t)

    def close(self) -> None:
        self.batcher.stop()
        if self.trace_log is not None:
            self.trace_log.close()

    # --- drift -------------------------------------------------------------------------------

    def drift_value(self) -> float:
        return self.drift.value()

    def drift_alarm(self) -> bool:
        return self.drift.alarm()

    # --- requests ----------------------------------------------------------------------------

    def compiled_variants(self) -> dict[str, int]:
        m = self.model
        return {p: e.compiled_variants()["generate"] for p, e in m.engines.items()} if m else {}

    def model_info(self) -> dict:
        """/v1/model: the artifact identity, the registry's view, drift, swaps and settings."""
        m = self.model
        return {
            **m.art.identity(),
            "registry": m.registry,
            "identity": m.identity(),
            "drift": {
                "reference": m.reference_source,
                "window_bytes": self.drift.window_bytes,
                "threshold": self.drift.threshold,
                "bytes": self.drift.bytes,
                "jsd": None if math.isnan(v := self.drift.value()) else v,
                "alarm": self.drift.alarm(),
            },
            "swaps": self.swaps,
            **self.notes,
            "trace_log": str(self.trace_log.path) if self.trace_log else None,
            "serving": dataclasses.asdict(self.cfg),
            "batch_buckets": self.cfg.buckets(),
        }

    async def generate(self, request: HttpRequest, rid: str) -> JSONResponse:
        t0 = time.perf_counter()
        trace = {"request_id": rid, "time": _utc_now()}
        self._in_flight += 1
        try:
            status, body, headers = await self._generate(request, trace)
        finally:
            self._in_flight -= 1
        if self.draining:
            self.drain["cut" if status == 503 else "answered"] += 1
        elapsed = time.perf_counter() - t0
        self.metrics.latency.observe(elapsed)
        trace.update(status=status, total_ms=round(elapsed * 1e3, 3))
        if status != 200:
            trace["detail"] = body["detail"]
        if self.trace_log is not None:
            self.trace_log.write(trace)
        return JSONResponse({**body, "request_id": rid}, status_code=status, headers=headers)

    def _unavailable(self, detail: str) -> tuple[int, dict, dict]:
        return 503, {"detail": detail}, {"Retry-After": str(self.cfg.retry_after_s)}

    async def _generate(self, request: HttpRequest, trace: dict) -> tuple[int, dict, dict]:
        if self.draining:
            return self._unavailable("server stopping")
        if not self.ready.is_set():
            return self._unavailable(f"not ready: {self.not_ready_reason()}")
        model = self.model
        trace["model"] = model.identity()
        try:
            async with self._bounded(self.cfg.body_timeout_s):
                body = await _read_body(request)
        except ClientDisconnect:
            self.metrics.disconnects.inc()
            return CLIENT_CLOSED, {"detail": "client disconnected before its body arrived"}, {}
        except _BodyTooLarge as e:
            return 413, {"detail": _too_large(e.args[0])}, {}
        except TimeoutError:
            if self.draining:
                return self._unavailable("server stopping; the body had not arrived")
            return 408, {"detail": f"body not received within {self.cfg.body_timeout_s:g} s"}, {}
        try:
            req, gen = parse_request(body, model.max_len)
        except TpulabError as e:
            return 422, {"detail": str(e)}, {}
        prompt = req.prompt.encode("utf-8")
        trace.update(
            prompt_sha256=hashlib.sha256(prompt).hexdigest(),
            prompt_version=req.prompt_version if self.prompts is None else None,
            prompt_resolved=False,
            prompt_bytes=len(prompt),
            prompt_tokens=len(gen.ids),
            max_new=req.max_new,
            temperature=req.temperature,
            top_k=req.top_k,
            seed=req.seed,
            cache=req.cache,
        )
        if req.prompt_version is not None and self.prompts is not None:
            trace["prompt_label"] = req.prompt_version
            try:  # a sqlite read when not cached: off the event loop
                trace.update(await asyncio.to_thread(self.prompts, req.prompt_version, req.prompt))
            except TpulabError as e:
                return 422, {"detail": str(e)}, {}
            except Exception as e:
                return self._unavailable(f"prompt registry unreadable: {_reason(e)}")
        self.drift.observe(prompt)
        try:
            fut = self.batcher.submit(gen, req.cache)
        except QueueFull:
            return self._unavailable(
                f"queue full ({self.cfg.max_queue} requests waiting); retry later"
            )
        try:
            async with self._bounded(self.cfg.request_timeout_s):
                out = await asyncio.wrap_future(fut)
        except TimeoutError:
            fut.cancel()
            if self.draining:
                return self._unavailable("server stopping; the request was not answered in time")
            return (
                504,
                {
                    "detail": f"request exceeded the server's time limit of "
                    f"{self.cfg.request_timeout_s:g} s"
                },
                {},
            )
        except TpulabError as e:
            return 422, {"detail": str(e)}, {}
        except Exception as e:
            return 500, {"detail": f"generation failed: {_reason(e)}"}, {}
        text = decode_text(out["ids"])
        served = out["model"].identity()
        self.metrics.tokens.labels("prompt").inc(len(gen.ids))
        self.metrics.tokens.labels("generated").inc(len(out["ids"]))
        self.metrics.queue_time.observe(out["queue_ms"] / 1e3)
        self.metrics.compute_time.observe(out["compute_ms"] / 1e3)
        trace.update(
            model=served,
            generated_tokens=len(out["ids"]),
            batch=out["batch"],
            queue_ms=round(out["queue_ms"], 3),
            compute_ms=round(out["compute_ms"], 3),
            output_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        )
        return (
            200,
            {
                "text": text,
                "tokens": len(out["ids"]),
                "prompt": req.prompt,
                "prompt_sha256": trace["prompt_sha256"],
                "prompt_version": trace["prompt_version"],
                "prompt_resolved": trace["prompt_resolved"],
                "max_new": req.max_new,
                "cache": req.cache,
                "seed": req.seed,
                "batch": out["batch"],
                "queue_ms": out["queue_ms"],
                "compute_ms": out["compute_ms"],
                "manifest_sha256": served["manifest_sha256"],
                "model": served,
            },
            {},
        )


_ROUTES = ("/livez", "/readyz", "/healthz", "/metrics", "/v1/model", "/v1/stats", "/v1/generate")


def request_id(scope) -> str:
    return scope["tpulab.request_id"]


class _Edge:
    """ASGI middleware: a request id on every request (the client's ``X-Request-ID`` when it is
    1-64 of [A-Za-z0-9._:-], else a fresh uuid4), echoed in the response header, and the request
    counter by path and status."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope["tpulab.request_id"] = rid
        status = [CLIENT_CLOSED]  # what is counted when no response starts (the client left)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope["path"] if scope["path"] in _ROUTES else "other"
            self.service.metrics.requests.labels(path, str(status[0])).inc()


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        service.close()

    app = FastAPI(title="tpulab generate", lifespan=lifespan)
    app.add_middleware(_Edge, service=service)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException):
        return JSONResponse(
            {"detail": exc.detail, "request_id": request_id(request.scope)},
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.get("/livez")
    async def livez(request: HttpRequest):
        return {"status": "live", "request_id": request_id(request.scope)}

    def readiness(request: HttpRequest):
        rid = request_id(request.scope)
        if service.ready.is_set() and not service.draining:
            return {"status": "ready", **service.readiness, "request_id": rid}
        status = "stopping" if service.draining else f"not ready: {service.not_ready_reason()}"
        return JSONResponse(
            {"status": status, "stage": service.stage, "request_id": rid}, status_code=503
        )

    app.get("/readyz")(readiness)
    app.get("/healthz")(readiness)  # the older name, kept for its callers

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/model")
    async def model(request: HttpRequest):
        rid = request_id(request.scope)
        if service.model is None:
            return JSONResponse(
                {"detail": f"no model loaded: {service.not_ready_reason()}", "request_id": rid},
                status_code=503,
            )
        return {**service.model_info(), "request_id": rid}

    @app.get("/v1/stats")
    async def stats(request: HttpRequest):
        return {
            "batches": {str(k): v for k, v in sorted(service.batcher.batches.items())},
            "queued": len(service.batcher.queue),
            "compiled_variants": service.compiled_variants(),
            "request_id": request_id(request.scope),
        }

    @app.post("/v1/generate")
    async def generate(request: HttpRequest):
        return await service.generate(request, request_id(request.scope))

    return app


def _server_class():  # built on first use: uvicorn is imported only by a server
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a drained stop is a success (uvicorn re-raises the caught
        signal after its graceful shutdown: the process died of SIGTERM, exit 143), the service
        learns when the drain begins, and a server whose bring-up failed, or that is not ready in
        time, stops."""

        def __init__(self, config: uvicorn.Config, service: Service):
            super().__init__(config)
            self.service, self.signals = service, []
            self.overdue = self.failed = False

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

        def _on_signal(self, sig, frame):
            self.signals.append(sig)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.config.host, self.servers[0].sockets[0].getsockname()[1]
                print(
                    f"listening on http://{host}:{port} (live now; ready once "
                    f"{self.service.describe} is verified, compiled and has answered a probe)",
                    flush=True,
                )

        async def on_tick(self, counter: int) -> bool:
            if not self.should_exit and self.service.failed():
                self.failed = self.should_exit = True
            elif not self.should_exit and self.service.overdue():
                self.overdue = self.should_exit = True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            self.service.begin_drain(self.config.timeout_graceful_shutdown)
            await super().shutdown(sockets)

    return Server


def run_server(service: Service, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve until SIGTERM/SIGINT (drained: returns; SIGINT then raises KeyboardInterrupt), until
    bring-up fails (TpulabError, exit 1, at once) or until the ready deadline passes unready
    (TpulabError, exit 1)."""
    import uvicorn

    config = uvicorn.Config(
        create_app(service),
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=service.cfg.drain_timeout_s,
    )
    server = _server_class()(config, service)
    server.run()
    if server.failed:
        raise TpulabError(
            f"not ready ({service.describe}): {service.failure}", exit_code=ExitCode.FAILED
        )
    if server.overdue:
        raise TpulabError(
            f"not ready within {service.cfg.ready_timeout_s:g} s: {service.not_ready_reason()}",
            exit_code=ExitCode.FAILED,
        )
    d = service.drain
    print(
        f"stopped: {d['answered']} request(s) answered and {d['cut']} cut at the bound while "
        f"draining ({d['in_flight_at_stop']} in flight at the signal)",
        flush=True,
    )
    if signal.SIGINT in server.signals:
        raise KeyboardInterrupt
