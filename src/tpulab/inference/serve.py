"""The generation service over verified exported endpoints: readiness, swaps, the drain and the
/v1/generate handler. Its parts, one module each: the request (``serve_request``), the model and
the batcher (``serve_batcher``), traces and metrics (``serve_telemetry``), the HTTP face and the
server (``serve_http``); its settings are ``inference.config.ServeConfig``.

Lifecycle. ``serve_http.run_server`` listens at once, so ``/livez`` is 200 from the first moment.
In the background the service calls its loader (``trust.load_recorded``: rehashes every file,
deserializes and shape-checks every artifact, requires a passing verification record and, given a
run dir, re-verifies the set against its checkpoint; ``tpulab.ops.serving`` adds the registry's
checks), compiles the loop of the first served cache policy at the smallest batch bucket (a real
greedy generation), and sends one request through the batcher, whose tokens must equal the direct
call's. Then ``/readyz`` (and ``/healthz``, its older name) is 200, and the other paths
(``ServeConfig.compile_order``) compile in the same thread while the service answers: the
batcher uses only compiled buckets (``serve_batcher``). Waiting for every path cost 15 compiles,
271 s, on a loaded 2-core host. A failure before ready is permanent (nothing retries it): the
server stops on its next tick and exits 1 with the reason, at once rather than at the deadline.
Still verifying or compiling is the only wait: a server not ready ``ready_timeout_s`` after it
started exits 1 with the stage it was in.

Stopping. SIGTERM (or SIGINT), in any stage: readiness turns 503, the listener stays open briefly
so what the kernel accepted is answered (``serve_http``), then closes and drains
(``begin_drain``): requests in flight finish, bounded by ``drain_timeout_s`` (past it, what is
still waiting for its body or its batch is answered 503); ``close`` stops the background compiles
(one under way finishes, none starts) and the batcher, and the process exits 0 at once
(``serve_stop.exit_now``: a thread inside XLA cannot abort it).
Every wait of a handler (the body, the batch) is an ``asyncio.timeout`` the drain reschedules, so
uvicorn's own bound (which cancels tasks and logs a traceback for each) is only a backstop. A
client that disconnects before its body has arrived is counted and traced (status 499), with no
traceback.

Requests: the body is read under ``body_timeout_s`` (a client trickling bytes is answered 408),
parsed and validated (``serve_request``: every refusal a 4xx with a reason), queued (full: 503 with
Retry-After) and batched (``serve_batcher``). A request not answered within ``request_timeout_s``
gets 504 (a queued one is dropped; a running batch cannot be interrupted, its result is discarded).

Swaps: ``Service.swap`` replaces the model between batches; a batch already taken finishes on the
model it was taken with, and every response and trace names the model that produced it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import math
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from tpulab.compile_cache import CompileCounter
from tpulab.data.drift import DriftWindow
from tpulab.errors import TpulabError
from tpulab.inference.config import DRAIN_MARGIN_S, ServeConfig
from tpulab.inference.generate import Request as GenerationRequest
from tpulab.inference.generate import decode_text, generate_batch
from tpulab.inference.serve_batcher import Batcher, Model, QueueFull
from tpulab.inference.serve_request import BodyTooLarge, parse_request, read_body, too_large
from tpulab.inference.serve_telemetry import CLIENT_CLOSED, Metrics, TraceLog
from tpulab.inference.trust import load_recorded
from tpulab.model.sampling import SamplingConfig


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def artifacts_loader(
    artifacts: str | Path, run_dir: str | Path | None = None, key: bytes | None = None
) -> Callable[[], Model]:
    """The loader of a plain artifacts dir: ``load_recorded`` (every file rehashed, every artifact
    deserialized and shape-checked, a passing record required, verified against the checkpoint
    too when given ``run_dir``)."""
    return lambda: Model.of(load_recorded(artifacts, run_dir, key))


def _reason(e: BaseException) -> str:
    return str(e) if isinstance(e, TpulabError) else f"{type(e).__name__}: {e}"


class Service:
    """The model being served, the batcher, readiness, swaps, the drain, metrics and traces.

    ``loader`` returns a verified ``Model``; it runs in the background (``start``), so the server
    is live while it works. ``cache_dir``: the persistent compilation cache its caller enabled
    (named in /readyz). ``clock`` times queueing, the ready deadline and probes.
    """

    def __init__(
        self,
        loader: Callable[[], Model],
        cfg: ServeConfig | None = None,
        *,
        describe: str = "",
        trace_log: TraceLog | None = None,
        drift: DriftWindow | None = None,
        prompts: Callable[[str, str], dict] | None = None,
        cache_dir: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        cfg = cfg or ServeConfig()
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
        self.on_close: list[Callable[[], None]] = []
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.compiles = CompileCounter()
        self.pending: list[tuple[str, int]] = []  # [the path being compiled, then those to come]
        self.compile_s: dict[str, dict[str, float]] = {}
        self.compile_failed: dict[str, str] = {}
        self._stop = threading.Event()
        self._in_flight = 0
        self._timeouts: set = set()
        self._drain_at: float | None = None
        self.metrics = Metrics(self)
        self.batcher = Batcher(cfg, clock=clock, on_batch=self.metrics.batch.observe)

    @property
    def model(self) -> Model | None:
        return self.batcher.model

    # --- readiness ----------------------------------------------------------------------------

    def start(self) -> None:
        self.compiles.start()
        threading.Thread(target=self._bring_up, name="bring-up", daemon=True).start()

    def _bring_up(self) -> None:
        """Verify, compile the first path, run one real request through the batcher: ready. Then
        compile the other paths while serving."""
        try:
            self.stage = "verifying"
            t0 = self.clock()
            model = self.loader().serving(self.cfg.policies)
            verify_s = self.clock() - t0
            if self._stop.is_set():
                return
            self.stage = "compiling"
            self.pending = list(self.cfg.compile_order())
            t0 = self.clock()
            policy, bucket = self.pending[0]
            want = self._compile(model, policy, bucket)
            self._install(model)
            self.batcher.swap(model, {policy: [bucket]})
            self.batcher.start()
            if self._stop.is_set():
                return
            self.stage = "probing"
            probe = self.probe_request(model)
            out = self.batcher.submit(probe, policy).result(timeout=self.cfg.ready_timeout_s)
            if out["ids"] != want:
                raise TpulabError(
                    f"the readiness probe through the batcher gave {out['ids']}, the direct "
                    f"call {want}"
                )
            self.readiness = {
                "verified": model.art.verification,
                "probe": {
                    "prompt": "a",
                    "policy": policy,
                    "tokens": len(want),
                    "batch_ms": out["compute_ms"],
                },
                "verify_s": round(verify_s, 3),
                "ready_compile_s": round(self.clock() - t0, 3),
                "ready_after_s": round(self.clock() - self.started_at, 3),
            }
            self.stage = "ready"
            self.ready.set()
            print(
                f"ready after {self.readiness['ready_after_s']:.1f} s: {self.describe} "
                f"(manifest {model.art.manifest_sha256[:12]}, verified by "
                f"{model.art.verification['mode']}; {policy} batch {bucket} compiled, "
                f"{len(self.pending) - 1} path(s) to compile in the background)",
                flush=True,
            )
            for callback in self.on_ready:
                callback()
        except Exception as e:  # not swallowed: on /readyz, and ``run_server``'s one error line
            if not self._stop.is_set():  # stopping cancels the probe: not a failure
                self.failure = _reason(e)
                self.stage = "failed"
            return
        self._compile_rest(model, {policy: want})

    def _compile_rest(self, model: Model, want: dict[str, list[int]]) -> None:
        """The paths readiness did not wait for, in ``compile_order``, each usable as soon as it
        is compiled and its rows agree with its policy's batch-1 tokens; one that fails is
        reported (``/readyz``, a warning line) and its requests go to the buckets that work."""
        while len(self.pending) > 1 and not self._stop.is_set():
            policy, bucket = self.pending[1]
            try:
                want.setdefault(policy, self._compile(model, policy, bucket, want.get(policy)))
                self.batcher.mark_compiled(model, policy, bucket)
            except Exception as e:
                self.compile_failed[f"{policy}/{bucket}"] = _reason(e)
                print(f"warning: {policy} batch {bucket} not served: {_reason(e)}", flush=True)
            del self.pending[1]
        if not self._stop.is_set():
            done = self.compiles.snapshot()
            print(
                f"compiled every path after {self.clock() - self.started_at:.1f} s "
                f"({done['compiles']} XLA compile(s), {done['cache_hits']} from the cache "
                f"{self.cache_dir})",
                flush=True,
            )

    def probe_request(self, model: Model) -> GenerationRequest:
        new = max(1, min(4, model.max_len - 2))
        return GenerationRequest.of(
            "a", SamplingConfig(max_new=new, temperature=0.0), model.max_len
        )

    def _compile(
        self, model: Model, policy: str, bucket: int, want: list[int] | None = None
    ) -> list[int]:
        """Compile ``policy``'s loop at ``bucket`` rows by running it: a real greedy generation of
        the probe in every row. Every row must give the same tokens (and ``want``, when given):
        a row's tokens do not depend on its batch. Returns row 0's tokens."""
        t0 = self.clock()
        outs = generate_batch(model.engines[policy], [self.probe_request(model)] * bucket)
        self.compile_s.setdefault(policy, {})[str(bucket)] = round(self.clock() - t0, 3)
        first = outs[0] if want is None else want
        if any(o != first for o in outs):
            raise TpulabError(
                f"{policy} at batch {bucket} gave rows {sorted(set(map(tuple, outs)))}, not all "
                f"{first}"
            )
        return first

    def prepare(self, model: Model) -> Model:
        """``model`` with the served policies alone, compiled for every batch bucket (a swap's
        candidate: it is compiled beside the model serving, which keeps answering)."""
        model = model.serving(self.cfg.policies)
        want: dict[str, list[int]] = {}
        for policy, bucket in self.cfg.compile_order():
            want.setdefault(policy, self._compile(model, policy, bucket, want.get(policy)))
        return model

    def readiness_report(self) -> dict:
        """/readyz when ready: what was verified, the probe, what is compiled and still compiling,
        the compile seconds per policy and bucket, and the compilation cache's counts."""
        return {
            **self.readiness,
            "policies": list(self.cfg.policies),
            "compiled": dict(self.batcher.compiled),
            "compiling": [f"{p}/{b}" for p, b in self.pending[1:]],
            "compile_failed": dict(self.compile_failed),
            "compile_s": self.compile_s,
            "executables": self.compiled_variants(),
            "compile_cache": {
                "dir": None if self.cache_dir is None else str(self.cache_dir),
                **self.compiles.snapshot(),
            },
        }

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
        """Serve ``model`` (verified, then ``prepare``d by the caller) from the next batch on."""
        self._install(model)
        old = self.batcher.swap(model, {p: self.cfg.buckets() for p in model.engines})
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
        """SIGTERM: every handler wait ends by ``bound_s`` - 2 x DRAIN_MARGIN_S from now (its
        answer written before uvicorn's own bound, the process gone by ``bound_s``; called in the
        event loop by ``serve_http``'s server)."""
        loop = asyncio.get_running_loop()
        self.draining = True
        self._drain_at = loop.time() + bound_s - 2 * DRAIN_MARGIN_S
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
        """Stop what runs in the background (a compile under way finishes; none starts after it)
        and close the trace log. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        for callback in self.on_close:
            callback()
        self.batcher.stop()
        self.compiles.stop()
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
                body = await read_body(request)
        except ClientDisconnect:
            self.metrics.disconnects.inc()
            return CLIENT_CLOSED, {"detail": "client disconnected before its body arrived"}, {}
        except BodyTooLarge as e:
            return 413, {"detail": too_large(e.args[0])}, {}
        except TimeoutError:
            if self.draining:
                return self._unavailable("server stopping; the body had not arrived")
            return 408, {"detail": f"body not received within {self.cfg.body_timeout_s:g} s"}, {}
        try:
            req, gen = parse_request(body, model.max_len)
        except TpulabError as e:
            return 422, {"detail": str(e)}, {}
        if req.cache not in model.engines:
            served = ", ".join(model.engines)
            return 422, {"detail": f"cache {req.cache!r} is not served here (served: {served})"}, {}
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
