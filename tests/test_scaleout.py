"""Scale-out units: the sharding table, bad mesh/batch/launcher input, the data split by process.

Also the step watchdog and the topology refusal; the multi-process proofs are in
test_scaleout_procs.py (slow).
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import numpy as np
import pytest

from conftest import TINY, run_cli, run_main
from tpulab.data.config import DataConfig
from tpulab.data.pipeline import train_dataset
from tpulab.errors import ConfigError, TpulabError
from tpulab.train.config import MeshConfig
from tpulab.train.sharding import check_batch, resolve, spec_for


class _Mesh:
    def __init__(self, data, fsdp):
        self.shape = {"data": data, "fsdp": fsdp}


def test_table_splits_matrices_and_both_adam_moments_over_fsdp_and_replicates_vectors():
    mesh = _Mesh(2, 2)
    for prefix in ("params/", "opt_state/1/0/mu/", "opt_state/1/0/nu/"):
        spec, _ = spec_for(prefix + "blocks/0/mlp/up/kernel", (32, 128), mesh)
        assert tuple(spec) == ("fsdp", None)
        spec, _ = spec_for(prefix + "embed/embedding", (258, 32), mesh)
        assert tuple(spec) == ("fsdp", None)
        assert tuple(spec_for(prefix + "blocks/0/attn_norm/scale", (32,), mesh)[0]) == ()
    assert tuple(spec_for("rng", (2,), mesh)[0]) == ()
    # 258 vocabulary rows do not split over 4: replicated, and the table says so
    spec, rule = spec_for("params/embed/embedding", (258, 32), _Mesh(1, 4))
    assert tuple(spec) == () and "not divisible" in rule


def test_layout_table_on_this_process_matches_the_compiled_shardings(tmp_path):
    from conftest import tiny_config
    from tpulab.train.sharding import layout_table
    from tpulab.train.step import make_steps

    steps = make_steps(tiny_config())
    rows = {r["path"]: r for r in layout_table(steps.abstract_state(), steps.mesh)}
    assert rows["params/blocks/0/attn/qkv/kernel"]["spec"] == str(
        steps.state_sharding.params["blocks"][0]["attn"]["qkv"]["kernel"].get_value().spec
    )
    assert len(rows) == 46


def test_mesh_must_use_every_device_and_split_the_batch():
    assert resolve(MeshConfig(), 4) == (4, 1)
    assert resolve(MeshConfig(data=2, fsdp=2), 4) == (2, 2)
    with pytest.raises(ConfigError, match=r"mesh data=2 x fsdp=1 = 2 devices, but JAX sees 4"):
        resolve(MeshConfig(data=2), 4)
    with pytest.raises(ConfigError, match="does not divide"):
        resolve(MeshConfig(fsdp=3), 4)
    with pytest.raises(
        ConfigError, match=r"batch_size=6 is not divisible by the data-parallel size 4"
    ):
        check_batch(6, _Mesh(2, 2))
    check_batch(8, _Mesh(2, 2))


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "--set", "mesh.data=2"], "mesh data=2 x fsdp=1 = 2 devices, but JAX sees 1"),
        (["train", "--set", "mesh.fsdp=0"], "mesh.fsdp=0 must be >= 1"),
        (["launch", "--processes", "0", "--", "train"], "--processes 0 must be at least 1"),
        (["reshard", "--mesh", "data=3,fsdp=2"], "does not divide the 1 devices"),
        (["reshard", "--mesh", "data=x"], "--mesh expects data=N,fsdp=M"),
    ],
)
def test_bad_scaleout_input_is_one_line_and_writes_nothing(
    tmp_path, trained_run, capfd, args, message
):
    """In this process (``run_main``): the refusals cross no process boundary; the launcher's own
    exit status is a real process's below."""
    run = tmp_path / "run"
    if args[0] == "reshard":
        args = [*args, "--run-dir", str(trained_run), "--out", str(run)]
    elif args[0] == "train":
        args = [*args, "--run-dir", str(run), "--config", str(TINY), "--no-progress"]
    result = run_main(capfd, *args)
    assert result.returncode == 2
    assert (
        result.stderr.strip() == f"error: {result.stderr.strip()[7:]}"
        and len(result.stderr.strip().splitlines()) == 1
    )
    assert message in result.stderr
    assert not run.exists()


