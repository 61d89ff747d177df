"""Bridge CLI and checkpoints, in-process and fast: bad input, refusals, resume identity on
torch."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tpulab.bridge import checkpoint as C
from tpulab.bridge.backends import torch_xla_problem
from tpulab.checkpoint.files import write_manifest
from tpulab.cli.main import main
from tpulab.evidence.metrics import curve, read_records, starts

SMALL = ["--steps", "6", "--checkpoint-every", "3", "--n", "32", "--hidden", "16"]


def run(capsys, *argv) -> tuple[int, str]:
    rc = main(["bridge", *map(str, argv)])
    return rc, capsys.readouterr().err.strip()


def snapshot(d: Path) -> dict:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    assert err.startswith("error: ") and "\n" not in err, err
    for n in needles:
        assert n in err, err


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory) -> Path:
    """One `bridge train` (torch, 6 steps, MLflow-tracked as the command is by default) for the
    module; each test gets its own copy (``trained``). Training it per test cost 3.3-3.9 s each,
    8 times: the run is the same every time, the copy takes milliseconds."""
    d = tmp_path_factory.mktemp("bridge-cli") / "run"
    argv = ["bridge", "train", "--backend", "torch", "--run-dir", str(d), *SMALL]
    rc = main([*argv, "--augment", "0.1", "--dropout", "0.2"])
    assert rc == 0
    return d


@pytest.fixture
def trained(trained_once, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(trained_once, d)
    return d


def test_unknown_backend_and_method(tmp_path, capsys):
    d = tmp_path / "x"
    assert_one_line_error(
        *run(capsys, "train", "--backend", "tensorflow", "--run-dir", d),
        "unknown backend 'tensorflow'",
    )
    assert_one_line_error(
        *run(capsys, "train", "--backend", "torch", "--method", "jit", "--run-dir", d),
        "backend 'torch' has no method 'jit'",
    )
    assert_one_line_error(
        *run(capsys, "prove-resume", "--backend", "torchax", "--method", "aot", "--run-dir", d),
        "has no method 'aot'",
    )
    assert_one_line_error(
        *run(capsys, "train", "--backend", "torch", "--run-dir", d, "--dropout", "1.5"), "dropout"
    )
    assert not d.exists()


@pytest.mark.skipif(torch_xla_problem() is None, reason="torch_xla imports here")
def test_torch_xla_absent_is_one_line(tmp_path, capsys):
    d = tmp_path / "x"
    for cmd in ("train", "prove-resume"):
        assert_one_line_error(
            *run(capsys, cmd, "--backend", "torch_xla", "--run-dir", d),
            "torch_xla is not installed here",
        )
    assert not d.exists()


def test_checkpoint_layout_and_meta(trained):
    dirs = C.step_dirs(trained)
    assert [s for s, _ in dirs] == [3, 6]
    meta = C.read_meta(dirs[-1][1])
    assert (meta["backend"], meta["method"], meta["step"], meta["rng_saved"]) == (
        "torch",
        "eager",
        6,
        True,
    )
    state = C.load_state(dirs[-1][1])
    assert set(state) >= {"model", "optimizer", "step", "rng"}
    assert set(state["rng"]) == {"torch_cpu", "augment"}
    assert "param_groups" in state["optimizer"] and "0.weight" in state["model"]


def _rewrite_meta(ckpt: Path, **changes) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    for k, v in changes.items():
        if k.startswith("config."):
            meta["config"][k[7:]] = v
        else:
            meta[k] = v
    (ckpt / "meta.json").write_text(json.dumps(meta))
    write_manifest(ckpt, extra={"step": meta["step"]})


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--backend", "torchax"], "backend: 'torch' -> 'torchax'"),
        (["--backend", "torch", "--lr", "0.02"], "lr: 0.01 -> 0.02"),
        (["--backend", "torch", "--seed", "3"], "seed: 0 -> 3"),
    ],
)
def test_refuses_foreign_checkpoint_and_writes_nothing(trained, capsys, argv, needle):
    before = snapshot(trained)
    rc, err = run(
        capsys,
        "train",
        "--run-dir",
        trained,
        *SMALL,
        "--augment",
        "0.1",
        "--dropout",
        "0.2",
        *argv,
        "--steps",
        "9",
    )
    assert_one_line_error(rc, err, "belongs to another run", needle, "--force")
    assert snapshot(trained) == before


def test_refuses_checkpoint_of_another_method(trained, capsys):
    _rewrite_meta(C.step_dirs(trained)[-1][1], method="jit", backend="torchax")
    before = snapshot(trained)
    rc, err = run(
        capsys,
        "train",
        "--backend",
        "torch",
        "--run-dir",
        trained,
        *SMALL,
        "--augment",
        "0.1",
        "--dropout",
        "0.2",
        "--steps",
        "9",
    )
    assert_one_line_error(rc, err, "method: 'jit' -> 'eager'")
    assert snapshot(trained) == before
    rc, err = run(
        capsys,
        "train",
        "--backend",
        "torch",
        "--run-dir",
        trained,
        *SMALL,
        "--augment",
        "0.1",
        "--dropout",
        "0.2",
        "--steps",
        "9",
        "--force",
    )
    assert_one_line_error(rc, err, "even with --force")
    assert snapshot(trained) == before


def test_corrupt_checkpoint_is_refused(trained, capsys):
    state = C.step_dirs(trained)[-1][1] / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    before = snapshot(trained)
    rc, err = run(
        capsys,
        "train",
        "--backend",
        "torch",
        "--run-dir",
        trained,
        *SMALL,
        "--augment",
        "0.1",
        "--dropout",
        "0.2",
        "--steps",
        "9",
    )
    assert_one_line_error(rc, err, "checksum mismatch", "state.pt")
    assert snapshot(trained) == before


def test_force_loads_other_config(trained, capsys):
    rc, err = run(
        capsys,
        "train",
        "--backend",
        "torch",
        "--run-dir",
        trained,
        *SMALL,
        "--augment",
        "0.1",
        "--dropout",
        "0.2",
        "--lr",
        "0.02",
        "--steps",
        "9",
        "--force",
    )
    assert rc == 0, err
    last = starts(read_records(trained))[-1]
    assert last["resumed_from"] == 6 and "lr: 0.01 -> 0.02" in last["forced"][0]


def _curve(d):
    recs = read_records(d)
    return {s: v for seg in starts(recs) for s, v in curve(recs, segment=seg["segment"]).items()}


@pytest.mark.parametrize("restore_rng", [True, False])
def test_in_process_resume_is_exact_only_with_generator_state(tmp_path, restore_rng):
    """Fast twin of the slow subprocess proof: 6 steps, resume to 12, against 12 straight."""
    from tpulab.bridge.config import BridgeConfig
    from tpulab.bridge.loop import train

    cfg = dict(n=32, hidden=16, checkpoint_every=3, augment=0.1, dropout=0.2)
    train(BridgeConfig(steps=12, **cfg), "torch", "eager", tmp_path / "ref")
    train(BridgeConfig(steps=6, **cfg), "torch", "eager", tmp_path / "res", restore_rng=restore_rng)
    out = train(
        BridgeConfig(steps=12, **cfg), "torch", "eager", tmp_path / "res", restore_rng=restore_rng
    )
    assert out.resumed_from == 6
    ref, res = _curve(tmp_path / "ref"), _curve(tmp_path / "res")
    assert sorted(res) == list(range(1, 13))
    assert (ref == res) is restore_rng


def test_the_bridge_loop_calls_hooks_as_the_trainer_does(tmp_path):
    """on_start once, on_metrics every step, on_checkpoint after each save (after that step's
    on_metrics), on_end once; a resumed run's on_start names the step it resumed from."""
    from tpulab.bridge.config import BridgeConfig
    from tpulab.bridge.loop import train
    from tpulab.train.hooks import Hooks

    class Record(Hooks):
        def __init__(self):
            self.calls = []

        def on_start(self, info):
            self.calls.append(("start", info["start_step"], info["resumed_from"]))

        def on_metrics(self, step, record):
            self.calls.append(("metrics", step))

        def on_checkpoint(self, step):
            self.calls.append(("checkpoint", step))

        def on_end(self, summary):
            self.calls.append(("end", summary.final_step))

    cfg = BridgeConfig(steps=4, checkpoint_every=2)
    first, again = Record(), Record()
    train(cfg, "torch", "eager", tmp_path / "run", hooks=[first])
    assert first.calls == [
        ("start", 0, None),
        ("metrics", 1),
        ("metrics", 2),
        ("checkpoint", 2),
        ("metrics", 3),
        ("metrics", 4),
        ("checkpoint", 4),
        ("end", 4),
    ]
    train(
        BridgeConfig(steps=6, checkpoint_every=2), "torch", "eager", tmp_path / "run", hooks=[again]
    )
    assert again.calls[0] == ("start", 4, 4) and again.calls[-1] == ("end", 6)
