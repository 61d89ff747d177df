"""One table of exit codes (``tpulab.errors.ExitCode``): the README shows exactly it, src/ names
every status it exits with or compares a tpulab child's status against through it, every code is
provoked by some test that asserts it by name, and Ctrl-C exits ``INTERRUPTED``.

Where each code is provoked (through the real CLI or the real function): OK and FAILED in
test_resume_proof, BAD_INPUT and WRONG_TARGET in test_receipt, BAD_STATE in test_train, IO_FAILED in
test_hardening (a real full disk), DELETE_NOT_VERIFIED and TERMINATED in test_cloud_rehearsal,
STALLED in test_watchdog, PEER_FAILED in test_scaleout_procs, INTERRUPTED here.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, TINY
from tpulab.errors import ExitCode

SRC = REPO / "src" / "tpulab"
TESTS = REPO / "tests"
README = REPO / "README.md"

# Integer comparisons with the status of a program that is not tpulab: its codes are not ours.
FOREIGN_STATUS = {
    ("cloud/gcloud.py", "self.rc == 0"): "a gcloud call's own status",
    ("evidence/provenance.py", "head.returncode != 0"): "git's status",
    ("cloud/wheel.py", "p.returncode != 0"): "the wheel build's status (pip)",
}
STATUS_NAMES = {"rc", "code", "returncode", "exit_code", "expected_exit_code"}


def _is_int(node) -> bool:
    if isinstance(node, ast.IfExp):
        return _is_int(node.body) or _is_int(node.orelse)
    if isinstance(node, ast.Tuple):
        return any(_is_int(e) for e in node.elts)
    return isinstance(node, ast.Constant) and type(node.value) is int and not isinstance(node, bool)


def _is_status(node) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return name in STATUS_NAMES


def bare_exit_codes(path: Path, rel: str) -> list[str]:
    """Places in one source file where an exit code is a bare integer."""
    tree = ast.parse(path.read_text())
    found = []
    cli = rel.startswith("cli/")
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.keyword) and node.arg in STATUS_NAMES and _is_int(node.value):
            what = f"{node.arg}={ast.unparse(node.value)}"
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if node.value is not None and _is_int(node.value) and any(map(_is_status, targets)):
                what = ast.unparse(node)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "os._exit"):
            if node.args and _is_int(node.args[0]):
                what = ast.unparse(node)
        elif isinstance(node, ast.Compare) and _is_status(node.left):
            if any(map(_is_int, node.comparators)) and not (
                # a sign test (exited with an error vs killed by a signal), not a code
                isinstance(node.ops[0], ast.Gt | ast.Lt) and ast.unparse(node.comparators[0]) == "0"
            ):
                what = ast.unparse(node)
        elif isinstance(node, ast.FunctionDef) and (cli or node.name == "main"):
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and ret.value is not None and _is_int(ret.value):
                    found.append(f"{rel}:{ret.lineno}: {ast.unparse(ret)}")
        if what and (rel, what) not in FOREIGN_STATUS:
            found.append(f"{rel}:{node.lineno}: {what}")
    return sorted(set(found))


def test_src_names_every_exit_code():
    found = [
        hit
        for p in sorted(SRC.rglob("*.py"))
        for hit in bare_exit_codes(p, p.relative_to(SRC).as_posix())
    ]
    assert found == [], "\n".join(found)


def test_the_scan_finds_bare_codes(tmp_path):
    """Control: each form a bare code took before the table is found."""
    src = tmp_path / "x.py"
    src.write_text(
        "import os, sys\n"
        "class E(Exception):\n    exit_code = 4\n"
        "def f(rc, proc):\n"
        "    raise E('x', exit_code=1)\n"
        "    os._exit(75)\n"
        "    if proc.returncode != 0 or rc == 2:\n        return 1\n"
        "def main():\n    return 0 if ok else 1\n"
        "def g(code):\n    return code > 0\n"
    )
    what = {h.split(": ", 1)[1] for h in bare_exit_codes(src, "cli/x.py")}
    assert what == {
        "exit_code = 4",
        "exit_code=1",
        "os._exit(75)",
        "proc.returncode != 0",
        "rc == 2",
        "return 1",
        "return 0 if ok else 1",
    }
    # outside cli/ a bare ``return 1`` is not an exit code, except in ``main``
    outside = {h.split(": ", 1)[1] for h in bare_exit_codes(src, "train/x.py")}
    assert outside == what - {"return 1"}


def readme_table(text: str) -> list[tuple[int, str, str]]:
    """(code, name, meaning) rows of the README's exit-code table."""
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (.+?) \|$", section, flags=re.M)
    return [(int(c), n, m) for c, n, m in rows]


def test_readme_shows_exactly_the_table():
    want = [(int(c), c.name, c.meaning) for c in ExitCode]
    assert readme_table(README.read_text()) == want


def test_a_drifted_readme_is_caught():
    """Control: a changed meaning, a missing row and a renumbered code all fail the comparison."""
    text = README.read_text()
    want = [(int(c), c.name, c.meaning) for c in ExitCode]
    first = f"| {int(ExitCode.WRONG_TARGET)} | `WRONG_TARGET` |"
    assert first in text
    assert readme_table(text.replace(ExitCode.OK.meaning, "success")) != want
    assert readme_table(text.replace(first, "| 4 | `WRONG_TARGET` |")) != want
    assert readme_table(re.sub(r"^\| 75 .*\n", "", text, flags=re.M)) != want


def asserted_codes(files) -> set[str]:
    """Names of ExitCode members that the given test files use (``ExitCode.NAME``)."""
    names = set()
    for f in files:
        for node in ast.walk(ast.parse(Path(f).read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "ExitCode":
                names.add(node.attr)
    return names


def test_every_code_is_asserted_by_some_test():
    used = asserted_codes(TESTS.glob("test_*.py"))
    assert {c.name for c in ExitCode} <= used, sorted({c.name for c in ExitCode} - used)
    # control: one file's codes are exactly the ones it names, so a code no file names is missing
    assert asserted_codes([TESTS / "test_receipt.py"]) == {"WRONG_TARGET", "BAD_INPUT"}


def test_ctrl_c_during_training_is_one_line_and_exits_interrupted(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpulab.cli", "train", "--run-dir", str(tmp_path / "run")]
        + ["--config", str(TINY), "--steps", "100000", "--no-progress", "--no-track"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # a terminal's Ctrl-C: a pytest started as a background job of a non-interactive shell
        # (`cmd &`) ignores SIGINT, and an ignored signal stays ignored across exec (a hang of
        # 120 s, seen twice)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "training to step" not in line:  # inside the handler: the loop has started
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == ExitCode.INTERRUPTED, err[-2000:]
    assert err.strip().splitlines()[-1] == "error: interrupted", err[-2000:]
