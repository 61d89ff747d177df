"""The runtime receipt on CPU: real collective with 1 and 4 host devices, qualification refusals."""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import run_cli
from tpulab.errors import ExitCode
from tpulab.evidence.html import render_html
from tpulab.evidence.receipt import (
    Target,
    check_collective,
    check_matmul,
    hardware_line,
    key_values,
    kind_matches,
    qualify,
    run_receipt,
)
from tpulab.evidence.receipt import table as aligned_text

# "TPU" as a word (a hardware claim); variable names such as TPU_SKIP_MDS_QUERY are raw data.
TPU_WORD = re.compile(r"\bTPU\b")


def test_receipt_in_process_single_device(tmp_path):
    receipt = run_receipt(tmp_path, Target.parse("cpu", 1))
    rt, ev = receipt["runtime"], receipt["evidence"]
    assert rt["backend"] == "cpu" and rt["process_count"] == 1
    # one device: a sum over it is its input (1.0), so the check passes as trivial and says so
    assert ev["collective"]["passed"] and ev["collective"]["values"] == [1.0] * rt["device_count"]
    assert ev["collective"]["trivial"] is (rt["device_count"] == 1)
    assert ev["matmul"]["passed"] and ev["matmul"]["relative_error_vs_numpy"] < 1e-5
    assert ev["round_trip"]["passed"]
    assert receipt["qualification"] == {"target": "cpu x1", "passed": True, "problems": []}
    on_disk = json.loads((tmp_path / "receipt.json").read_text())
    assert on_disk["evidence"]["collective"] == ev["collective"]
    table = (tmp_path / "receipt.md").read_text()
    assert not TPU_WORD.search(table) and "CPU (cpu) x1" in table
    assert "PASS (trivial: on one device a sum is its input)" in table
    # receipt.md is a two-column table: rendered, every key is a cell of one <table> (a browser
    # ran the old aligned lines into one paragraph); control: those lines give no table
    page = render_html(table, tmp_path)
    rows = re.findall(r"<tr><td>([^<]*)</td><td>", page)
    assert page.count("<table>") == 1 and rows == [html.escape(k) for k, _ in key_values(receipt)]
    assert "hardware" in rows and "matmul" in rows and "target" in rows
    assert "<table>" not in render_html(aligned_text(receipt), tmp_path)


def test_receipt_cli_four_forced_host_devices(tmp_path):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    p = run_cli(
        "receipt",
        "--out",
        str(tmp_path),
        "--expect",
        "cpu",
        "--expect-devices",
        "4",
        "--matmul-size",
        "128",
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "receipt.json").read_text())
    coll = r["evidence"]["collective"]
    assert r["runtime"]["device_count"] == 4 and r["runtime"]["local_device_count"] == 4
    # device i contributed i+1: 1+2+3+4 on every one of the four devices
    assert coll["passed"] and coll["expected"] == 10.0 and coll["values"] == [10.0] * 4
    assert coll["trivial"] is False and "trivial" not in p.stdout
    assert r["env"]["XLA_FLAGS"] == env["XLA_FLAGS"] and r["env"]["JAX_PLATFORMS"] == "cpu"
    assert "collective" in p.stdout and not TPU_WORD.search(p.stdout)
    assert _announced(p.stderr) == []  # the placeholders came with this test's env: nothing set


def _fresh_shell_env() -> dict:
    """This process's environment less what tpulab's libtpu placeholders set (as in a new shell)."""
    from tpulab.libtpu_env import MARKER, placeholders

    return {k: v for k, v in os.environ.items() if k not in placeholders() | {MARKER}}


def _announced(stderr: str) -> list[str]:
    """The line about the libtpu placeholders that every command began with until issue 31."""
    return [line for line in stderr.splitlines() if line.startswith("tpulab: set ")]


def _fresh_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    """``tpulab ARGS`` in a new process started from a fresh shell's environment."""
    return subprocess.run(
        [sys.executable, "-m", "tpulab.cli", *args],
        env=_fresh_shell_env(),
        capture_output=True,
        text=True,
        timeout=120,
        **kw,
    )


