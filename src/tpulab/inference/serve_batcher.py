"""The model being served and the batcher that runs queued requests on it.

Valid requests join a bounded queue (full: ``QueueFull``, answered 503 with Retry-After). One
batcher thread takes every waiting request of the oldest one's cache policy (up to ``max_batch``;
requests that arrived while the previous batch ran are all there), optionally waiting
``batch_window_ms`` for more (default 0: measured on CPU, a 5 ms window cost more than it
gathered), and runs them as one dispatch of the compiled loop, each row with its own prompt
length, max_new, temperature, top_k and seed; a row's tokens do not depend on its batch-mates. A
request past its deadline in the queue is dropped. ``swap`` replaces the model between batches: a
batch already taken finishes on the model it was taken with, and each result names it.
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
