"""SFT's loss over one global batch is the same on 1 device, 4 virtual devices and 2 processes.

Three runs of the same tiny SFT config from the session's pretrained base: in this pytest process
with its 1 CPU device (mesh data=1; no process boundary is under test there); a `tpulab train`
process with 4 virtual CPU devices (``--xla_force_host_platform_device_count=4``, mesh data=4);
and two processes on JAX's distributed runtime over loopback (`tpulab launch --processes 2 --
train --config X`, mesh data=2). The children run with --no-track (MLflow is not checked
here). Each run's first step computes the objective's loss (and its gradient, applied) over the
same first global batch from the same base parameters, so the step-1 numbers are directly
comparable: the response-byte count (the loss's denominator, summed over the whole global batch)
must be equal exactly, the loss within ``RTOL``, and so must the objective's eval step over the
fixed evaluation batch after step 1 (the step-1 learning rate is 0, warm-up's first value: the
parameters are still the base's). Step 2's loss, after a real update, is held to the scale-out
proofs' curve tolerance (``LAYOUT_RTOL``).

Why ``RTOL`` = 1.5e-5: the loss is a sum of n = 8 x 32 = 256 non-negative float32 terms divided
by an exact integer count; summed in any order (per device, then across devices) its relative
error is at most (n - 1) u = 255 x 2^-24 = 1.5e-5 (Higham, recursive summation). Measured (at
5574cc8): step-1 loss 1.0e-7 (one float32 ulp) on 4 devices and on 2 processes, the gradient norm
bitwise, the eval 2.7e-7 and 8.9e-8; the differences are printed (``-s``).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from tpulab.evidence.metrics import read_records
from tpulab.libtpu_env import set_explicitly
from tpulab.proofs.scaleout import LAYOUT_RTOL

pytestmark = pytest.mark.slow

N_TERMS = 8 * 32  # batch x positions of the tiny config: the loss's summed terms
RTOL = (N_TERMS - 1) * 2.0**-24


def sft_config(base, mesh_data: int):
    return tiny_config(
        "objective.kind=sft",
        f"objective.init={base}",
        "train.steps=2",
        "train.eval_every=1",
        "checkpoint.save_every=2",
        f"mesh.data={mesh_data}",
        "mesh.fsdp=1",
    )


def step_numbers(run_dir) -> dict:
    recs = read_records(run_dir)
    first = next(r for r in recs if r.get("step") == 1 and "loss" in r)
    second = next(r for r in recs if r.get("step") == 2 and "loss" in r)
    val = next(r for r in recs if r.get("event") == "eval" and r["step"] == 1)
    return {
        "loss": first["loss"],
        "loss_step_2": second["loss"],
        "grad_norm": first["grad_norm"],
        "tokens": first["tokens"],
        "val_loss_after_step_1": val["val_loss"],
        "process_count": recs[0].get("process_count"),
    }


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_sft_loss_is_the_same_on_1_device_4_devices_and_2_processes(trained_run, tmp_path):
    import jax

    from tpulab.proofs.driver import run_to_completion
    from tpulab.proofs.scaleout import launch_argv
    from tpulab.proofs.transformer import train_child_argv, write_child_config
    from tpulab.train.loop import train

    layouts = {"1 device": (1, 1, 1), "4 devices": (1, 4, 4), "2 processes": (2, 1, 2)}
    numbers = {}
    for name, (procs, devices, data) in layouts.items():
        tag = name.replace(" ", "-")
        config = sft_config(trained_run, data)
        run = tmp_path / tag
        if (
            procs * devices == 1
        ):  # mesh data=1 must use every device JAX sees here, or train refuses
            assert len(jax.devices()) == 1
            train(config, run, progress=False)
            numbers[name] = step_numbers(run)
            continue
        cfg_path = write_child_config(config, tmp_path / f"{tag}.yaml")
        if procs == 1:
            argv = train_child_argv(cfg_path, run, extra=["--no-track"])
            flags = f"--xla_force_host_platform_device_count={devices}"
            env = set_explicitly(dict(os.environ), {"XLA_FLAGS": flags})
        else:  # `tpulab launch ... -- train --config X`: sets each process's devices itself
            argv = launch_argv(
                cfg_path, run, processes=procs, devices=devices, extra=("--no-track",)
            )
            env = None
        run_to_completion(argv, tmp_path / f"{tag}.log", env or dict(os.environ), 600, name)
        numbers[name] = step_numbers(run)
    ref = numbers["1 device"]
    diffs = {
        name: {
            k: rel(n[k], ref[k])
            for k in ("loss", "grad_norm", "val_loss_after_step_1", "loss_step_2")
        }
        for name, n in numbers.items()
    }
    print(json.dumps({"rtol": RTOL, "numbers": numbers, "relative_diffs": diffs}, indent=1))
    assert numbers["2 processes"]["process_count"] == 2
    for name, n in numbers.items():
        assert n["tokens"] == ref["tokens"], (name, n, ref)  # one global denominator
        assert diffs[name]["loss"] <= RTOL, (name, diffs)
        # the objective's eval step over the fixed evaluation batch (the same bound: 8 x 32 terms)
        assert diffs[name]["val_loss_after_step_1"] <= RTOL, (name, diffs)
        # after one update the layouts' curves agree as the scale-out proofs require
        assert diffs[name]["loss_step_2"] <= LAYOUT_RTOL, (name, diffs)

    # negative control: a loss averaged per device (4 shards of 2 rows) instead of over the global
    # batch's response bytes misses this tolerance by far, on the very first batch of these runs
    from tpulab.train.objectives import build
    from tpulab.train.restore import load_model
    from tpulab.train.step import masked_xent

    batch = next(build(sft_config(trained_run, 1)).data().train(0, 1))
    logits = load_model(trained_run).model(jnp.asarray(batch["inputs"]), deterministic=True)
    t, m = jnp.asarray(batch["targets"]), jnp.asarray(batch["mask"])
    global_mean = float(masked_xent(logits, t, m)[0])
    per_device = np.mean(
        [float(masked_xent(logits[i : i + 2], t[i : i + 2], m[i : i + 2])[0]) for i in (0, 2, 4, 6)]
    )
    print(f"per-device average vs global mean: {rel(per_device, global_mean):.3g} relative")
    assert rel(per_device, global_mean) > 100 * RTOL
