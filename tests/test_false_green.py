"""Green that proved nothing (issue 27, items 3, 5, 6, 7, 8): a kernel that writes its inputs,
verdict code outside the staleness hash, code loaded dynamically, a run that selects no case,
tolerances that hold nothing. Each test fails without its fix."""

from __future__ import annotations

from tests.conftest import run_cli


# ---------------------------------------------------------------------------------------
# Item 7: a run that selects no case exits 1, with one line.


def test_a_shard_past_the_end_is_exit_1_one_line(fake_lab):
    r = run_cli(["run", "stage-OK", "--shard", "99/100"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "selects none of the 2 case(s)" in r.stderr, r.stderr
    assert not (fake_lab / "results" / "records" / "OK.jsonl").exists()


def test_an_arch_no_stage_has_is_exit_1(fake_lab):
    r = run_cli(["run", "stage-OK", "--arch", "sm_90a"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "no case to run" in r.stderr, r.stderr


def test_a_shard_that_selects_a_case_still_runs(fake_lab):
    r = run_cli(["run", "stage-OK", "--shard", "1/2"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------
# Item 8: tolerances that hold nothing are refused, in one line.

import io  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from harness import baselines, gate  # noqa: E402
from harness.baselines import BaselineError  # noqa: E402
from harness.spec import SpecError, load_spec  # noqa: E402

OK_TOL = "tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}"


def _spec_error(lab: Path, tol: str) -> str:
    path = lab / "stages.yaml"
    path.write_text(path.read_text().replace(OK_TOL, f"tolerances: {{out: {tol}}}"))
    with pytest.raises(SpecError) as exc:
        load_spec(root=lab)
    return str(exc.value)


@pytest.mark.parametrize("tol, says", [
    ("{cosine_min: -1}", "out of range — it must be more than 0 and at most 1"),
    ("{cosine_min: 0}", "out of range — it must be more than 0 and at most 1"),
    ("{rel_l2_max: 1.0e+300}", "out of range — it must be at least 0 and at most 1"),
    ("{rel_l2_max: 1.5, cosine_min: 0.9999}", "out of range — it must be at least 0 and at most 1"),
    ("{cosine_min: 0.5}", "bounds that hold nothing — give cosine_min >= 0.9 or rel_l2_max <= 0.5"),
    ("{rel_l2_max: 0.9}", "bounds that hold nothing"),
    ("{max_abs_max: 1.0e+300}", "bounds that hold nothing"),
    ("{cosine_min: 0.5, rel_l2_max: 0.8, max_abs_max: 0.1}", "bounds that hold nothing"),
])
def test_stage_tolerances_that_hold_nothing_are_one_line(fake_lab, tol, says):
    msg = _spec_error(fake_lab, tol)
    assert "\n" not in msg and msg.startswith("stages.yaml:12: stages.OK.tolerances.out") and says in msg, msg


def test_the_loosest_allowed_bounds_still_fail_a_minus_b(fake_lab):
    """`a - b` where the oracle says `a + b` (cosine ~0, rel_l2 ~1) fails under the loosest bounds
    the rule allows: cosine_min 0.9 alone, and rel_l2_max 0.5 alone."""
    path = fake_lab / "stages.yaml"
    text = path.read_text()
    for tol in ("{cosine_min: 0.9}", "{rel_l2_max: 0.5}"):
        path.write_text(text.replace("tolerances: {out: {cosine_min: 0.9999}}", f"tolerances: {{out: {tol}}}"))
        r = run_cli(["run", "stage-BAD", "--mode", "wrong"], cwd=fake_lab)
        assert r.returncode == 1 and "1 fail" in r.stdout, (tol, r.stdout + r.stderr)


def test_a_run_with_such_a_tolerance_is_refused_exit_2(fake_lab):
    path = fake_lab / "stages.yaml"
    path.write_text(path.read_text().replace("tolerances: {out: {cosine_min: 0.9999}}",
                                             "tolerances: {out: {cosine_min: -1}}"))
    r = run_cli(["run", "stage-BAD", "--mode", "wrong"], cwd=fake_lab)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stdout + r.stderr
    assert "stages.BAD.tolerances.out.cosine_min" in r.stderr
    assert not (fake_lab / "results" / "records" / "BAD.jsonl").exists()


BASE = """\
version: 1
baselines:
  OK:
    cpu:
      n=16:
        record: r.1
        src: abc
        metrics:
          out: {cosine: 0.99, rel_l2: 0.001, max_abs: 0.001}
"""


@pytest.mark.parametrize("tol, key", [
    ("{cosine: 2, rel_l2: 1.0e+300}", "tolerance.cosine"),
    ("{rel_l2: 1.0e+300}", "tolerance.rel_l2"),
    ("{max_abs: 5}", "tolerance.max_abs"),
    ("{cosine: 0.5}", "tolerance.cosine"),
])
def test_baseline_tolerances_that_hold_nothing_stop_the_gate(fake_lab, tol, key, capsys):
    path = fake_lab / "results" / "baselines.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(BASE + f"        tolerance: {tol}\n")
    with pytest.raises(BaselineError) as exc:
        baselines.load(fake_lab)
    text = str(exc.value)
    assert "\n" not in text and text.startswith(f"results/baselines.yaml:10: baselines.OK.cpu.n=16.{key}: "), text
    assert "holds nothing — give at most" in text
    assert gate.main(fake_lab, allow_run=False, out=io.StringIO()) == 2
    compile_base = BASE.replace("        metrics:\n          out: {cosine: 0.99, rel_l2: 0.001, max_abs: 0.001}\n",
                                "        kind: compile\n        compile: {status: compiled, regs: 90, inv: {}}\n")
    path.write_text(compile_base + "        tolerance: {regs: 1.0e+300}\n")
    with pytest.raises(BaselineError, match="tolerance.regs: 1e\\+300 holds nothing"):
        baselines.load(fake_lab)


def test_a_baseline_tolerance_in_bounds_loads(fake_lab):
    path = fake_lab / "results" / "baselines.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(BASE + "        tolerance: {cosine: 1.0e-3, rel_l2: 1.0, max_abs: 0.5}\n")
    (b,) = baselines.load(fake_lab)
    assert b.tolerance == {"cosine": 1e-3, "rel_l2": 1.0, "max_abs": 0.5}


def test_the_committed_stages_and_baselines_keep_to_the_bounds(project_root):
    spec = load_spec(root=project_root)
    assert spec.stages
    assert baselines.load(project_root, must_exist=True)
