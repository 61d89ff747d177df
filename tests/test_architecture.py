"""The layers depend one way, nothing imports in a cycle, and src/ reads no test-only switch."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO

SRC = REPO / "src" / "tpulab"
# Lower layers first. A package may import its own layer and the layers below it, never above.
LAYERS = [
    {
        "errors",
        "config",
        "compile_cache",
        "progress",
        "libtpu_env",
        "hostmem",
        "process_setup",
        "lazy",
    },
    {"data", "envs"},
    {"model"},
    {"checkpoint"},
    {"evidence"},
    {"train"},
    {"proofs"},
    {"inference", "bridge", "cloud", "tracking"},
    {"perf", "ops", "posttrain"},
    {"orchestrate"},
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return {m for m in out if m == "tpulab" or m.startswith("tpulab.")}


def _unit(module_or_path) -> str:
    parts = (
        module_or_path.split(".")
        if isinstance(module_or_path, str)
        else module_or_path.relative_to(SRC).with_suffix("").parts
    )
    parts = [p for p in parts if p != "tpulab"] if isinstance(module_or_path, str) else list(parts)
    return parts[0] if parts else ""


def test_every_package_has_a_layer():
    units = {_unit(p) for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC}
    assert units <= set(RANK), f"declare a layer for: {sorted(units - set(RANK))}"


def test_imports_only_go_down_the_layers():
    bad = []
    for path in SRC.rglob("*.py"):
        if path.parent == SRC and path.name == "__init__.py":
            continue
        here = _unit(path)
        for mod in _imports(path):
            there = _unit(mod)
            if there and RANK.get(there, -1) > RANK[here]:
                bad.append(f"{path.relative_to(SRC)} imports {mod} ({here} -> {there})")
    assert not bad, "\n".join(sorted(bad))


CYCLES_TOOL = Path("shared") / "tools" / "import_cycles.py"  # beside the repo (CI has it)


def find_cycles_tool(start: Path) -> Path | None:
    """The shared import-cycle tool in ``start``'s parent or the nearest ancestor that has one (a
    helper's worktree sits one level deeper than the main checkout)."""
    return next((d / CYCLES_TOOL for d in start.parents if (d / CYCLES_TOOL).is_file()), None)


def test_no_import_cycles_between_modules():
    script = find_cycles_tool(REPO)
    # A missing tool is a failure, never a silent pass: this check is claimed in the docs.
    assert script is not None, (
        f"{CYCLES_TOOL} not found beside {REPO} or above it (CI provides ../{CYCLES_TOOL})"
    )
    result = subprocess.run(
        [sys.executable, str(script), str(REPO / "src"), "tpulab"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_the_cycles_tool_lookup_can_come_up_empty(tmp_path):
    """Control: where no shared/tools dir exists above, the lookup finds nothing, and the cycle test
    above then fails with its message instead of returning."""
    repo = tmp_path / "clone"
    repo.mkdir()
    assert find_cycles_tool(repo) is None
    (tmp_path / CYCLES_TOOL).parent.mkdir(parents=True)
    (tmp_path / CYCLES_TOOL).write_text("")
    assert find_cycles_tool(repo) == tmp_path / CYCLES_TOOL


def test_the_library_never_imports_the_cli():
    users = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if _unit(p) != "cli" and any(m.startswith("tpulab.cli") for m in _imports(p))
    ]
    assert not users


def _handler_names(parser) -> dict[str, str]:
    """``"tpulab a b"`` -> the name of the function that subcommand runs, for every leaf."""
    import argparse

    out = {}

    def walk(p, path):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[path] = getattr(p.get_default("handler"), "__name__", "no handler")
        for a in subs:
            for name, q in a.choices.items():
                walk(q, f"{path} {name}")

    walk(parser, parser.prog)
    return out


def _misnamed(names: dict[str, str]) -> dict[str, str]:
    """Handlers not named ``cmd_`` + the last words of their command."""
    wrong = {}
    for cmd, fn in names.items():
        words = cmd.replace("-", "_").split()[1:]
        if fn not in {"cmd_" + "_".join(words[i:]) for i in range(len(words))}:
            wrong[cmd] = fn
    return wrong


def test_every_cli_handler_is_named_cmd():
    """One convention for the handlers of every CLI module: ``cmd_`` and the last words of the
    command (``tpulab bridge prove-resume`` -> ``cmd_prove_resume``, ``tpulab image build`` ->
    ``cmd_image_build`` where one module holds two groups)."""
    from tpulab.cli.main import build_parser

    names = _handler_names(build_parser())
    assert len(names) > 40, names
    assert _misnamed(names) == {}


def test_the_handler_name_check_can_fail():
    import argparse

    def cmd_d(args):
        return 0

    parser = argparse.ArgumentParser(prog="x")
    sub = parser.add_subparsers()
    sub.add_parser("a").set_defaults(handler=lambda args: 0)
    sub.add_parser("b")
    group = sub.add_parser("c").add_subparsers()
    group.add_parser("d").set_defaults(handler=cmd_d)
    group.add_parser("e-f").set_defaults(handler=cmd_d)
    group.add_parser("d-e").set_defaults(handler=test_the_handler_name_check_can_fail)
    assert _misnamed(_handler_names(parser)) == {
        "x a": "<lambda>",
        "x b": "no handler",
        "x c e-f": "cmd_d",
        "x c d-e": "test_the_handler_name_check_can_fail",
    }


def test_src_reads_no_test_only_environment_variable():
    pattern = re.compile(r"""environ(?:\.get)?\s*[\[(]\s*["'](TPULAB_[A-Z_]+)""")
    found = {m.group(1) for p in SRC.rglob("*.py") for m in pattern.finditer(p.read_text())}
    allowed = {"TPULAB_COMPILE_CACHE"}  # a user setting (README), not a test switch
    assert found <= allowed, sorted(found - allowed)
    for p in SRC.rglob("*.py"):
        assert "HOLD_AFTER_STEP" not in p.read_text() and "WITHHOLD_COMMIT" not in p.read_text(), p
