"""Imports that run the right way: the oracles (the math a kernel is judged by) import nothing
of the harness that judges them, and no harness module hides a standard-library module of the
same name (a `harness/inspect.py` read as `inspect` by tools that resolve names by file)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module named, line) for every import statement of the file, in functions too."""
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
