"""`make test` lints before it tests: a tree ruff rejects fails in seconds, not after the suite."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned(makefile, target: str, cwd) -> list[str]:
    """The commands ``make -n target`` would run, setup's install left out (its stamp is fresh)."""
    out = subprocess.run(
        ["make", "-n", "-f", str(makefile), target, "STAMP=stamp", "-o", "stamp"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def lint_first(commands: list[str]) -> bool:
    pytest_at = next(i for i, c in enumerate(commands) if "-m pytest" in c)
    before = commands[:pytest_at]
    return any("ruff check ." in c for c in before) and any(
        "ruff format --check ." in c for c in before
    )


def test_make_test_runs_both_ruff_commands_before_pytest(tmp_path):
    assert lint_first(planned(REPO / "Makefile", "test", tmp_path))


def test_the_order_check_can_fail(tmp_path):
    """Negative control: the same Makefile with lint dropped from test's prerequisites fails."""
    text = (REPO / "Makefile").read_text()
    assert "test: setup lint\n" in text
    bad = tmp_path / "Makefile"
    bad.write_text(text.replace("test: setup lint\n", "test: setup\n"))
    assert not lint_first(planned(bad, "test", tmp_path))
    assert not lint_first(planned(REPO / "Makefile", "test-fast", tmp_path))
