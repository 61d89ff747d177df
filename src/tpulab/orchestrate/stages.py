"""Named stages run in order, shared by the capstone and the dossier.

A stage that fails with a one-line TpulabError becomes a FAILED section of the report instead of
ending it, and every stage is timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tpulab.errors import TpulabError


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
            self.sections.append(f"## {name}\n\n**FAILED**: {e}")
        self.timings[name] = round(time.monotonic() - t0, 1)
        print(f"[{self.label}] {name} done in {self.timings[name]:.0f} s", flush=True)
