"""HTTP generation service over verified exported endpoints (FastAPI + uvicorn), with request
batching.

Startup (before anything listens) rehashes every file, deserializes and shape-checks every artifact
and either re-verifies the set against its checkpoint (``--run-dir``) or matches a passing
verification record (HMAC-checked with ``--key-file``); any failure is one ``error:`` line and a
non-zero exit. Warm-up (compiling the generation loop for each cache policy and batch bucket) runs
in the background; /healthz answers 503 until it is done and the process exits if it fails.

Requests: the body is parsed here (UTF-8, JSON without NaN/Infinity/overflowing numbers), typed by
a pydantic contract and validated by ``sampling`` (the bounds the CLI uses too); every refusal is a
422 with a reason. Valid requests join a bounded queue (full: 503 with Retry-After). One batcher
thread takes every waiting request of the oldest one's cache policy (up to ``max_batch``; requests
that arrived while the previous batch ran are all there), optionally waiting ``batch_window_ms``
for more (default 0: measured on CPU, a 5 ms window cost more than it gathered), and runs them as
one dispatch of the compiled loop, each row with its own prompt length, max_new, temperature, top_k
and seed; a row's tokens do not depend on its batch-mates. Handlers only await, so /healthz stays
responsive while the device works, and a slow client (its body is read before it is queued) never
holds up a batch. A request that is not answered within ``request_timeout_s`` gets 504 (a queued one
is dropped; a running batch cannot be interrupted, its result is discarded).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import math
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from tpulab.config import check, field
from tpulab.errors import TpulabError
from tpulab.inference.generate import Request as GenRequest
from tpulab.inference.generate import decode_text, generate_batch
from tpulab.inference.trust import load_verified, read_key
from tpulab.model import kvcache as kv
from tpulab.model.decode import MAX_BATCH, batch_bucket
from tpulab.model.policies import Policy
from tpulab.model.sampling import SamplingConfig

MAX_BODY_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Batching, queueing and time limits of the service."""

    max_batch: int = field(16, f"requests decoded together, at most (1..{MAX_BATCH})")
    batch_window_ms: float = field(
        0.0,
        "how long the first request of a batch waits for company (requests "
        "arriving while a batch runs join the next one anyway)",
    )
    max_queue: int = field(64, "requests waiting beyond this are answered 503 with Retry-After")
    request_timeout_s: float = field(60.0, "server-side time limit of one request (504 after it)")
    retry_after_s: int = field(1, "the Retry-After a 503 carries")

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
        check(
            math.isfinite(self.request_timeout_s) and 0 < self.request_timeout_s <= 3600,
            f"request_timeout={self.request_timeout_s} must be in (0, 3600] seconds",
        )
        check(
            1 <= self.retry_after_s <= 3600,
            f"retry_after_s={self.retry_after_s} must be in [1, 3600]",
        )

    def buckets(self) -> list[int]:
        return sorted({batch_bucket(n) for n in range(1, self.max_batch + 1)})


