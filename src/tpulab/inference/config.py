"""The service's configuration: batching, queueing, time limits, readiness and drain bounds."""

from __future__ import annotations

import dataclasses
import math

from tpulab.config import check, field
from tpulab.model.decode import MAX_BATCH, batch_bucket
from tpulab.model.policies import POLICIES

MAX_BODY_BYTES = 64 * 1024  # a /v1/generate body past this is answered 413
DRAIN_MARGIN_S = 0.5  # answers cut by the drain are written this long before uvicorn's own bound
# Between readiness turning 503 and the listener closing: the event loop reads what the kernel
# accepted (a request parsed is answered; one unread is closed at shutdown). Read within a few ms
# here; 0.5 s leaves room on a loaded host and is 2.5% of the default 20 s drain bound.
LINGER_S = 0.5
# What the drain bound holds after the signal: the linger, then uvicorn's wait for the requests
# in flight (its bound: the rest less a margin for the exit itself, ``serve_stop.exit_now``).


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
    policies: tuple[str, ...] = field(
        ("fp32",),
        "cache policies served, the first one ready first (each costs one compile per batch "
        "bucket: 15 compiles and 271 s for all three at max_batch 16 on a loaded 2-core host); "
        "a request for another is answered 422",
    )

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
        _seconds(self.drain_timeout_s, "drain_timeout", lo=LINGER_S + 2 * DRAIN_MARGIN_S)
        _seconds(self.ready_timeout_s, "ready_timeout")
        check(
            isinstance(self.policies, tuple)
            and len(self.policies) >= 1
            and len(set(self.policies)) == len(self.policies)
            and all(p in POLICIES for p in self.policies),
            f"policies={self.policies} must be distinct names among {', '.join(POLICIES)}",
        )

    def http_drain_s(self) -> float:
        """uvicorn's own bound on the requests in flight, counted after the linger: the drain bound
        less the linger and a margin for the exit, so the process is gone by it (the handlers
        answer half a second before: ``Service.begin_drain``)."""
        return self.drain_timeout_s - LINGER_S - DRAIN_MARGIN_S

    def buckets(self) -> list[int]:
        return sorted({batch_bucket(n) for n in range(1, self.max_batch + 1)})

    def compile_order(self) -> list[tuple[str, int]]:
        """(policy, batch bucket) in the order they compile: the first policy's smallest bucket
        (readiness waits for it alone), every other policy's smallest, then the larger buckets."""
        b = self.buckets()
        return [(p, b[0]) for p in self.policies] + [(p, x) for x in b[1:] for p in self.policies]
