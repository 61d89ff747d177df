"""The report toolkit (tpulab.evidence.report_kit) and the guard that keeps every report on it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tpulab.evidence.html import render_html
from tpulab.evidence.report_kit import figure, section, table

ROOT = Path(__file__).resolve().parents[1]
# every place that writes a report: the library and the benchmark scripts (12 of whose tables
# were hand-rolled before they moved to the toolkit)
TREES = (ROOT / "src" / "tpulab", ROOT / "benchmarks")
TOOLKIT = {"src/tpulab/evidence/report_kit.py"}
SRC = TREES[0]
# a string that opens a row ("| ", "|:"), closes one (" |") or rules one ("|---|", "---|"):
# hand-rolled table syntax
ROW = re.compile(r"^\|[ :-]|(^|\|)---\|| \|$")


def test_table_escapes_cells_and_keeps_the_form_reports_had():
    text = table(["what", "value"], [("a|b", 1.5), ("", "two\nlines")])
    assert text == "| what | value |\n|---|---|\n| a\\|b | 1.5 |\n| | two lines |"
    page = render_html(text, Path("."))
    # the escaped bar is one cell holding "|", not a third column
    assert "<td>a|b</td><td>1.5</td></tr>" in page and page.count("<td>") == 4


def test_a_row_of_the_wrong_width_is_an_error():
    assert table(["a", "b"], [(1, 2)]).endswith("| 1 | 2 |")  # control: the right width passes
    with pytest.raises(ValueError, match="row 1 has 3 cells, the header 2"):
        table(["a", "b"], [(1, 2), (1, 2, 3)])
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        table(["a", "b"], [(1,)])


def test_section_joins_blocks_with_blank_lines():
    assert section("T", "one", "two") == "## T\n\none\n\ntwo"
    assert section("G", "x", level=3) == "### G\n\nx"


def test_figure_saves_and_closes(tmp_path):
    import matplotlib.pyplot as plt

    path = tmp_path / "sub" / "f.png"
    with figure(path, ncols=2, figsize=(4, 2)) as (fig, axes):
        assert len(axes) == 2
        axes[0].plot([0, 1], [1, 0])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and fig.number not in plt.get_fignums()
    # a failing body saves nothing and still closes its figure
    broken = tmp_path / "broken.png"
    with pytest.raises(RuntimeError), figure(broken, figsize=(4, 2)) as (fig, _):
        raise RuntimeError("drawing failed")
    assert not broken.exists() and fig.number not in plt.get_fignums()


def report_syntax_sites(source: str) -> list[tuple[int, str]]:
    """(line, what) for each hand-rolled Markdown table string and each matplotlib preamble or
    save in ``source``; docstrings are skipped."""
    tree = ast.parse(source)
    docstrings = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    sites = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            if ROW.search(n.value):
                sites.append((n.lineno, f"table row {n.value!r}"))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            f = n.func
            if f.attr == "savefig" or (
                f.attr == "use" and isinstance(f.value, ast.Name) and f.value.id == "matplotlib"
            ):
                sites.append((n.lineno, f"{f.attr}()"))
        elif isinstance(n, ast.Import | ast.ImportFrom):
            names = [a.name for a in n.names]
            mod = getattr(n, "module", None) or ""
            if "matplotlib.pyplot" in names or (mod == "matplotlib" and "pyplot" in names):
                sites.append((n.lineno, "import pyplot"))
    return sorted(sites)


def hand_rolled(root: Path, trees=TREES, toolkit=TOOLKIT) -> list[str]:
    """``path:line: what`` for each report-syntax site under ``trees``, outside ``toolkit``
    (paths relative to ``root``)."""
    return [
        f"{p.relative_to(root)}:{line}: {what}"
        for tree in trees
        for p in sorted(tree.rglob("*.py"))
        if p.relative_to(root).as_posix() not in toolkit
        for line, what in report_syntax_sites(p.read_text())
    ]


def test_no_report_syntax_outside_the_toolkit():
    # the walk reaches both trees: a benchmark script and a library module are among its files
    assert (ROOT / "benchmarks" / "sft_speed.py").is_file() and (
        SRC / "evidence" / "html.py"
    ).is_file()
    bad = hand_rolled(ROOT)
    assert not bad, "use tpulab.evidence.report_kit (table, figure):\n" + "\n".join(bad)


def test_the_walk_sees_a_hand_rolled_table_in_a_benchmark(tmp_path):
    """Negative control of the walk: a benchmark script's hand-rolled row and a library module's
    savefig are reported; the toolkit's own file is not."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "b.py").write_text('print("| a | b |")\n')
    lib = tmp_path / "src" / "tpulab" / "evidence"
    lib.mkdir(parents=True)
    (lib / "report_kit.py").write_text('A = "|---|"\n')
    (lib / "other.py").write_text("fig.savefig(p)\n")
    trees = (tmp_path / "src" / "tpulab", tmp_path / "benchmarks")
    assert hand_rolled(tmp_path, trees) == [
        "src/tpulab/evidence/other.py:1: savefig()",
        "benchmarks/b.py:1: table row '| a | b |'",
    ]


def test_the_report_syntax_check_can_fail():
    """Negative control: each hand-rolled form is seen; the toolkit's calls, a docstring showing a
    row, a ``|`` inside prose and an axis label are not."""
    source = '''
"""A docstring may show | a | b | rows."""
import matplotlib
import matplotlib.pyplot as plt
from matplotlib import pyplot
matplotlib.use("Agg")
A = "| a | b |"
B = "|---|---|"
C = f"| {x} | {y} |"
D = "|" + "---|" * 3
fig.savefig(path, dpi=110)
E = table(["a", "b"], rows)
F = "pretrain | sft | "
G = "|run - reference|"
H = cmap = matplotlib.colormaps["tab10"]
'''
    assert report_syntax_sites(source) == [
        (4, "import pyplot"),
        (5, "import pyplot"),
        (6, "use()"),
        (7, "table row '| a | b |'"),
        (8, "table row '|---|---|'"),
        (9, "table row ' |'"),
        (9, "table row '| '"),
        (10, "table row '---|'"),
        (11, "savefig()"),
    ], report_syntax_sites(source)