def test_the_libtpu_placeholders_stay_out_of_the_terminal_and_in_the_receipt(tmp_path):
    """From a fresh shell, `tpulab --help`, a one-line config error and `tpulab receipt` print no
    line about the placeholders they set; the receipt records every one of them (the control:
    they were set, so their absence from stderr is not for want of anything to say)."""
    from tpulab.libtpu_env import quiet_libtpu_off_tpu

    would = quiet_libtpu_off_tpu(_fresh_shell_env())
    if not would:
        pytest.skip("libtpu is not installed or this host has a TPU: no placeholders are set")
    helped = _fresh_cli("--help")
    assert helped.returncode == 0 and helped.stderr == "" and "prove-resume" in helped.stdout
    bad = _fresh_cli("train", "--run-dir", str(tmp_path / "r"), "--set", "train.steps=zero")
    assert bad.returncode == 2 and not (tmp_path / "r").exists()
    [line] = bad.stderr.splitlines()
    assert line.startswith("error: ") and "train.steps" in line
    r = _fresh_cli("receipt", "--out", str(tmp_path / "receipt"), "--matmul-size", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _announced(r.stderr) == []
    receipt = json.loads((tmp_path / "receipt" / "receipt.json").read_text())
    assert receipt["tpulab_placeholders"] == sorted(would)
    assert "tpulab placeholders" in (tmp_path / "receipt" / "receipt.md").read_text()


def test_receipt_joins_a_multi_process_job(tmp_path):
    """Launched as 2 processes x 2 devices, the receipt joins the job: each process writes its own
    receipt, the psum spans all 4 global devices (1+2+3+4 = 10 on each process's 2 shards) and
    --expect-devices is global. Started from a fresh shell's environment, the launcher sets the
    libtpu placeholders and its children inherit them: nobody prints a line about them, and the
    receipts record them."""
    from tpulab.libtpu_env import quiet_libtpu_off_tpu

    env = _fresh_shell_env()
    would = quiet_libtpu_off_tpu(dict(env))  # {} on a TPU VM or without libtpu
    p = subprocess.run(
        [sys.executable, "-m", "tpulab.cli"]
        + ["launch", "--processes", "2", "--devices-per-process", "2"]
        + ["--log-dir", str(tmp_path / "logs"), "--", "receipt", "--out", str(tmp_path / "r")]
        + ["--expect", "cpu", "--expect-devices", "4", "--matmul-size", "32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert _announced(p.stderr) == [], p.stderr[-2000:]
    assert not any(_announced(f.read_text()) for f in (tmp_path / "logs").glob("*.log"))
    receipts = [json.loads((tmp_path / "r" / f"receipt-p{i}.json").read_text()) for i in range(2)]
    for r in receipts:  # the launcher pins JAX_PLATFORMS for its children: theirs, not ours
        assert r["tpulab_placeholders"] == sorted(set(would) - {"JAX_PLATFORMS"})
    for i, r in enumerate(receipts):
        rt, coll = r["runtime"], r["evidence"]["collective"]
        assert (
            rt["process_index"],
            rt["process_count"],
            rt["device_count"],
            rt["local_device_count"],
        ) == (i, 2, 4, 2)
        assert (
            coll["passed"]
            and coll["devices"] == 4
            and coll["expected"] == 10.0
            and coll["values"] == [10.0, 10.0]
        )
        assert r["qualification"]["passed"]
    assert sorted(
        receipts[0]["runtime"]["local_device_ids"] + receipts[1]["runtime"]["local_device_ids"]
    ) == sorted(d["id"] for d in receipts[0]["runtime"]["devices"])
    # negative control: the same 2 devices per process without the job's env are 2 separate
    # 2-device runtimes
    p = run_cli(
        "receipt",
        "--out",
        str(tmp_path / "alone"),
        "--expect",
        "cpu",
        "--expect-devices",
        "4",
        "--matmul-size",
        "32",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
        timeout=120,
    )
    assert p.returncode == ExitCode.WRONG_TARGET and "expected 4 devices, JAX reports 2" in p.stderr
    # the process-level mapping of a refused target: exit 6 and one line, no traceback (the
    # other refusals here run the CLI's main in process)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: target qualification failed (cpu")
    assert "Traceback" not in p.stderr
    alone = json.loads((tmp_path / "alone" / "receipt.json").read_text())
    assert (
        alone["runtime"]["process_count"] == 1
        and alone["evidence"]["collective"]["expected"] == 3.0
    )


def test_collective_checker_negative_controls():
    assert check_collective([10.0] * 4, 4)["passed"]
    wrong = check_collective([10.0, 10.0, 9.0, 10.0], 4)  # one device saw a partial sum
    assert not wrong["passed"] and wrong["wrong_shards"] == [2]
    assert not check_collective([10.0] * 4, 5)["passed"]  # a device missing from the collective
    assert not check_collective([], 0)["passed"]
    # an op that returns its input (device i holds i+1) fails on every device once n > 1 ...
    for n in (2, 3, 4):
        assert check_collective([float(i + 1) for i in range(n)], n)["wrong_shards"] == list(
            range(n)
        )
    # ... and on one device it cannot fail: the check is marked trivial there, and only there
    assert check_collective([1.0], 1) | {"values": None} == {
        "passed": True,
        "trivial": True,
        "expected": 1.0,
        "values": None,
        "wrong_shards": [],
    }
    assert check_collective([3.0, 3.0], 2)["trivial"] is False


# The receipt's collective in a fresh process with N forced host devices, with the real psum and
# with a fake "collective" that returns its input (jax.lax.psum replaced before the receipt traces).
_COLLECTIVE = """
import json, sys
import jax
from tpulab.evidence import receipt
real = receipt.collective_evidence()
jax.lax.psum = lambda x, axis_name: x
fake = receipt.collective_evidence()
print(json.dumps({"real": real, "fake": fake, "summary": receipt.collective_summary(
    {"evidence": {"collective": real}})}))
"""


def test_collective_with_one_and_four_devices_and_a_fake_that_returns_its_input():
    """4 devices: the real psum passes (10 on each), the fake fails on every device. 1 device: both
    pass, because a sum over one device is its input, and the receipt says the check is trivial
    (with device indices as inputs it expected 0, the input itself, and claimed a pass)."""
    import subprocess
    import sys

    from conftest import set_explicitly

    got = {}
    for n in (1, 4):
        env = set_explicitly(
            dict(__import__("os").environ),
            {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"},
        )
        p = subprocess.run(
            [sys.executable, "-c", _COLLECTIVE],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        got[n] = json.loads(p.stdout.strip().splitlines()[-1])
    real, fake = got[4]["real"], got[4]["fake"]
    assert real["devices"] == 4 and real["passed"] and real["values"] == [10.0] * 4
    assert not real["trivial"] and "across all 4 devices, passed" in got[4]["summary"]
    assert not fake["passed"] and fake["values"] == [1.0, 2.0, 3.0, 4.0]
    assert fake["wrong_shards"] == [0, 1, 2, 3]
    real, fake = got[1]["real"], got[1]["fake"]
    assert real["devices"] == 1 and real["values"] == fake["values"] == [1.0]
    assert real["trivial"] and fake["trivial"]  # indistinguishable, and said so
    assert got[1]["summary"] == (
        "a collective on 1 device, passed but trivial (a sum over one device is its input)"
    )


def test_matmul_checker_negative_controls():
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = (
        rng.standard_normal((64, 64), dtype=np.float32),
        rng.standard_normal((64, 64), dtype=np.float32),
    )
    good = a @ b
    assert check_matmul(good, a, b)[1]
    assert check_matmul(good.astype(np.float16).astype(np.float32), a, b)[
        1
    ]  # reduced precision still passes
    assert not check_matmul(a @ b.T, a, b)[1]  # wrong math fails
    bad = good.copy()
    bad[3, 5] = np.nan
    assert not check_matmul(bad, a, b)[1]


def test_expect_tpu_fails_on_cpu_with_one_line(tmp_path, capsys):
    """The CLI's main in this process (exit 6 as its own process: the 'alone' control of
    test_receipt_joins_a_multi_process_job)."""
    from tpulab.cli.main import main

    rc = main(["receipt", "--out", str(tmp_path), "--expect", "tpu:v5e", "--matmul-size", "64"])
    err = capsys.readouterr().err
    assert rc == ExitCode.WRONG_TARGET
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith(
        "error: target qualification failed (tpu:v5e): expected backend tpu, JAX reports "
        "backend cpu"
    )
    # the receipt is still written: it is the evidence of the refusal
    r = json.loads((tmp_path / "receipt.json").read_text())
    assert r["qualification"]["passed"] is False and r["runtime"]["backend"] == "cpu"


def test_expect_device_count_and_bad_target(tmp_path, capsys):
    from tpulab.cli.main import main

    receipt_dir = tmp_path / "r"
    with pytest.raises(Exception, match="expected 64 devices"):
        run_receipt(receipt_dir, Target.parse("cpu", 64), matmul_size=64)
    rc = main(["receipt", "--out", str(tmp_path / "bad"), "--expect", "tpu:v9"])
    err = capsys.readouterr().err
    assert rc == ExitCode.BAD_INPUT and err.startswith("error: unknown TPU generation 'v9'")
    assert not (tmp_path / "bad").exists()  # bad input: nothing written


def _fake(backend: str, kinds: list[str], n: int) -> dict:
    return {
        "runtime": {"backend": backend, "device_kinds": kinds, "device_count": n},
        "evidence": {"collective": {"passed": True}},
    }


def test_target_matching_by_generation():
    """Pure matcher: device_kind strings as JAX reports them for each TPU generation."""
    assert kind_matches(Target.parse("tpu:v5e"), "TPU v5 lite")
    assert not kind_matches(Target.parse("tpu:v5p"), "TPU v5 lite")
    assert kind_matches(Target.parse("tpu:v5p"), "TPU v5")
    assert not kind_matches(Target.parse("tpu:v5e"), "TPU v5")
    assert kind_matches(Target.parse("tpu:v6e"), "TPU v6 lite")
    assert qualify(_fake("tpu", ["TPU v5 lite"], 8), Target.parse("tpu:v5e", 8)) == []
    assert qualify(_fake("tpu", ["TPU v5 lite"], 4), Target.parse("tpu:v5e", 8)) == [
        "expected 8 devices, JAX reports 4"
    ]
    failed = _fake("tpu", ["TPU v5 lite"], 8)
    failed["evidence"]["collective"]["passed"] = False
    assert qualify(failed, Target.parse("tpu:v5e")) == ["runtime evidence failed: collective"]


def test_hardware_line_names_tpu_only_for_tpu_backend():
    assert not TPU_WORD.search(hardware_line(_fake("cpu", ["cpu"], 4)))
    assert hardware_line(_fake("tpu", ["TPU v5 lite"], 8)).startswith("TPU (TPU v5 lite) x8")


def test_tpulab_placeholders_are_listed_apart_from_the_runtime_env(monkeypatch):
    """The TPU_* placeholders tpulab sets to quiet libtpu are not reported as the runtime's
    environment; the same name set by someone else is (negative control)."""
    import os

    from tpulab.evidence.receipt import runtime_env
    from tpulab.libtpu_env import MARKER, placeholders, quiet_libtpu_off_tpu

    for name in ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", MARKER):
        monkeypatch.delenv(name, raising=False)
    environ = dict(os.environ)
    added = quiet_libtpu_off_tpu(environ)
    if not added:
        pytest.skip("libtpu is not installed or this host has a TPU: no placeholders are set")
    monkeypatch.setattr(os, "environ", environ)
    assert "TPU_WORKER_ID" in placeholders() and "TPU_WORKER_ID" not in runtime_env()
    environ.pop(MARKER)  # the same variables, now as if a user or the platform had set them
    assert runtime_env()["TPU_WORKER_ID"] == "0"
