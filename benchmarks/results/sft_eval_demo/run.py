"""Demo-size post-training stage: pretrain configs/default.yaml, then the capstone's stage."""
import json, os, sys, time
from pathlib import Path
from tpulab.process_setup import prepare
prepare()
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
from tpulab.tracking.store import sqlite_uri
os.environ["MLFLOW_TRACKING_URI"] = sqlite_uri(out / "mlruns.db")
from tpulab.config import load
from tpulab.train.config import RunConfig
from tpulab.train.loop import train
from tpulab.orchestrate.capstone import posttrain_stage
config = load(RunConfig, Path("configs/default.yaml"), [])
t0 = time.monotonic()
sp = out / "run" / "summary.json"
if not sp.exists() or json.loads(sp.read_text()).get("final_step") != config.train.steps:
    train(config, out / "run", progress=False)
t1 = time.monotonic()
print(f"pretrain {t1 - t0:.1f} s load {os.getloadavg()}", flush=True)
section = posttrain_stage(config, out / "run", out)
t2 = time.monotonic()
print(f"posttrain stage {t2 - t1:.1f} s load {os.getloadavg()}", flush=True)
json.dump({"pretrain_s": t1 - t0, "posttrain_s": t2 - t1, "load_end": os.getloadavg()},
          open(out / "timing.json", "w"))
