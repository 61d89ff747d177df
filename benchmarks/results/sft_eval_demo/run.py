"""Demo-size post-training stage: pretrain configs/default.yaml, then the capstone's stage."""

import json
import os
import sys
import time
from pathlib import Path

from tpulab.process_setup import prepare


def main(out: Path) -> None:
    # prepare() sets the platform before anything imports JAX, and the tracking URI is set before
    # the trainer's modules load: the imports stay here, after both.
    from tpulab.tracking.store import sqlite_uri

    os.environ["MLFLOW_TRACKING_URI"] = sqlite_uri(out / "mlruns.db")
    from tpulab.config import load
    from tpulab.orchestrate.capstone import posttrain_stage
    from tpulab.train.config import RunConfig
    from tpulab.train.loop import train

    config = load(RunConfig, Path("configs/default.yaml"), [])
    t0 = time.monotonic()
    sp = out / "run" / "summary.json"
    if not sp.exists() or json.loads(sp.read_text()).get("final_step") != config.train.steps:
        train(config, out / "run", progress=False)
    t1 = time.monotonic()
    print(f"pretrain {t1 - t0:.1f} s load {os.getloadavg()}", flush=True)
    posttrain_stage(config, out / "run", out)
    t2 = time.monotonic()
    print(f"posttrain stage {t2 - t1:.1f} s load {os.getloadavg()}", flush=True)
    with open(out / "timing.json", "w") as f:
        json.dump({"pretrain_s": t1 - t0, "posttrain_s": t2 - t1, "load_end": os.getloadavg()}, f)


if __name__ == "__main__":
    prepare()
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out)
