"""Record tests/goldens/pretrain_default_100.json with the code of an old checkout.

    git worktree add /tmp/old 09bc655 && cd /tmp/old
    JAX_PLATFORMS=cpu PYTHONPATH=src python tests/goldens/record_default_100.py RUN_DIR OUT.json

(from the tpulab checkout, path adjusted). The default config for 100 of its 300 scheduled steps.
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from tpulab.config import load
from tpulab.evidence.metrics import curve, read_records
from tpulab.proofs.state import data_position
from tpulab.train.config import RunConfig
from tpulab.train.loop import train
from tpulab.train.restore import load_model


def leaf_digests(state):
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]:
        a = np.asarray(x)
        h = hashlib.sha256(a.dtype.str.encode() + str(a.shape).encode() + a.tobytes())
        out[jax.tree_util.keystr(path)] = h.hexdigest()
    return out


def main(run_dir: Path, out: Path) -> None:
    cfg = load(RunConfig, Path("configs/default.yaml"), ["train.steps=100"])
    train(cfg, run_dir, progress=False)
    recs = read_records(run_dir)
    restored = load_model(run_dir)
    cpu = next(line for line in open("/proc/cpuinfo") if line.startswith("model name"))
    rec = {
        "losses": {str(k): v for k, v in sorted(curve(recs).items())},
        "val_losses": {str(r["step"]): r["val_loss"] for r in recs if r.get("event") == "eval"},
        "final_step": restored.step,
        "state_leaf_sha256": leaf_digests(restored.state),
        "data_position_sha256": data_position(restored.checkpoint_dir),
        "commit": subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip(),
        "cpu": " ".join(cpu.split(":")[1].split()[:2]),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "steps": 100,
        "config": "configs/default.yaml with train.steps=100 (schedule_steps stays 300)",
    }
    out.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
