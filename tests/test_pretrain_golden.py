"""Pretraining is the ``pretrain`` objective of the one loop, and stays bitwise what it was.

The goldens in tests/goldens/ were recorded with the code before objectives existed (commit
09bc655): every per-step loss, every validation loss, a sha256 of every leaf of the final
TrainState and of the Grain data position. The run here must reproduce all of them exactly.

XLA:CPU compiles for the host's CPU, so the last bits depend on the CPU model (at 445bae3 every
tiny loss after step 0 differed in its last bits between the 09bc655 host and an AMD family 26
host, with the same code and jax). Each golden is read from ``goldens/cpu-<fingerprint>/`` when
it was recorded, with the same old code, on a CPU like this one, else from the 09bc655 host's set
at the top (``goldens/record.py`` records both ways and defines the fingerprint).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, tiny_config
from goldens.record import cpu_fingerprint, leaf_digests  # one hashing for goldens and runs
from tpulab.config import load
from tpulab.evidence.metrics import curve, read_records
from tpulab.proofs.state import data_position
from tpulab.train.config import RunConfig
from tpulab.train.restore import load_model

GOLDENS = Path(__file__).parent / "goldens"
OLD_CODE = "09bc655"  # the code before objectives existed, which every golden was recorded with


def golden(name: str) -> dict:
    """This CPU's recording of ``name`` if there is one, else the 09bc655 host's."""
    own = GOLDENS / f"cpu-{cpu_fingerprint()}" / name
    rec = json.loads((own if own.exists() else GOLDENS / name).read_text())
    assert rec["commit"].startswith(OLD_CODE), rec["commit"]
    if own.exists():
        assert rec["cpu_fingerprint"] == cpu_fingerprint()
    else:
        rec["cpu"] += (
            f"; none recorded for this CPU (fingerprint {cpu_fingerprint()}): if only the last "
            "bits differ, record this CPU's with tests/goldens/record.py at 09bc655"
        )
    return rec


def run_record(run_dir: Path) -> dict:
    recs = read_records(run_dir)
    restored = load_model(run_dir)
    return {
        "losses": {str(k): v for k, v in sorted(curve(recs).items())},
        "val_losses": {str(r["step"]): r["val_loss"] for r in recs if r.get("event") == "eval"},
        "final_step": restored.step,
        "state_leaf_sha256": leaf_digests(restored.state),
        "data_position_sha256": data_position(restored.checkpoint_dir),
    }


def assert_matches_golden(got: dict, golden: dict) -> None:
    where = f"(golden recorded at {golden['commit'][:7]} on {golden['cpu']}, jax {golden['jax']})"
    diff = [s for s in golden["losses"] if got["losses"].get(s) != golden["losses"][s]]
    assert not diff, f"loss differs from step {diff[0]} {where}"
    assert got["losses"].keys() == golden["losses"].keys()
    assert got["val_losses"] == golden["val_losses"], where
    assert got["final_step"] == golden["final_step"]
    assert got["state_leaf_sha256"].keys() == golden["state_leaf_sha256"].keys()
    leaves = [k for k, v in golden["state_leaf_sha256"].items() if got["state_leaf_sha256"][k] != v]
    assert not leaves, f"final state differs at {leaves[0]} {where}"
    assert got["data_position_sha256"] == golden["data_position_sha256"], where


def test_tiny_pretraining_is_bitwise_the_golden_run(trained_run):
    """configs/tiny.yaml trained 40 steps by the loop: conftest.trained_run is exactly that run
    (``train(tiny_config(), ...)``, built once per pytest run), so it is checked here instead of a
    second identical training."""
    assert load(RunConfig, trained_run / "config.yaml") == tiny_config()
    assert_matches_golden(run_record(trained_run), golden("pretrain_tiny.json"))


def test_the_golden_check_sees_a_one_ulp_change():
    """Negative control: the comparison is exact, so one flipped bit anywhere fails it."""
    rec = golden("pretrain_tiny.json")
    for mutate in ("loss", "leaf", "data"):
        got = json.loads(json.dumps(rec))
        if mutate == "loss":
            got["losses"]["7"] = float(np.nextafter(np.float32(got["losses"]["7"]), np.float32(9)))
        elif mutate == "leaf":
            key = sorted(got["state_leaf_sha256"])[3]
            got["state_leaf_sha256"][key] = "0" * 64
        else:
            got["data_position_sha256"] = {}
        with pytest.raises(AssertionError):
            assert_matches_golden(got, rec)
    # The two recordings of one run are different goldens: the 09bc655 host's and this CPU's
    # (when both exist) differ in their last bits, so the choice between them is not moot.
    own = GOLDENS / f"cpu-{cpu_fingerprint()}" / "pretrain_tiny.json"
    if own.exists():
        with pytest.raises(AssertionError, match="loss differs"):
            assert_matches_golden(rec, json.loads((GOLDENS / "pretrain_tiny.json").read_text()))


@pytest.mark.slow
def test_default_pretraining_is_bitwise_the_golden_run(default_run):
    """The default config (what `make demo` trains) for its first 100 of 300 steps, bitwise as
    recorded: its schedule is set by ``optim.schedule_steps`` (300), not ``train.steps``, so these
    100 steps are the first 100 of the demo's run. Their losses and both validation losses are the
    300-step golden's; the final state at step 100 is the 100-step golden (recorded with the same
    old code, 09bc655). A third of the full run's 185 s, the whole default model and schedule."""
    cfg = load(RunConfig, default_run / "config.yaml")  # conftest.default_run trained it
    assert cfg.optim.schedule_steps == 300 and cfg.train.steps == 100
    assert cfg == load(RunConfig, REPO / "configs" / "default.yaml", ["train.steps=100"])
    got = run_record(default_run)
    full = golden("pretrain_default.json")
    prefix = {k: v for k, v in full["losses"].items() if int(k) <= 100}
    assert got["losses"] == prefix and len(prefix) == 100
    assert got["val_losses"] == {k: v for k, v in full["val_losses"].items() if int(k) <= 100}
    assert_matches_golden(got, golden("pretrain_default_100.json"))
