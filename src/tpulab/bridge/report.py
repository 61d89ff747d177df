"""Half-page provenance reports: what ran where (as the backend reported it), and what the proof
found."""

from __future__ import annotations

from pathlib import Path

from tpulab.checkpoint.rundir import ResumeVerdict
from tpulab.evidence.metrics import read_records, starts
from tpulab.evidence.provenance import describe_hardware, git_commit
from tpulab.evidence.report_kit import table

METHOD_NOTES = {
    (
        "torch",
        "eager",
    ): "plain PyTorch on the CPU (the reference): torch autograd, torch.optim.Adam",
    (
        "torchax",
        "eager",
    ): 'torch autograd and torch.optim.Adam, tensors on torchax\'s "jax" device, op by op',
    ("torchax", "jit"): (
        "torchax.train.make_train_step (jax.value_and_grad of the torch loss) with optax.adam, "
        "one jax.jit per step; optimizer state checkpointed as optax leaves by tree path"
    ),
    ("torch_xla", "eager"): "torch autograd and torch.optim.Adam on the XLA device",
}


def device_line(device: dict) -> str:
    """The device as the backend reported it; TPU only when JAX/XLA said tpu."""
    if device.get("backend") == "torch-cpu":
        return (
            f"CPU ({device.get('device_kind')}) via torch, {device.get('torch_threads')} "
            "thread(s), not a TPU"
        )
    return describe_hardware(device)


def start_record(run_dir: Path) -> dict:
    lifetimes = starts(read_records(run_dir))
    return lifetimes[0] if lifetimes else {}


def shapes(cfg: dict) -> str:
    n, d, h = cfg["n"], cfg["d"], cfg["hidden"]
    drop = f", Dropout({cfg['dropout']})" if cfg.get("dropout") else ""
    return f"x ({n}, {d}), y ({n}, 1); MLP Linear({d}, {h}), ReLU{drop}, Linear({h}, 1)"


def _cache_line(details: dict) -> str:
    c = details.get("compile_cache")
    if not c:
        return "not recorded"
    r = c["processes"].get("resumed", {})
    if r.get("requests") is None:
        return f"{c['resumed_cache']}; no JAX compile (torch alone)"
    return f"{c['resumed_cache']}: {r['hits']} hits, {r['misses']} misses"


def write_proof_report(proof_dir: Path, verdict: ResumeVerdict) -> str:
    d = verdict.details  # the bridge proof's own: backend, method, negative_control, ...
    rec = start_record(Path(verdict.reference_dir))
    cfg, dev, ver = rec.get("config", {}), rec.get("device", {}), rec.get("versions", {})
    backend, method = d["backend"], d["method"]
    state = (
        "**bitwise identical** (curves and final state)"
        if verdict.identical
        else f"**NOT identical**: {verdict.summary}"
    )
    control = ""
    if d.get("negative_control"):
        control = (
            "\nNegative control: the checkpoints leave the generator state out, so the resumed run "
            "redraws augmentation noise (and dropout masks) from the seeds. The proof must say NOT "
            "identical; it says "
            + ("NOT identical: caught" if not verdict.identical else "identical: NOT caught")
            + ".\n"
        )
    workarounds = rec.get("torchax_workarounds")
    lines = [
        f"# Bridge kill/resume proof: {backend} / {method}",
        "",
        table(
            ["", ""],
            [
                ("device", device_line(dev)),
                ("dtype", rec.get("dtype", "?")),
                ("shapes", shapes(cfg) if cfg else "?"),
                (
                    "data",
                    f"full batch, seed {cfg.get('seed')}, augment sigma {cfg.get('augment')}, "
                    f"dropout {cfg.get('dropout')}",
                ),
                (
                    "optimizer",
                    f"Adam, lr {cfg.get('lr')}, {cfg.get('steps')} steps, checkpoint every "
                    f"{cfg.get('checkpoint_every')}",
                ),
                (
                    "bridge / method",
                    f"{backend} / {method}: {METHOD_NOTES.get((backend, method), '')}",
                ),
                (
                    "versions",
                    f"torch {ver.get('torch')}, torchax {ver.get('torchax')}, jax "
                    f"{ver.get('jax')}, jaxlib {ver.get('jaxlib')}",
                ),
                (
                    "torchax workarounds",
                    ", ".join(workarounds)
                    if workarounds
                    else "none"
                    if backend == "torchax"
                    else "n/a",
                ),
                ("commit", git_commit() or "unknown"),
                (
                    "verdict",
                    f"{state}; {verdict.steps_compared} steps; SIGKILL after step "
                    f"{verdict.kill_step}, fresh process resumed from step "
                    f"{verdict.resumed_from_step} ({d['steps_redone']} steps redone)",
                ),
                ("final state compared", d.get("final_state_compared", "not compared")),
                ("resumed process's compile cache", _cache_line(d)),
            ],
        ),
        control,
        "![reference, killed and resumed curves](overlay.png)",
        "",
    ]
    text = "\n".join(lines)
    (proof_dir / "report.md").write_text(text)
    return text
