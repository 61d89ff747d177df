"""The repo's own layering checks: the layer table read from docs/architecture.md (the one place it
is written) and the module import graph of a package with its cycles, from the source by ``ast``
(nothing imported, nothing outside the repo needed: a plain clone checks itself)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

# a row of the layer table: "| 3 | `checkpoint` | what lives there |"
_LAYER_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")


def layers_from_doc(text: str) -> list[set[str]]:
    """The packages of each layer, lowest first, from the Markdown table whose first column is the
    layer number and second the packages in backticks. Layers must be numbered 0, 1, 2, ..."""
    rows = [m for m in map(_LAYER_ROW.match, text.splitlines()) if m]
    numbers = [int(m.group(1)) for m in rows]
    if numbers != list(range(len(rows))) or not rows:
        raise ValueError(f"the layer table is not numbered 0..n in order: {numbers}")
    return [set(re.findall(r"`([a-z_]+)`", m.group(2))) for m in rows]


def modules(src: Path, pkg: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``pkg`` under ``src`` (a package by its
    ``__init__``'s name: ``tpulab.train``)."""
    out = {}
    for path in sorted((src / pkg).rglob("*.py")):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _targets(mods: dict[str, Path], here: str, node: ast.AST) -> list[str]:
    """The modules of ``mods`` an import statement in module ``here`` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: up from the module's package (a package's __init__ is its own)
        parts = here.split(".")
        keep = len(parts) - node.level + (mods[here].name == "__init__.py")
        base = ".".join(parts[:keep] + ([base] if base else []))
    named = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return [m for m in named if m in mods]


def import_graph(src: Path, pkg: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in the file: a function-level
    import still runs, and still closes a cycle)."""
    mods = modules(src, pkg)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            graph[m].update(t for t in _targets(mods, m, node) if t != m)
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module, iteratively (no recursion limit to raise)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_cycles(src: Path, pkg: str) -> list[list[str]]:
    """Groups of modules that import each other in a cycle. A group made only of package faces
    (``__init__``) is left out, as the shared tool this replaces did: faces that re-export each
    other's names are not modules that need each other to run."""
    mods = modules(src, pkg)
    groups = _strongly_connected(import_graph(src, pkg))
    return [g for g in groups if not all(mods[m].name == "__init__.py" for m in g)]
