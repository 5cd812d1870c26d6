"""A record's identity covers what can change its verdict; comment-only edits keep it."""

import shutil
from pathlib import Path

import pytest

from harness.spec import identity
from harness.spec.identity import source_hash
from harness.spec.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent


def h(lab: Path, stage: str = "OK", arch: str = "cpu") -> str:
    spec = load_spec(root=lab)
    return source_hash(lab, spec.stages[stage], arch)


@pytest.fixture
def lab_with_own_harness(fake_lab, tmp_path, monkeypatch):
    """Fake lab plus a copy of harness/ hashed as the verdict code."""
    copy = tmp_path / "labcode" / "harness"
    shutil.copytree(ROOT / "harness", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(identity, "HARNESS_DIR", copy)
    return fake_lab, copy


@pytest.mark.parametrize("module", ["execution/metrics.py", "execution/worker.py", "execution/compile.py",
                                    "spec/spec.py"])
def test_a_change_to_the_lab_code_that_judges_makes_results_stale(lab_with_own_harness, module):
    lab, code = lab_with_own_harness
    before = h(lab)
    path = code / module
    path.write_text(path.read_text() + "\nHALVE_OUTPUTS = 0.5\n")
    assert h(lab) != before


def test_a_change_to_lab_code_that_does_not_judge_keeps_results_fresh(lab_with_own_harness):
    lab, code = lab_with_own_harness
    before = h(lab)
    for module in ("workflows/dashboard.py", "workflows/history.py", "workflows/gate.py", "commands/compile.py"):
        path = code / module
        path.write_text(path.read_text() + "\nX = 1\n")
    assert h(lab) == before


def test_loosening_a_tolerance_makes_results_stale(fake_lab):
    before = h(fake_lab)
    text = (fake_lab / "stages.yaml").read_text()
    (fake_lab / "stages.yaml").write_text(text.replace("cosine_min: 0.9999, rel_l2_max: 1.0e-6",
                                                      "cosine_min: 0.9, rel_l2_max: 1.0e-6", 1))
    assert h(fake_lab) != before


def test_loosening_a_tolerance_by_an_axis_value_makes_results_stale(fake_lab):
    """Adding or loosening an output's `by:` bounds changes the hash."""
    text = (fake_lab / "stages.yaml").read_text()
    before = h(fake_lab)
    hashes = []
    for bound in ("1.0e-5", "1.0e-4"):
        (fake_lab / "stages.yaml").write_text(text.replace(
            "cosine_min: 0.9999, rel_l2_max: 1.0e-6", f"cosine_min: 0.9999, rel_l2_max: 1.0e-6, by: {{n: {{32: {{rel_l2_max: {bound}}}}}}}", 1))
        hashes.append(h(fake_lab))
    assert len({before, *hashes}) == 3


def test_the_title_and_comments_in_stages_yaml_keep_results_fresh(fake_lab):
    before = h(fake_lab)
    text = (fake_lab / "stages.yaml").read_text()
    (fake_lab / "stages.yaml").write_text("# a comment\n" + text.replace("out = a + b, correct", "renamed"))
    assert h(fake_lab) == before


def test_a_relative_import_is_followed(fake_lab):
    kernel = fake_lab / "stages" / "fake" / "cpu.py"
    (fake_lab / "stages" / "fake" / "helper.py").write_text("SCALE = 1\n")
    kernel.write_text("from .helper import SCALE  # noqa: F401\n" + kernel.read_text())
    before = h(fake_lab)
    (fake_lab / "stages" / "fake" / "helper.py").write_text("SCALE = 2\n")
    assert h(fake_lab) != before
    (fake_lab / "stages" / "fake" / "other.py").write_text("Y = 1\n")
    kernel.write_text("from . import other  # noqa: F401\n" + kernel.read_text())
    before = h(fake_lab)
    (fake_lab / "stages" / "fake" / "other.py").write_text("Y = 2\n")
    assert h(fake_lab) != before


def test_an_absolute_import_of_any_lab_module_and_package_inits_are_followed(fake_lab):
    (fake_lab / "oracles" / "extra.py").write_text("K = 1\n")
    oracle = fake_lab / "oracles" / "add.py"
    oracle.write_text("import oracles.extra  # noqa: F401\n" + oracle.read_text())
    before = h(fake_lab)
    (fake_lab / "oracles" / "extra.py").write_text("K = 2\n")
    assert h(fake_lab) != before
    before = h(fake_lab)
    init = fake_lab / "stages" / "fake" / "__init__.py"
    init.write_text(init.read_text() + "\nINIT_SIDE_EFFECT = 1\n")
    assert h(fake_lab) != before


def test_comment_and_blank_line_edits_keep_results_fresh_but_code_edits_do_not(fake_lab):
    kernel = fake_lab / "stages" / "fake" / "cpu.py"
    text = kernel.read_text()
    before = h(fake_lab)
    kernel.write_text(text.replace("import time\n", "import time  # a note\n\n\n# more notes\n"))
    assert h(fake_lab) == before
    kernel.write_text(text.replace("out.copy_(a + b)", "out.copy_(a + b + 0)", 1))
    assert h(fake_lab) != before
    kernel.write_text(text.replace('"kernel raised on purpose"', '"kernel raised on purpose!"'))
    assert h(fake_lab) != before


def test_a_module_that_does_not_tokenize_is_hashed_by_its_bytes(fake_lab):
    kernel = fake_lab / "stages" / "fake" / "cpu.py"
    helper = fake_lab / "stages" / "fake" / "broken.py"
    helper.write_text("X = '''unterminated\n")
    kernel.write_text("from . import broken  # noqa: F401\n" + kernel.read_text())
    before = h(fake_lab)
    helper.write_text("X = '''unterminated\n# more\n")
    assert h(fake_lab) != before


def test_the_code_text_of_a_python_file_is_the_same_under_every_python_version():
    """f-string tokenisation (3.12 vs 3.11) does not change the hash."""
    from harness.spec.identity import code_text

    src = b'x = f"{a!r:>{w}} # not a comment"  # a comment\n\n\n    \ny = "#" + f\'{b}\'\t\n# only a comment\n'
    assert code_text(src) == b'x = f"{a!r:>{w}} # not a comment"\ny = "#" + f\'{b}\''


def _other_pythons() -> list[str]:
    import sys

    mine = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [p for p in (shutil.which(f"python3.{m}") for m in range(9, 15) if f"python3.{m}" != mine) if p]


@pytest.mark.skipif(not _other_pythons(), reason="no second Python version on this machine to compare with")
def test_every_lab_file_hashes_the_same_under_other_python_versions():
    """Every lab .py hashes the same under 3.11 and 3.12."""
    import hashlib
    import json
    import subprocess

    files = sorted(str(p.relative_to(ROOT)) for d in ("harness", "stages", "oracles", "tests") for p in (ROOT / d).rglob("*.py"))
    script = ("import hashlib, json, sys; sys.path.insert(0, sys.argv[1]); from harness.spec.codetext import code_text\n"
              "out = {}\n"
              "for f in json.loads(sys.argv[2]):\n"
              "    try: out[f] = hashlib.sha256(code_text(open(sys.argv[1] + '/' + f, 'rb').read())).hexdigest()\n"
              "    except ValueError: out[f] = 'does not tokenize'\n"
              "print(json.dumps(out))\n")
    from harness.spec.codetext import code_text

    def here(f: str) -> str:
        try:
            return hashlib.sha256(code_text((ROOT / f).read_bytes())).hexdigest()
        except ValueError:
            return "does not tokenize"

    mine = {f: here(f) for f in files}
    for python in _other_pythons():
        r = subprocess.run([python, "-c", script, str(ROOT), json.dumps(files)], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            continue  # a Python too old for the module's syntax
        theirs = json.loads(r.stdout)
        differ = [f for f in files if theirs[f] != mine[f]]
        assert not differ, f"{python}: {differ[:5]}"
