"""Bridge checkpoints: one directory per step, written whole or not at all, verified before use.

    RUN/checkpoints/step_00000010/
        state.pt              torch.save of {model, optimizer, step, rng, [device_rng]} (CPU only)
        meta.json             backend, method, config, step, torch/torchax versions, rng_saved
        tpulab_manifest.json  sha256 of both files; written last: the completion marker

The directory is assembled under a temporary name, every file fsynced, then renamed into place
(tpulab.checkpoint.files). The newest directory is the resume point; a checksum mismatch there is
an error (never a silent fall back to an older step), and its meta.json is checked against the
run before its state is loaded.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import torch

from tpulab.bridge.config import BridgeConfig
from tpulab.checkpoint.files import (
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    verify_manifest,
    write_manifest,
)
from tpulab.checkpoint.rundir import CHECKPOINTS
from tpulab.config import identity_diff
from tpulab.errors import CheckpointError

CKPT_DIR = CHECKPOINTS
KEEP = 2
_STEP_RE = re.compile(r"^step_(\d{8})$")


def step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()
    ]
    return sorted(found)


def save(run_dir: str | Path, step: int, state: dict, meta: dict) -> Path:
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    buf = io.BytesIO()
    torch.save({**state, "step": step}, buf)
    atomic_write_bytes(tmp / "state.pt", buf.getvalue())
    atomic_write_json(tmp / "meta.json", {**meta, "step": step})
    write_manifest(tmp, extra={"step": step})
    if final.exists():  # a resumed run redoing a step it had already saved: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    for _, old in step_dirs(run_dir)[:-KEEP]:
        shutil.rmtree(old)
    return final


def latest(run_dir: str | Path) -> Path | None:
    """The newest checkpoint directory, verified; CheckpointError if it is corrupt."""
    dirs = step_dirs(run_dir)
    if not dirs:
        return None
    path = dirs[-1][1]
    verify_manifest(path)
    return path


def read_meta(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{path}/meta.json is unreadable (corrupt checkpoint)") from None


def check_identity(
    meta: dict, path: Path, backend: str, method: str, cfg: BridgeConfig, force: bool
) -> list[str]:
    """Refuse a checkpoint from another backend, method or config unless forced; return what
    differed."""
    from tpulab.config import to_dict

    diffs = []
    if meta.get("backend") != backend:
        diffs.append(f"backend: {meta.get('backend')!r} -> {backend!r}")
    if meta.get("method") != method:
        diffs.append(f"method: {meta.get('method')!r} -> {method!r}")
    diffs += identity_diff(BridgeConfig, meta.get("config") or {}, to_dict(cfg))
    if diffs and not force:
        raise CheckpointError(
            f"{path} belongs to another run ({'; '.join(diffs)}); "
            "use a fresh --run-dir, or --force to load it anyway"
        )
    old = meta.get("config") or {}
    if (old.get("d"), old.get("hidden"), bool(old.get("dropout"))) != (
        cfg.d,
        cfg.hidden,
        bool(cfg.dropout),
    ):
        raise CheckpointError(
            f"{path} holds a model of another shape (d, hidden, dropout layer); "
            "even --force cannot load it"
        )
    if force and (meta.get("method") == "jit") != (method == "jit"):
        raise CheckpointError(
            f"{path} holds {meta.get('method')} optimizer state, which the {method} method "
            "cannot load, even with --force"
        )
    return diffs


def load_state(path: Path) -> dict:
    """Verify the manifest again (the file may have changed since ``latest``), then load CPU
    tensors."""
    verify_manifest(path)
    try:
        return torch.load(
            io.BytesIO((path / "state.pt").read_bytes()), map_location="cpu", weights_only=True
        )
    except Exception as e:  # the checksum matched, so this is a format problem; say which file
        raise CheckpointError(
            f"{path}/state.pt cannot be loaded: {type(e).__name__}: {str(e).splitlines()[0]}"
        ) from None


def final_state_verdict(reference_dir: str | Path, run_dir: str | Path) -> dict:
    """The two runs' newest checkpoints compared bitwise, whole: model weights, optimizer state
    (torch Adam's moments and step counts, or optax's leaves), step and every saved generator state
    (torch's CPU generator, the augmentation generator, the device key). Equal curves can hide a
    different optimizer moment or a generator that has not been drawn from yet."""
    from tpulab.checkpoint.compare import compare_trees

    paths = {}
    for d in (reference_dir, run_dir):
        path = latest(d)
        if path is None:
            raise CheckpointError(f"{d} holds no bridge checkpoint to compare")
        paths[d] = path
    ref, run = load_state(paths[reference_dir]), load_state(paths[run_dir])
    if ref["step"] != run["step"]:
        raise CheckpointError(
            f"final checkpoints are at different steps: {ref['step']} ({paths[reference_dir]}) vs "
            f"{run['step']} ({paths[run_dir]})"
        )
    n, first = compare_trees(ref, run)
    parts = [
        k if not isinstance(v, dict) or k == "model" else f"{k} ({', '.join(v)})"
        for k, v in ref.items()
    ]
    return {
        "final_state_identical": first is None,
        "first_differing_leaf": first,
        "leaves_compared": n,
        "final_state_step": int(run["step"]),
        "final_state_compared": "; ".join(parts),
    }
