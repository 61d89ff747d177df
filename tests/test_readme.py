"""The README a newcomer reads: it starts with the two commands, each a real Makefile target, and
its layout map names every package directory of src/tpulab (train/objectives/ included)."""

from __future__ import annotations

import re

from conftest import REPO

README = REPO / "README.md"


def first_commands(text: str) -> list[str]:
    """The commands of the README's first code block (the indented lines after the title)."""
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[1] == "", lines[:2]
    block = []
    for line in lines[2:]:
        if not line.startswith("    "):
            break
        block.append(line.strip().split("#")[0].strip())
    return block


def test_the_readme_starts_with_the_two_commands():
    assert first_commands(README.read_text()) == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)


def test_a_readme_that_opens_with_prose_is_caught():
    text = README.read_text()
    assert first_commands(text.replace("# tpulab\n\n", "# tpulab\n\nA lab.\n\n", 1)) == []


def missing_from_layout(text: str, src) -> list[str]:
    """Package directories under ``src`` (relative, with a trailing slash) that the README's
    layout block does not name at their depth."""
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^ {6}((?: {2})*)(\w+/)", layout, flags=re.M))
    want = sorted(p.relative_to(src) for p in src.rglob("__init__.py") if p.parent != src)
    out = []
    for init in want:
        parts = init.parent.parts
        if (" " * 2 * (len(parts) - 1), parts[-1] + "/") not in named:
            out.append("/".join(parts) + "/")
    return out


def test_the_layout_names_every_package():
    src = REPO / "src" / "tpulab"
    assert missing_from_layout(README.read_text(), src) == []
    # negative control: a layout without the objectives line misses exactly it
    text = re.sub(r"^ {8}objectives/.*\n", "", README.read_text(), flags=re.M)
    assert missing_from_layout(text, src) == ["train/objectives/"]