class GenerateRequest(BaseModel):
    """POST /v1/generate body: types only; the bounds are ``sampling``'s. Unknown fields are
    rejected."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    prompt: str
    max_new: int = 32
    temperature: float = 0.8
    top_k: int = 0
    seed: int = 0
    cache: Policy = "fp32"


class QueueFull(Exception):
    pass


def _reject_constant(name: str):
    raise TpulabError(f"request holds the non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise TpulabError(f"request holds the number {text[:32]}, which is not finite in float64")
    return value


def parse_request(body: bytes, max_len: int) -> tuple[GenerateRequest, GenRequest]:
    """Bytes of a POST body -> (typed request, validated generation request); TpulabError says why
    not."""
    if len(body) > MAX_BODY_BYTES:
        raise TpulabError(f"request body is {len(body)} bytes, at most {MAX_BODY_BYTES}")
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
        req = GenerateRequest.model_validate(obj)
    except ValidationError as e:
        errs = e.errors(include_url=False, include_input=False, include_context=False)
        reasons = [f"{'.'.join(map(str, x['loc'])) or 'body'}: {x['msg']}" for x in errs[:4]]
        raise TpulabError("; ".join(reasons)) from None
    sampling = SamplingConfig(
        max_new=req.max_new, temperature=req.temperature, top_k=req.top_k, seed=req.seed
    )
    return req, GenRequest.of(req.prompt, sampling, max_len)


@dataclasses.dataclass
class _Job:
    req: GenRequest
    policy: str
    future: concurrent.futures.Future
    enqueued: float
    deadline: float


class Batcher:
    """The bounded queue and the one thread that turns queued requests into device batches."""

    def __init__(self, engines: dict, cfg: ServeConfig, *, clock=time.monotonic):
        self.engines, self.cfg, self.clock = engines, cfg, clock
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

    def submit(self, req: GenRequest, policy: str) -> concurrent.futures.Future:
        now = self.clock()
        job = _Job(req, policy, concurrent.futures.Future(), now, now + self.cfg.request_timeout_s)
        with self.cond:
            if len(self.queue) >= self.cfg.max_queue:
                raise QueueFull
            self.queue.append(job)
            self.cond.notify_all()
        return job.future

    def _take(self) -> list[_Job]:
        """Wait for a request, then for its window (or a full batch); pop up to max_batch of its
        policy."""
        with self.cond:
            while not self.queue and not self.stopped:
                self.cond.wait()
            if self.stopped:
                return []
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
        now = self.clock()
        live = []
        for j in jobs:
            if j.future.cancelled() or not j.future.set_running_or_notify_cancel():
                continue
            if now > j.deadline:
                j.future.set_exception(TimeoutError("expired in the queue"))
                continue
            live.append(j)
        return live

    def _run(self):
        while not self.stopped:
            jobs = self._take()
            if not jobs:
                continue
            t0 = self.clock()
            try:
                outs = generate_batch(self.engines[jobs[0].policy], [j.req for j in jobs])
            except (
                Exception
            ) as e:  # reported to every waiting client (500), never kills the batcher
                for j in jobs:
                    j.future.set_exception(e)
                continue
            t1 = self.clock()
            self.batches[len(jobs)] += 1
            for j, ids in zip(jobs, outs):
                j.future.set_result(
                    {
                        "ids": ids,
                        "batch": len(jobs),
                        "queue_ms": (t0 - j.enqueued) * 1e3,
                        "compute_ms": (t1 - t0) * 1e3,
                    }
                )


class Service:
    """The verified artifact set, one engine per cache policy, the batcher, and readiness."""

    def __init__(
        self,
        artifacts: str | Path,
        cfg: ServeConfig = ServeConfig(),
        *,
        run_dir=None,
        key_file=None,
    ):
        self.cfg = cfg
        self.art = load_verified(artifacts, run_dir, read_key(key_file))
        self.engines = {p: self.art.engine(p) for p in kv.POLICIES}
        self.batcher = Batcher(self.engines, cfg)
        self.ready = threading.Event()
        self.warmup_error: str | None = None
        self.on_warmup_failure = (
            None  # set by ``serve``: stop the server rather than answer 503 forever
        )

    def warm_up(self) -> None:
        """Compile the loop for every policy and batch bucket (one executable each, reused
        after)."""
        try:
            probe = GenRequest.of("a", SamplingConfig(max_new=1, temperature=0.0), self.art.max_len)
            for engine in self.engines.values():
                for b in self.cfg.buckets():
                    generate_batch(engine, [probe] * b)
            self.batcher.start()
            self.ready.set()
        except Exception as e:  # not swallowed: printed, /healthz reports it, and the server stops
            self.warmup_error = f"{type(e).__name__}: {e}"
            print(f"error: warm-up failed: {self.warmup_error}", file=sys.stderr, flush=True)
            if self.on_warmup_failure is not None:
                self.on_warmup_failure()

    def compiled_variants(self) -> dict[str, int]:
        return {p: e.compiled_variants()["generate"] for p, e in self.engines.items()}

    async def generate(self, body: bytes) -> JSONResponse:
        try:
            req, gen = parse_request(body, self.art.max_len)
        except TpulabError as e:
            return JSONResponse({"detail": str(e)}, status_code=422)
        try:
            fut = self.batcher.submit(gen, req.cache)
        except QueueFull:
            return JSONResponse(
                {"detail": f"queue full ({self.cfg.max_queue} requests waiting); retry later"},
                status_code=503,
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        try:
            out = await asyncio.wait_for(asyncio.wrap_future(fut), self.cfg.request_timeout_s)
        except TimeoutError:
            fut.cancel()
            return JSONResponse(
                {
                    "detail": f"request exceeded the server's time limit of "
                    f"{self.cfg.request_timeout_s:g} s"
                },
                status_code=504,
            )
        return JSONResponse(
            {
                "text": decode_text(out["ids"]),
                "tokens": len(out["ids"]),
                "prompt": req.prompt,
                "max_new": req.max_new,
                "cache": req.cache,
                "seed": req.seed,
                "batch": out["batch"],
                "queue_ms": out["queue_ms"],
                "compute_ms": out["compute_ms"],
                "manifest_sha256": self.art.manifest_sha256,
            }
        )


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=service.warm_up, name="warm-up", daemon=True).start()
        yield
        service.batcher.stop()

    app = FastAPI(title="tpulab generate", lifespan=lifespan)

    @app.get("/healthz")
    async def healthz():
        if service.ready.is_set():
            return {"status": "ready"}
        status = f"warm-up failed: {service.warmup_error}" if service.warmup_error else "warming up"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/model")
    async def model():
        return {
            **service.art.identity(),
            "serving": dataclasses.asdict(service.cfg),
            "batch_buckets": service.cfg.buckets(),
        }

    @app.get("/v1/stats")
    async def stats():
        return {
            "batches": {str(k): v for k, v in sorted(service.batcher.batches.items())},
            "queued": len(service.batcher.queue),
            "compiled_variants": service.compiled_variants(),
        }

    @app.post("/v1/generate")
    async def generate(request: Request):
        if not service.ready.is_set():
            return JSONResponse(
                {"detail": "warming up"}, status_code=503, headers={"Retry-After": "1"}
            )
        return await service.generate(await request.body())

    return app


def serve(
    artifacts: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    cfg: ServeConfig = ServeConfig(),
    *,
    run_dir=None,
    key_file=None,
) -> None:
    import uvicorn

    service = Service(
        artifacts, cfg, run_dir=run_dir, key_file=key_file
    )  # raises before anything listens
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host=host, port=port, log_level="warning")
    )
    service.on_warmup_failure = lambda: setattr(server, "should_exit", True)
    print(
        f"serving {service.art.root} (manifest {service.art.manifest_sha256[:12]}, checkpoint step "
        f"{service.art.manifest['source']['checkpoint_step']}, verified by "
        f"{service.art.verification['mode']}) "
        f"on http://{host}:{port}",
        flush=True,
    )
    server.run()
    if service.warmup_error:
        raise TpulabError(f"warm-up failed: {service.warmup_error}", exit_code=1)
