"""Every process of a job trains on the same bytes: DPO's per-process reference table, 2 ways.

Each trainer process builds its own data, base, reference and (DPO, ``precomputed``) the whole
reference log-prob table on its own default device; process 0 alone records the identities in the
checkpoint and the MLflow run. ``train.distributed.agree_identities`` gathers every process's
digests before any write and refuses, on every process, a job whose processes differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, tiny_config
from tpulab.checkpoint.rundir import RunDir
from tpulab.checkpoint.store import read_meta, scan
from tpulab.evidence.metrics import read_records
from tpulab.proofs.scaleout import LAYOUT_RTOL

pytestmark = pytest.mark.slow

# Two real processes on JAX's distributed runtime (loopback, gloo): the first call agrees, the
# second differs in one identity on process 1 only and must be refused on both processes.
AGREE = """
import json, sys
from tpulab.errors import TpulabError
from tpulab.train.distributed import agree_identities, initialize_from_env
initialize_from_env(60)
import jax
pid = jax.process_index()
ids = {"corpus": "c" * 64, "reference": "r" * 64, "reference_logprobs": "a" * 64}
agree_identities(ids)
out = {"process": pid, "same": "agreed"}
try:
    agree_identities({**ids, "reference_logprobs": ("a" if pid == 0 else "b") * 64})
    out["differ"] = "agreed"
except TpulabError as e:
    out["differ"] = str(e)
try:
    agree_identities({**ids, "extra": "e" * 64} if pid else ids)
    out["names"] = "agreed"
except TpulabError as e:
    out["names"] = str(e)
print(json.dumps(out))
"""


def test_a_process_with_other_bytes_is_refused_on_every_process():
    from tpulab.orchestrate.launch import free_port
    from tpulab.train import distributed as D

    port = free_port()
    procs = []
    for pid in (0, 1):
        env = {
            **os.environ,
            D.ENV_COORDINATOR: f"127.0.0.1:{port}",
            D.ENV_NUM_PROCESSES: "2",
            D.ENV_PROCESS_ID: str(pid),
            "PYTHONPATH": str(REPO / "src"),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", AGREE],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for (out, err), p in zip(outs, procs, strict=True):
        assert p.returncode == 0, err[-2000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["same"] == "agreed"
        # refused on both processes, naming the identity and the process that differs
        assert r["differ"].startswith("process 1 computed another reference_logprobs identity")
        assert r["names"].startswith("process 1 names other identities than process 0")


def test_dpo_on_two_processes_uses_the_one_reference_table(sft_policy, sampled_pairs, tmp_path):
    """`tpulab launch --processes 2 -- train` of DPO: both processes agreed on the table (the
    run finished), the recorded table is the bytes a single process computes, and the losses equal
    a one-process run's: step 1 exactly (ln 2, only if every pair's reference row was gathered
    right), step 3, after a real update (step 1's learning rate is warm-up's 0), within the
    scale-out proofs' curve tolerance."""
    from tpulab.proofs.driver import run_to_completion
    from tpulab.proofs.scaleout import launch_argv
    from tpulab.proofs.transformer import write_child_config
    from tpulab.train.loop import train
    from tpulab.train.objectives import build

    def cfg(data: int):
        return tiny_config(
            "objective.kind=dpo",
            f"objective.init={sft_policy}",
            f"objective.data={sampled_pairs}",
            "train.steps=3",
            "train.eval_every=3",
            "checkpoint.save_every=3",
            f"mesh.data={data}",
            "mesh.fsdp=1",
        )

    run = tmp_path / "two"
    path = write_child_config(cfg(2), tmp_path / "two.yaml")
    # MLflow is not what this checks (process 0's lineage is tests/test_tracking.py's)
    argv = launch_argv(path, run, processes=2, devices=1, extra=("--no-track",))
    run_to_completion(argv, tmp_path / "two.log", dict(os.environ), 600, "2-process DPO")
    one = tmp_path / "one"
    train(cfg(1), one, progress=False)

    def recorded(r):
        found = scan(RunDir(r).checkpoints)
        return read_meta(found.directory / str(found.latest))["identities"]

    def losses(r):
        recs = read_records(r)
        return [next(x["loss"] for x in recs if x.get("step") == s and "loss" in x) for s in (1, 3)]

    single = build(cfg(1)).identities()["reference_logprobs"]
    assert recorded(run)["reference_logprobs"] == single == recorded(one)["reference_logprobs"]
    assert read_records(run)[0].get("process_count") == 2
    (a1, a3), (b1, b3) = losses(run), losses(one)
    print(json.dumps({"two_processes": [a1, a3], "one_process": [b1, b3]}))
    assert a1 == b1  # float32(ln 2): the policy is the reference at step 1
    assert abs(a3 - b3) <= LAYOUT_RTOL * abs(b3) and a3 != a1  # control: step 3 moved
