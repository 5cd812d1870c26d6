"""No import circle among harness/ and cli.py; a failure names each circle with file:lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("harness",)
TOP_MODULES = ("cli",)


def lab_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of the lab's own code."""
    mods = {name: root / f"{name}.py" for name in TOP_MODULES if (root / f"{name}.py").is_file()}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The lab module importing `name` loads, or None."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in mods:
            return cand
        parts.pop()
    return None


def import_edges(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported lab module: line of the first such import}."""
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".") if package else []
                    anchor = anchor[: len(anchor) - (node.level - 1)] if node.level > 1 else anchor
                    base = ".".join([*anchor, *([base] if base else [])])
                # name may be a module
                targets = [f"{base}.{a.name}" if base else a.name for a in node.names] or [base]
            for t in targets:
                dep = _resolve(t, mods)
                if dep is not None and dep != mod:
                    edges[mod].setdefault(dep, node.lineno)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """(a shortest circle, members) of each multi-module SCC (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[tuple[list[str], list[str]]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append((_circle(sorted(comp), edges), sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _circle(comp: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """A shortest circle through the component's first member (BFS)."""
    members = set(comp)
    start = comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def describe(found: tuple[list[str], list[str]], edges: dict[str, dict[str, int]], mods: dict[str, Path],
             root: Path = ROOT) -> str:
    circle, members = found
    steps = [f"{a} ({mods[a].relative_to(root)}:{edges[a][b]})" for a, b in zip(circle, circle[1:])]
    text = "import circle: " + " → ".join(steps) + f" → {circle[-1]}"
    others = [m for m in members if m not in circle]
    return text + (f" (tied in the same knot: {', '.join(others)})" if others else "")


def test_no_import_circles_in_the_lab():
    mods = lab_modules()
    assert "cli" in mods and "harness.notebook.records" in mods
    edges = import_edges(mods)
    found = cycles(edges)
    assert not found, ("modules import each other (move the shared part into a module of its own):\n"
                       + "\n".join(describe(c, edges, mods) for c in found))


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "harness"
    pkg.mkdir()
    (tmp_path / "cli.py").write_text("def main():\n    from harness import a\n")
    (pkg / "a.py").write_text("import harness.b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import x\n")
    (pkg / "c.py").write_text("def g():\n    from harness.a import y\n")
    (pkg / "d.py").write_text("import os\nfrom harness import c\n")
    mods = lab_modules(tmp_path)
    edges = import_edges(mods)
    assert edges["cli"] == {"harness.a": 2} and edges["harness.b"] == {"harness.c": 2}
    found = cycles(edges)
    assert found == [(["harness.a", "harness.b", "harness.c", "harness.a"], ["harness.a", "harness.b", "harness.c"])]
    text = describe(found[0], edges, mods, tmp_path)
    assert text == ("import circle: harness.a (harness/a.py:1) → harness.b (harness/b.py:2) → "
                    "harness.c (harness/c.py:2) → harness.a")
