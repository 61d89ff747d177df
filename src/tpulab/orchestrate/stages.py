"""The runner the capstone and the dossier share: a fresh out dir, named stages run in order, the
status line, the report written even when a stage failed, then the exit code.

A stage that fails with a one-line TpulabError becomes a FAILED section of the report instead of
ending it, and every stage is timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tpulab.errors import ExitCode, TpulabError
from tpulab.evidence.report_kit import section


def check_out(out: str | Path) -> Path:
    """``out`` as a Path; an existing non-empty one is refused, so no earlier evidence is lost."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TpulabError(f"--out {out} already exists and is not empty; choose a new directory")
    return out


def prepare_out(out: str | Path) -> Path:
    """``out``, checked by ``check_out``, then created."""
    out = check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


class Stages:
    def __init__(self, label: str):
        self.label = label
        self.sections: list[str] = []
        self.failures: list[str] = []
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn: Callable[[], str]) -> None:
        t0 = time.monotonic()
        print(f"[{self.label}] {name} …", flush=True)
        try:
            self.sections.append(fn())
        except TpulabError as e:
            self.failures.append(f"{name}: {e}")
            self.sections.append(section(name, f"**FAILED**: {e}"))
        self.timings[name] = round(time.monotonic() - t0, 1)
        print(f"[{self.label}] {name} done in {self.timings[name]:.0f} s", flush=True)

    def status(self, passed: str = "PASS", failed: str = "FAIL") -> str:
        """``Status: **PASS**``, or the failed word and every failure."""
        if not self.failures:
            return f"Status: **{passed}**"
        return f"Status: **{failed}** — " + "; ".join(self.failures)

    def times(self) -> str:
        return "Stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.timings.items())

    def body(self) -> str:
        """Every stage's section, in the order they ran."""
        return "\n\n".join(self.sections)

    def finish(self, write: Callable[[], Path], failed: str, see: str = "see") -> Path:
        """Write the report (``write`` returns its path), failed stages and all; then raise
        ``failed (...); see PATH`` (``ExitCode.FAILED``) if any stage failed."""
        path = write()
        if self.failures:
            raise TpulabError(
                f"{failed} ({'; '.join(self.failures)}); {see} {path}", exit_code=ExitCode.FAILED
            )
        return path
