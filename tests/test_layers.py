"""Oracles import nothing of the harness; no harness module hides a stdlib module."""

import ast
import sys
from pathlib import Path

from tests.test_imports import import_edges, lab_modules

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every import of the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.module or "", node.lineno))
    return out


def test_oracles_import_nothing_of_the_harness():
    bad = [f"{path.relative_to(ROOT)}:{line}: imports {name}"
           for path in sorted((ROOT / "oracles").rglob("*.py"))
           for name, line in _imports(path) if name == "harness" or name.startswith("harness.")]
    assert not bad, ("an oracle imports the harness (move the shared code into the oracle, and let the harness "
                     "import it):\n" + "\n".join(bad))


def test_no_harness_module_shadows_the_standard_library():
    names = {p.stem for p in (ROOT / "harness").rglob("*.py")} | {p.name for p in (ROOT / "harness").rglob("*")
                                                                  if p.is_dir() and (p / "__init__.py").is_file()}
    shadowing = sorted(names & set(sys.stdlib_module_names))
    assert not shadowing, f"harness modules named like standard-library modules (rename them): {shadowing}"


# Package layers, lowest first: a module imports its own layer or lower.
LAYERS = {
    "harness.core": 0,
    "harness.peers": 1,
    "harness.spec": 2,
    "harness.notebook": 3,
    "harness.execution": 4,
    "harness.remote": 5,
    "harness.workflows": 6,
    "harness.commands": 7,
    "cli": 8,
}


def layer_of(module: str) -> str | None:
    for name in sorted(LAYERS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return None


def violations(mods: dict[str, Path], root: Path = ROOT) -> list[str]:
    bad = []
    for mod, deps in import_edges(mods).items():
        lm = layer_of(mod)
        for dep, line in deps.items():
            ld = layer_of(dep)
            if lm is None or ld is None:
                continue
            if LAYERS[ld] > LAYERS[lm] or (LAYERS[ld] == LAYERS[lm] and ld != lm):
                bad.append(f"{mods[mod].relative_to(root)}:{line}: {mod} ({lm}) imports {dep} ({ld}), a higher or sibling layer")
    return sorted(bad)


def test_every_harness_module_sits_in_a_layer() -> None:
    mods = lab_modules()
    loose = [m for m in mods if m.startswith("harness.") and layer_of(m) is None]
    assert not loose, f"modules outside every layer package (move them, or name their layer in LAYERS): {loose}"


def test_no_import_runs_up_a_layer() -> None:
    bad = violations(lab_modules())
    assert not bad, "\n".join(bad)


def test_the_layer_check_sees_a_planted_upward_import(tmp_path: Path) -> None:
    low = tmp_path / "harness" / "core"
    high = tmp_path / "harness" / "commands"
    for d in (low, high):
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
    (low / "paths.py").write_text("def f():\n    from harness.commands import gate\n")
    (high / "gate.py").write_text("from harness.core import paths\n")
    mods = lab_modules(tmp_path)
    bad = violations(mods, tmp_path)
    assert len(bad) == 1 and "harness.core.paths" in bad[0] and ":2:" in bad[0], bad
