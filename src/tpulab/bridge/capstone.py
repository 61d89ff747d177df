"""The bridge stage of `tpulab capstone`: three kill/resume proofs, the negative control, the
comparison."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tpulab.bridge.config import BridgeConfig
from tpulab.checkpoint.rundir import ResumeVerdict, RunDir
from tpulab.evidence.report_kit import table

# Small enough for ~1.5 minutes on 2 CPU cores; augmentation and dropout on, so the generator state
# matters.
PROOF_CONFIG = BridgeConfig(n=128, steps=24, checkpoint_every=8, augment=0.1, dropout=0.1)
PROOFS = (("torch", "eager"), ("torchax", "eager"), ("torchax", "jit"))
NEGATIVE_CONTROL = "negative-control-torch"
# The comparison: the default regression for 100 steps, one checkpoint (it reads only the curves);
# 200 steps cost torchax eager ~4 CPU-s more.
COMPARE_CONFIG = BridgeConfig(steps=100, checkpoint_every=100)


def proof_dirs(out_dir: str | Path) -> list[Path]:
    """The proofs' dirs under out_dir/bridge: their children run untracked (``--no-track``)."""
    root = Path(out_dir) / "bridge"
    return [root / f"proof-{b}-{m}" for b, m in PROOFS] + [root / NEGATIVE_CONTROL]


def capstone_stage(out_dir: str | Path, env: dict | None = None) -> str:
    """Run the bridge proofs and the comparison under out_dir/bridge; return the report's Markdown
    section. ``env`` is added to every child's environment (the capstone's MLflow store)."""
    from tpulab.bridge.compare import compare
    from tpulab.bridge.prove import prove

    out_dir = Path(out_dir)
    root = out_dir / "bridge"
    t0 = time.monotonic()
    # The children share one JAX compilation cache: torchax eager compiles every op on first use,
    # and each proof starts three processes. A cache the user already set wins.
    env = {
        **(env or {}),
        "JAX_COMPILATION_CACHE_DIR": os.environ.get(
            "JAX_COMPILATION_CACHE_DIR", str(root / "jax-cache")
        ),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    # The proofs' children are untracked (the comparison's runs are the bridge's tracked ones) and
    # every resumed process shares the cache: the Transformer resume proof is the cold-cache one.
    rows = []
    dirs = proof_dirs(out_dir)
    for (backend, method), d in zip(PROOFS, dirs):
        v = prove(PROOF_CONFIG, backend, method, d, env=env, warm_resume_cache=True, track=False)
        rows.append((f"{backend}/{method}", v, d))
    d = dirs[-1]
    # The control's reference is torch/eager's (the same config; the switch it turns off acts
    # only on a resume): one torch process fewer. Its killed and resumed runs are its own.
    v = prove(
        PROOF_CONFIG,
        "torch",
        "eager",
        d,
        restore_rng=False,
        env=env,
        warm_resume_cache=True,
        track=False,
        reference_dir=RunDir(dirs[0]).proof.reference.root,
    )
    rows.append(("torch/eager, generator state left out (negative control)", v, d))
    cmp = compare(COMPARE_CONFIG, root / "compare", env=env)

    rel = lambda p: p.relative_to(out_dir).as_posix()  # noqa: E731
    shown = ("n", "d", "hidden", "lr", "steps", "checkpoint_every", "augment", "dropout")
    lines = [
        "## Bridge capstone: a torch MLP through torchax, killed, resumed, compared",
        "",
        f"Proof config: {json.dumps({k: getattr(PROOF_CONFIG, k) for k in shown})}, float32.",
        "",
    ]
    cells = []
    for label, v, d in rows:
        v = ResumeVerdict.from_dict(v)
        state = (
            "bitwise identical (curves and final state)"
            if v.identical
            else f"NOT identical (step {v.first_differing_step}, state "
            f"{v.details['first_differing_leaf'] or 'identical'})"
        )
        if v.details.get("negative_control"):
            state += ": caught" if not v.identical else ": NOT caught"
        proof = RunDir(d).proof.root
        cells.append(
            (
                label,
                state,
                v.kill_step,
                v.resumed_from_step,
                f"[report]({rel(proof / 'report.md')})",
                f"[overlay]({rel(proof / 'overlay.png')})",
            )
        )
    headers = ["run", "verdict", "killed after", "resumed from", "report", "overlay"]
    lines += [
        table(headers, cells),
        "",
        "The negative control reuses torch/eager's uninterrupted reference (the same config; "
        "leaving the generator state out acts only on a resume); its killed and resumed runs are "
        "its own.",
        "",
        "### Same seed, every runtime this machine runs",
        "",
        cmp["markdown"],
        f"![cross-runtime curves]({rel(root / 'compare' / 'compare.png')})",
        "",
    ]
    for s in cmp["skipped"]:
        lines.append(f"Skipped {s['backend']}/{s['method']}: {s['reason']}")
    lines.append(f"\n(bridge stage took {time.monotonic() - t0:.0f} s)\n")
    return "\n".join(lines)
