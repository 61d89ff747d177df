"""The project's wheel, which ``tpu stage`` copies to every worker and installs there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tpulab.errors import TpulabError

REPO = Path(__file__).resolve().parents[3]


def build_wheel(dest: Path) -> Path:
    """The project's wheel, built from a copy of the source tree (the checkout is untouched)."""
    if not (REPO / "pyproject.toml").is_file():
        raise TpulabError(f"stage needs a tpulab source checkout (no pyproject.toml in {REPO})")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(
            REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
        )
        shutil.copyfile(REPO / "pyproject.toml", Path(tmp) / "pyproject.toml")
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(dest),
                tmp,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if p.returncode != 0:
            raise TpulabError(
                f"building the wheel failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
            )
    wheels = sorted(dest.glob("tpulab-*.whl"))
    if len(wheels) != 1:
        raise TpulabError(f"expected one tpulab wheel in {dest}, found {len(wheels)}")
    return wheels[0]
