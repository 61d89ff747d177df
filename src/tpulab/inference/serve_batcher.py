"""The model being served and the batcher that runs queued requests on it.

Valid requests join a bounded queue (full: ``QueueFull``, answered 503 with Retry-After). One
batcher thread takes every waiting request of the oldest runnable one's cache policy (up to
``max_batch``, and up to the largest batch bucket compiled so far;
requests that arrived while the previous batch ran are all there), optionally waiting
``batch_window_ms`` for more (default 0: measured on CPU, a 5 ms window cost more than it
gathered), and runs them as one dispatch of the compiled loop, each row with its own prompt
length, max_new, temperature, top_k and seed; a row's tokens do not depend on its batch-mates, so
a batch runs at the smallest compiled bucket that holds it (3 requests at bucket 8 while 4 still
compiles). A policy with no bucket compiled yet is not runnable: its requests wait in the queue
for ``mark_compiled`` while the others run. A request past its deadline in the queue is dropped.
``swap`` replaces the model between batches: a batch already taken finishes on the model it was
taken with, and each result names it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from tpulab.errors import TpulabError
from tpulab.inference.config import ServeConfig
from tpulab.inference.generate import Request as GenerationRequest
from tpulab.inference.generate import generate_batch
from tpulab.model import kvcache as kv

if TYPE_CHECKING:
    from tpulab.inference.artifacts import ArtifactSet
    from tpulab.model.decode import Engine


class QueueFull(Exception):
    pass


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

    def serving(self, policies: tuple[str, ...]) -> Model:
        """This model with the engines of ``policies`` alone (the ones compiled and served)."""
        return dataclasses.replace(self, engines={p: self.engines[p] for p in policies})

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
        self.compiled: dict[str, list[int]] = {}  # policy -> batch buckets compiled, ascending
        self.thread = threading.Thread(target=self._run, name="batcher", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        """No batch starts after this; requests still queued are cancelled (the drain has
        answered their clients already)."""
        with self.cond:
            self.stopped = True
            for j in self.queue:
                j.future.cancel()
            self.queue.clear()
            self.cond.notify_all()

    def swap(self, model: Model, compiled: dict[str, list[int]]) -> Model | None:
        """Serve ``model``, whose loop is compiled for ``compiled`` (policy -> batch buckets),
        from the next batch on; the batch running now finishes on the old one."""
        with self.cond:
            old, self.model = self.model, model
            self.compiled = {p: sorted(b) for p, b in compiled.items()}
            self.cond.notify_all()
        return old

    def mark_compiled(self, model: Model, policy: str, bucket: int) -> None:
        """``model``'s loop for ``policy`` now runs ``bucket`` rows without compiling (ignored when
        ``model`` is no longer the one served)."""
        with self.cond:
            if model is self.model:
                self.compiled[policy] = sorted({*self.compiled.get(policy, ()), bucket})
                self.cond.notify_all()

    def submit(self, req: GenerationRequest, policy: str) -> concurrent.futures.Future:
        now = self.clock()
        job = _Job(req, policy, concurrent.futures.Future(), now, now + self.cfg.request_timeout_s)
        with self.cond:
            if len(self.queue) >= self.cfg.max_queue:
                raise QueueFull
            self.queue.append(job)
            self.cond.notify_all()
        return job.future

    def _take(self) -> tuple[list[_Job], Model | None, int]:
        """Wait for a request of a policy with a compiled bucket, then for its window (or a full
        batch); pop up to max_batch of its policy (at most the largest compiled bucket), with the
        model that will run them and the bucket they run at."""
        with self.cond:
            first = None
            while not self.stopped:
                first = next((j for j in self.queue if self.compiled.get(j.policy)), None)
                if first is not None:
                    break
                self.cond.wait()  # a request, or a compile that makes a waiting one runnable
            if self.stopped:
                return [], None, 0
            cap = min(self.cfg.max_batch, self.compiled[first.policy][-1])
            close = first.enqueued + self.cfg.batch_window_ms / 1000
            while not self.stopped:
                same = sum(1 for j in self.queue if j.policy == first.policy)
                left = close - self.clock()
                if same >= cap or left <= 0:
                    break
                self.cond.wait(left)
            jobs, keep = [], collections.deque()
            for j in self.queue:
                (jobs if j.policy == first.policy and len(jobs) < cap else keep).append(j)
            self.queue = keep
            model, buckets = self.model, self.compiled[first.policy]
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
        return live, model, min((b for b in buckets if b >= len(live)), default=0)

    def _run(self):
        while not self.stopped:
            jobs, model, bucket = self._take()
            if not jobs:
                continue
            t0 = self.clock()
            try:
                engine = model.engines[jobs[0].policy]
                outs = generate_batch(engine, [j.req for j in jobs], batch=bucket)
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
