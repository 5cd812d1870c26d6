"""The newcomer's install is the one CI tested: bounds, pins, README, .ci/run."""

import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import ROOT

tomllib = pytest.importorskip("tomllib")

PROJECT = "dsv4-lab"
# FlashAttention-4: installed by hand, unpinnable.
UNPINNED_EXTRAS = {"peers"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(project: dict) -> list[tuple[str, Requirement]]:
    """(where, requirement) of the deps and extras but UNPINNED_EXTRAS."""
    out = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        if extra not in UNPINNED_EXTRAS:
            out += [(f"optional-dependencies.{extra}", Requirement(r)) for r in reqs]
    return out


def constraint_pins(text: str) -> dict[str, Version]:
    """name -> pin of a constraints file; every line `name==version`."""
    pins: dict[str, Version] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s;+]*)", line)
        assert m, f"constraints.txt:{n}: {line!r} is not an exact pin `name==version` (no local label like +cpu)"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt:{n}: {m.group(1)} pinned twice"
        pins[name] = Version(m.group(2))
    return pins


def bound_problems(project: dict, pins: dict[str, Version]) -> list[str]:
    """Every requirement is bounded both ways; its pin inside."""
    problems = []
    extras = set(project.get("optional-dependencies", {}))
    for where, req in _requirements(project):
        name = canonicalize_name(req.name)
        if name == PROJECT:  # dev -> sass
            missing = req.extras - extras
            if missing:
                problems.append(f"{where}: {req} names extras that do not exist: {sorted(missing)}")
            continue
        ops = {s.operator for s in req.specifier}
        if not ops & {"==", "===", "~=", "<", "<="}:
            problems.append(f"{where}: {req} has no upper bound — add `<NEXT_MAJOR`")
        if not ops & {"==", "===", "~=", ">", ">="}:
            problems.append(f"{where}: {req} has no lower bound — add `>=` the release constraints.txt pins")
        if name not in pins:
            problems.append(f"{where}: {req.name} is not pinned in constraints.txt")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{where}: constraints.txt pins {req.name}=={pins[name]}, outside {req.specifier}")
    return problems


def test_every_dependency_is_bounded_and_pinned_within_its_bounds():
    problems = bound_problems(_pyproject()["project"], constraint_pins((ROOT / "constraints.txt").read_text()))
    assert not problems, "\n".join(problems)


def test_the_check_catches_an_unbounded_or_unpinned_dependency():
    """Not vacuous: the pre-pinning pyproject.toml fails it."""
    old = {"dependencies": ["nvidia-cutlass-dsl==4.8.1", "torch", "rich>=13"],
           "optional-dependencies": {"dev": ["pytest"], "sass": ["nvidia-cuda-nvdisasm>=13"], "peers": ["x"],
                                     "all": ["dsv4-lab[nope]"]}}
    pins = {"nvidia-cutlass-dsl": Version("4.8.1"), "torch": Version("2.13.0"), "rich": Version("12.0")}
    problems = "\n".join(bound_problems(old, pins))
    for needle in ("torch has no upper bound", "torch has no lower bound", "rich>=13 has no upper bound",
                   "pins rich==12.0, outside >=13", "pytest is not pinned", "nvidia-cuda-nvdisasm is not pinned",
                   "extras that do not exist: ['nope']"):
        assert needle in problems, (needle, problems)
    assert "cutlass" not in problems and "'x'" not in problems


def test_constraints_pin_the_whole_install_exactly():
    pins = constraint_pins((ROOT / "constraints.txt").read_text())
    # transitive deps too
    for name in ("click", "nvidia-cutlass-dsl-libs-base", "cuda-bindings", "markdown-it-py", "pluggy"):
        if name == "click" and name not in pins:
            continue  # typer vendors click; nothing to pin
        assert name in pins, f"{name} is installed by the README's install but not pinned"
    with pytest.raises(AssertionError, match="not an exact pin"):
        constraint_pins("torch==2.13.0+cpu\n")
    with pytest.raises(AssertionError, match="not an exact pin"):
        constraint_pins("rich>=15\n")


def _readme_install_line() -> str:
    lines = [ln.strip() for ln in (ROOT / "README.md").read_text().splitlines()
             if ln.startswith("    pip install ") and "dsv4-lab run" in ln]
    assert len(lines) == 1, f"README.md: expected one install line (pip install … && dsv4-lab run …), got {lines}"
    return lines[0]


def test_readme_installs_with_the_constraints():
    line = _readme_install_line()
    installs = [part.strip() for part in line.split("&&") if part.strip().startswith("pip install")]
    assert installs and all(" -c constraints.txt " in f" {p} " for p in installs), line
    assert any('-e ".[dev]"' in p for p in installs), line
    assert "torch==" not in line, "a torch pin here would bypass constraints.txt's: the constraints pick torch"
    assert "\n    python3 -m pytest -q\n" in (ROOT / "README.md").read_text()


def test_ci_builds_its_venv_from_the_readme_line_and_runs_the_suite_again_only_on_newer_releases():
    ci = (ROOT / ".ci" / "run").read_text()
    code = "\n".join(ln for ln in ci.splitlines() if not ln.lstrip().startswith("#"))
    pattern = re.search(r"grep -m1 -E '([^']+)' README\.md", code)
    assert pattern, "the CI must read its install line from README.md"
    readme = (ROOT / "README.md").read_text().splitlines()
    assert [ln for ln in readme if re.search(pattern.group(1), ln)][0].strip() == _readme_install_line()
    assert 'eval "$install"' in code and "python3 -m venv" in code
    # the whole suite, the README's way, in each venv
    runs = re.findall(r"python3 -m pytest[^)\n]*", code)
    assert runs == ["python3 -m pytest -q", "python3 -m pytest -q"], runs
    newest = code.split('newest="$work/newest-venv"', 1)[1]  # the second venv: newest allowed
    assert "--upgrade" in newest and "constraints.txt" not in newest
    # again only on other releases, under the deadline
    assert 'freeze "$fresh" > "$work/readme-freeze.txt"' in code and 'freeze "$newest" > "$work/newest-freeze.txt"' in newest
    assert 'if diff "$work/readme-freeze.txt" "$work/newest-freeze.txt"' in newest
    assert "DSV4_CI_DEADLINE=$(($(date +%s) + left))" in newest and "left=$((4500 - (SECONDS - start)))" in newest
    assert "|| true" not in code and "set -euo pipefail" in code


def test_a_test_not_started_by_the_ci_deadline_skips_saying_so(tmp_path):
    import os
    import subprocess
    import sys
    import time

    test = "tests/test_pins.py::test_every_dependency_is_bounded_and_pinned_within_its_bounds"
    for deadline, want in ((time.time() - 1, "1 skipped"), (time.time() + 600, "1 passed")):
        env = {**os.environ, "DSV4_CI_DEADLINE": str(deadline)}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
        assert want in r.stdout and r.returncode == 0, r.stdout + r.stderr
        assert ("not run: CI's time" in r.stdout) == (want == "1 skipped"), r.stdout
