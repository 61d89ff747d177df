"""JAX's distributed runtime for a trainer process: joining its job, and a SIGTERM notice that
every process acts on at the same step (``AgreedPreemption``).

A trainer joins a multi-process job from its environment, with no flags:
- started by ``tpulab launch`` (tpulab.orchestrate.launch): ``TPULAB_COORDINATOR``,
  ``TPULAB_NUM_PROCESSES`` and ``TPULAB_PROCESS_ID`` name the loopback coordinator and this
  process; CPU collectives use gloo;
- on a multi-host Cloud TPU slice (``gcloud compute tpus tpu-vm ssh ... --worker=all``): the TPU
  environment (``TPU_WORKER_HOSTNAMES`` with several hosts, or ``TPULAB_DISTRIBUTED=auto``) and
  JAX's own cluster detection;
- otherwise it stays a single process (one host, however many local devices).

Failure detection. A process that dies is noticed by the launcher, which tears the others down (see
launch.py); without the launcher, JAX's coordination service notices missing heartbeats after
``HEARTBEAT_TIMEOUT_S``. A process that is alive but stuck (SIGSTOP, a hung filesystem) keeps the
heartbeat happy while the others wait inside a collective forever (jax-ml/jax#38503): the stall
watchdog, which lives in tpulab.train.watchdog (``StallWatchdog``; the CLI turns it on in every
multi-process job), notices that no step finished in time, dumps every thread's stack and exits
with ``ExitCode.STALLED``.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np

from tpulab.errors import TpulabError
from tpulab.train.preemption import Preemption

ENV_COORDINATOR = "TPULAB_COORDINATOR"
ENV_NUM_PROCESSES = "TPULAB_NUM_PROCESSES"
ENV_PROCESS_ID = "TPULAB_PROCESS_ID"
ENV_MODE = (
    "TPULAB_DISTRIBUTED"  # "auto": let JAX detect the cluster (TPU VM); "off": never initialize
)

INIT_TIMEOUT_S = 120  # every process must reach the coordinator within this
HEARTBEAT_TIMEOUT_S = 30  # the coordination service declares a silent process dead after this


def _tpu_multihost() -> bool:
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize_from_env(init_timeout_s: int = INIT_TIMEOUT_S) -> dict:
    """Join the job this process belongs to (before any other JAX call); returns what was done."""
    mode = os.environ.get(ENV_MODE, "")
    if mode == "off":
        return {"distributed": False}
    import jax

    coordinator = os.environ.get(ENV_COORDINATOR)
    if coordinator:
        try:
            n, pid = int(os.environ[ENV_NUM_PROCESSES]), int(os.environ[ENV_PROCESS_ID])
        except (KeyError, ValueError):
            raise TpulabError(
                f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} are missing or "
                "not integers (start multi-process runs with tpulab launch)"
            ) from None
        if (
            pid != 0
        ):  # the runtime aborts the process (SIGABRT) when it cannot connect: find out first
            _wait_for_coordinator(coordinator, init_timeout_s, pid, n)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs = {"coordinator_address": coordinator, "num_processes": n, "process_id": pid}
        where = f"coordinator {coordinator} (process {pid} of {n})"
    elif mode == "auto" or _tpu_multihost():
        kwargs, where = {}, "the TPU slice's coordinator"
    else:
        return {"distributed": False}
    try:
        jax.distributed.initialize(
            **kwargs,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        )
    except Exception as e:  # noqa: BLE001 - the runtime's errors are long C++ status dumps
        raise _fail_to_join(
            where, init_timeout_s, (str(e).splitlines() or [type(e).__name__])[0][:200]
        ) from None
    return {
        "distributed": True,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
    }


def _fail_to_join(where: str, timeout_s: int, why: str) -> TpulabError:
    return TpulabError(
        f"joining {where} failed within {timeout_s}s: {why}. Every process must run the same "
        "command at the same time: on a TPU slice use gcloud compute tpus tpu-vm ssh ... "
        "--worker=all --command '...'; locally use tpulab launch --processes N"
    )


def _wait_for_coordinator(address: str, timeout_s: int, pid: int, n: int) -> None:
    import socket

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except (OSError, ValueError) as e:
            if time.monotonic() >= deadline:
                raise _fail_to_join(
                    f"coordinator {address} (process {pid} of {n})",
                    timeout_s,
                    f"nothing answers there ({getattr(e, 'strerror', None) or e})",
                ) from None
            time.sleep(0.2)


class AgreedPreemption(Preemption):
    """A SIGTERM notice every process acts on at the same step.

    Processes get the signal at slightly different moments; if each stopped on its own notice, one
    would save at step N while another entered step N+1's collectives and hung. Once JAX's
    distributed runtime is initialized it owns SIGTERM (its preemption notifier replaces Python's
    handler) and agrees with the other processes through the coordination service on the first
    sync point that all of them reach: ``multihost_utils.reached_preemption_sync_point``. The loop
    reads ``requested`` at the same points in every process, so the number of reads is the
    sync-point id. One process: the plain flag.
    """

    def __init__(self):
        self._local = False
        self._agreed = False
        self._reads = 0
        super().__init__()

    @property
    def requested(self) -> bool:
        import jax

        if jax.process_count() == 1:
            return self._local
        # Several processes: only the agreed answer counts (a notice one process saw before the
        # runtime took SIGTERM over is its own and would split the job).
        if not self._agreed:
            from jax.experimental import multihost_utils

            self._reads += 1
            self._agreed = bool(multihost_utils.reached_preemption_sync_point(self._reads))
        return self._agreed

    @requested.setter
    def requested(self, value: bool) -> None:
        self._local = bool(value)


def agree_identities(identities: dict[str, str]) -> None:
    """Every process of the job computed the same identities, or a one-line refusal naming the
    first that differs, on every process, before any write. Each process builds its own data,
    base, reference and (DPO) reference log-prob table, and process 0 alone records them: without
    this check a process training on other bytes would go unnamed."""
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    def gathered(words: list[str]) -> np.ndarray:  # [processes, len(words), 32]
        rows = np.stack(
            [np.frombuffer(hashlib.sha256(w.encode()).digest(), np.uint8) for w in words]
        )
        return np.asarray(multihost_utils.process_allgather(rows[None], tiled=True))

    names = sorted(identities)
    every = gathered(["\n".join(names)])  # the same names first: the next gather's shapes agree
    if not (every == every[0]).all():
        p = int(np.flatnonzero((every != every[0]).any(axis=(1, 2)))[0])
        raise TpulabError(f"process {p} names other identities than process 0 (these: {names})")
    every = gathered([identities[n] for n in names])
    differ = (every != every[0]).any(axis=2)  # [processes, names]
    if differ.any():
        p, i = (int(x[0]) for x in np.nonzero(differ))
        raise TpulabError(
            f"process {p} computed another {names[i]} identity than process 0 (this process: "
            f"{identities[names[i]][:16]}...): the processes do not train on the same bytes"
        )