def test_coordinator_port_in_use_is_refused(tmp_path, capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = run_main(
            capfd,
            "launch",
            "--processes",
            "2",
            "--port",
            str(port),
            "--log-dir",
            str(tmp_path / "l"),
            "--",
            "train",
            "--run-dir",
            str(tmp_path / "run"),
        )
    assert (
        result.returncode == 2
        and f"coordinator port {port} on 127.0.0.1 is in use" in result.stderr
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_draw_disjoint_rows_whose_union_is_the_single_process_batch(processes):
    cfg = DataConfig(seq_len=8, batch_size=8)
    windows = np.arange(13 * 9, dtype=np.int32).reshape(
        13, 9
    )  # 13 windows: an epoch ends inside a batch

    # Each iterator is read and closed before the next opens: Grain prefetches 500 batches in 16
    # threads and over 13 windows its index shuffle cycle-walks (2.9 ms a lookup against 54 us over
    # 1000 windows), so open side by side they burned 41 CPU-s for both cases; closing cancels the
    # batches nobody reads.
    def first(n, *args):
        with contextlib.closing(iter(train_dataset(windows, *args))) as it:
            return [next(it)["inputs"] for _ in range(n)]

    one = first(7, cfg)  # several epochs
    many = [first(7, cfg, p, processes) for p in range(processes)]
    for step in range(7):
        assert np.array_equal(np.concatenate([rows[step] for rows in many]), one[step])
    # negative control: slicing windows by process before shuffling (the old way) gives other rows
    import grain

    ds = grain.MapDataset.source(windows)[0::2].shuffle(seed=cfg.shuffle_seed).repeat().batch(4)
    assert not np.array_equal(ds[0][:, :-1], one[0][:4])  # ds[0]: by index, no prefetch


def test_a_resume_on_another_topology_is_refused_unless_forced():
    from tpulab.train.resume_checks import check_topology

    saved = {"mesh": {"data": 2, "fsdp": 2}, "process_count": 2, "device_count": 4}
    here = {"mesh": {"data": 1, "fsdp": 1}, "process_count": 1, "device_count": 1}
    with pytest.raises(
        TpulabError, match=r"written on 2 process\(es\) x 4 device\(s\).*use tpulab reshard"
    ):
        check_topology({"step": 10, "topology": saved}, here, force=False)
    check_topology({"step": 10, "topology": saved}, here, force=True)
    check_topology({"step": 10, "topology": here}, here, force=False)


def test_topology_is_recorded_in_the_checkpoint(trained_run):
    import json

    meta = json.loads((trained_run / "checkpoints" / "40" / "meta" / "metadata").read_text())
    assert meta["topology"] == {
        "mesh": {"data": 1, "fsdp": 1},
        "process_count": 1,
        "device_count": 1,
    }


def test_a_process_that_cannot_reach_its_coordinator_fails_in_one_line_naming_worker_all(tmp_path):
    from tpulab.orchestrate.launch import free_port

    env = {
        "TPULAB_COORDINATOR": f"127.0.0.1:{free_port()}",
        "TPULAB_NUM_PROCESSES": "2",
        "TPULAB_PROCESS_ID": "1",
        "JAX_PLATFORMS": "cpu",
    }
    t0 = time.monotonic()
    result = run_cli(
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "--config",
        str(TINY),
        "--no-progress",
        "--init-timeout",
        "3",
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("error: joining coordinator")
        and "within 3s" in last
        and "--worker=all" in last
    )
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "run").exists()


def test_launcher_passes_on_the_code_when_every_process_fails_alike(tmp_path):
    result = run_cli(
        "launch",
        "--processes",
        "2",
        "--log-dir",
        str(tmp_path / "l"),
        "--",
        "train",
        "--run-dir",
        str(tmp_path / "run"),
        "--config",
        str(TINY),
        "--set",
        "mesh.fsdp=0",
    )
    assert result.returncode == 2, result.stderr
    assert "error: mesh.fsdp=0 must be >= 1" in result.stderr  # process 0's own line, streamed
    assert "mesh.fsdp=0 must be >= 1" in (tmp_path / "l" / "p1.log").read_text()
    assert json.loads((tmp_path / "l" / "teardown.json").read_text())["codes"] == [2, 2]
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_from_before_meshes_counts_as_the_default_mesh():
    from conftest import tiny_config
    from tpulab.config import to_dict
    from tpulab.data.tokenizer import DEFINITION
    from tpulab.train.resume_checks import check_resume_identity

    config = tiny_config()
    old = to_dict(config)
    old.pop("mesh")
    meta = {"config": old, "corpus_identity": "c", "tokenizer": DEFINITION, "step": 10}
    assert check_resume_identity(meta, config, "c", force=False) == []
    with pytest.raises(
        TpulabError, match=r"mesh.fsdp: 1 -> 2 .*use tpulab reshard"
    ):  # negative control
        check_resume_identity(meta, tiny_config("mesh.fsdp=2"), "c", force=False)
