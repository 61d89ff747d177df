"""Record a pretraining golden (tests/goldens/) with the code of an old checkout.

    git worktree add /tmp/old 09bc655
    cd /tmp/old && JAX_PLATFORMS=cpu PYTHONPATH=src python /path/to/tpulab/tests/goldens/record.py \
        CONFIG RUN_DIR OUT.json [--set KEY=VALUE ...]

The goldens: ``pretrain_tiny.json`` (configs/tiny.yaml, 40 steps), ``pretrain_default.json``
(configs/default.yaml, 300 steps) and ``pretrain_default_100.json`` (the same with
``--set train.steps=100``: the first 100 of its 300 scheduled steps).

XLA:CPU compiles for the host's CPU (LLVM's host CPU name and features), so the last bits of a
run depend on the CPU model: the top-level files were recorded on the 09bc655 host (an "AMD
EPYC" not fingerprinted then), and ``cpu-<fingerprint>/`` holds the same goldens recorded with
the same old code on another CPU (``cpu_fingerprint``: vendor, family, model and vector ISA flags).
On a CPU with neither, tests/test_pretrain_golden.py runs this itself (``record_here``).
"""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

# The flags that change what LLVM may emit for XLA:CPU's kernels (vector ISA and FMA); flags of
# the hypervisor or the clock do not, so they do not split a CPU model into two fingerprints.
_ISA = re.compile(r"^(sse\S*|ssse3|avx\S*|fma\S*|f16c|amx\S*|bmi\S*|vaes|vpclmulqdq|gfni)$")


def cpu_fingerprint() -> str:
    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        k, _, v = line.partition(":")
        info.setdefault(k.strip(), v.strip())
        if not line.strip():
            break  # the first processor is enough: the cores of one VM are one model
    flags = sorted(f for f in info.get("flags", "").split() if _ISA.match(f))
    key = " ".join(
        [info.get("vendor_id", "?"), info.get("cpu family", "?"), info.get("model", "?")]
    )
    return hashlib.sha256((key + " " + " ".join(flags)).encode()).hexdigest()[:12]


def leaf_digests(state):
    import jax
    import numpy as np

    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]:
        a = np.asarray(x)
        h = hashlib.sha256(a.dtype.str.encode() + str(a.shape).encode() + a.tobytes())
        out[jax.tree_util.keystr(path)] = h.hexdigest()
    return out


def main(config: Path, run_dir: Path, out: Path, overrides: list[str]) -> None:
    import jax

    from tpulab.config import load
    from tpulab.evidence.metrics import curve, read_records
    from tpulab.proofs.state import data_position
    from tpulab.train.config import RunConfig
    from tpulab.train.loop import train
    from tpulab.train.restore import load_model

    cfg = load(RunConfig, config, overrides)
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
        "cpu_fingerprint": cpu_fingerprint(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "steps": cfg.train.steps,
        "config": " ".join([str(config), *overrides]),
    }
    out.write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    plain = [a for i, a in enumerate(args) if a != "--set" and (i == 0 or args[i - 1] != "--set")]
    main(Path(plain[0]), Path(plain[1]), Path(plain[2]), sets)
