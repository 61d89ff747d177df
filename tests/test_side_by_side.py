"""benchmarks/nanogpt_side_by_side.py's pieces (the script is run by hand): the corpus written as
nanoGPT's token files, the iteration lines it parses, the steady-state summary; the child-process
measurement the speed benchmarks share (``tpulab.perf.process``); the host CPU record every
benchmark carries (``tpulab.perf.timing.host_cpu``)."""

from __future__ import annotations

import importlib.util
import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from tpulab.config import load
from tpulab.perf.process import run_measured, tree_rss_bytes
from tpulab.perf.timing import host_cpu
from tpulab.train.config import RunConfig


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "nanogpt_side_by_side", REPO / "benchmarks" / "nanogpt_side_by_side.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse4_2 avx fma avx2 bmi2

processor\t: 1
model name\t: something else
flags\t\t: avx512f
"""


def test_host_cpu_reads_the_first_processor_and_its_isa():
    cpu = host_cpu(CPUINFO)
    assert cpu == {
        "model_name": "AMD EPYC 7B12",
        "family": "23",
        "model": "49",
        "isa": ["sse4_2", "avx", "avx2", "fma"],
    }
    # the control: the second processor's avx512f is not the first's
    assert "avx512f" not in cpu["isa"] and "avx512f" in host_cpu(CPUINFO.split("\n\n")[1])["isa"]


def test_nanogpt_token_files_hold_the_corpus_bytes_with_bos(bench, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = {"a.txt": "first document\n" * 40, "b.txt": "second one é\n" * 30}
    for name, text in texts.items():
        (corpus / name).write_text(text)
    nanogpt = tmp_path / "nanoGPT"
    nanogpt.mkdir()
    (nanogpt / "configurator.py").write_text("")
    monkeypatch.setattr(bench, "NANOGPT", nanogpt)
    config = load(RunConfig, REPO / "configs" / "tiny.yaml", [f"data.path={corpus}"])
    work = tmp_path / "work"
    work.mkdir()
    counts = bench.write_nanogpt_data(config, work)
    data = work / "data" / bench.DATASET
    with open(data / "meta.pkl", "rb") as f:
        assert pickle.load(f) == {"vocab_size": 258}
    train, val = (np.fromfile(data / f"{s}.bin", np.uint16) for s in ("train", "val"))
    assert counts == {
        "corpus_identity": counts["corpus_identity"],
        "train_tokens": train.size,
        "val_tokens": val.size,
    }
    # one document each side (2 documents, val_fraction 0.1 -> 1), each BOS then its bytes
    docs = sorted([train, val], key=len)
    expected = sorted((np.array([256, *t.encode()], np.uint16) for t in texts.values()), key=len)
    for got, want in zip(docs, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert (work / "configurator.py").resolve() == nanogpt / "configurator.py"


def test_iteration_lines_and_the_steady_summary(bench):
    m = bench.ITER_LINE.match("iter 12: loss 2.4567, time 61.25ms, mfu 0.51%")
    assert m and m.groups() == ("12", "2.4567", "61.25")
    assert bench.ITER_LINE.match("step 0: train loss 5.5, val loss 5.5") is None
    s = bench.steady([9.0] * 5 + [0.05] * 19 + [0.15], skip=5)
    assert s["ms_per_step"] == 50.0 and s["mean_ms"] == 55.0 and s["steady_steps"] == 20
    assert s["tokens_per_s"] == round(2048 / 0.055)
    with pytest.raises(SystemExit, match="19 steady-state steps"):
        bench.steady([0.05] * 24, skip=5)


def test_tree_rss_counts_a_grandchild():
    """A child whose own child holds 150 MB: the tree sum sees it, the child alone does not."""
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', "
        "'import time; b = bytearray(150 * 2**20); print(1, flush=True); time.sleep(60)'],"
        " stdout=subprocess.PIPE)\n"
        "p.stdout.readline(); print(p.pid, flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        grandchild = int(proc.stdout.readline())
        tree = tree_rss_bytes(proc.pid)
        alone = tree_rss_bytes(grandchild)
        assert alone >= 150 * 2**20 and tree >= alone + 5 * 2**20  # the child's interpreter too
        assert tree_rss_bytes(proc.pid) - alone < 150 * 2**20 < tree
    finally:
        if grandchild is not None:
            os.kill(grandchild, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_run_measured_reports_the_kernel_peak_and_the_exit_code(tmp_path):
    """A child that touches 120 MB peaks above it; one that touches nothing stays far below."""
    big = "b = bytearray(120 * 2**20); import time; time.sleep(0.5)"
    small = "import time; time.sleep(0.5); raise SystemExit(3)"
    r_big = run_measured(
        [sys.executable, "-c", big], cwd=None, env=None, log=tmp_path / "a", timeout=60
    )
    r_small = run_measured(
        [sys.executable, "-c", small], cwd=None, env=None, log=tmp_path / "b", timeout=60
    )
    assert r_big["returncode"] == 0 and r_small["returncode"] == 3
    assert r_big["peak_rss_mib"] >= 120 > r_small["peak_rss_mib"] + 60
    assert r_big["tree_peak_rss_mib"] >= 120 and r_big["wall_s"] >= 0.5
