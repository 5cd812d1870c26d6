"""A suite stage's one baseline (harness/notebook/baselines.py: suite): taken only when every case of
its list passed, held by the gate from the source hash alone once the records are retired to git
history, re-proven case by case when the source moves; compaction retires the records it stands for."""

import io
import json
import lzma
import subprocess

import pytest

from harness.notebook import baselines
from harness.notebook.records import stage_file
from harness.notebook.retired import read_retired
from harness.workflows import gate
from tests.conftest import commit_all, run_cli
from tests.test_notebook_size import _compact_script
from tests.test_suites import _fresh_oracles, _records, suite_lab  # noqa: F401  (fixtures)


def _decide(lab, allow_run=False):
    out = io.StringIO()
    return gate.main(lab, allow_run=allow_run, out=out), out.getvalue()


def _suites(lab):
    return [b for b in baselines.load(lab) if b.kind == "suite"]


def _accepted(lab):
    r = run_cli(["run", "stage-SUITE"], cwd=lab)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli(["baseline", "accept", "stage-SUITE"], cwd=lab)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_accept_takes_one_baseline_for_the_whole_list(suite_lab):
    r = _accepted(suite_lab)
    run = _records(suite_lab, "SUITE")[0]["run"]
    assert f"baseline stage-SUITE cpu all-cases: all 2 cases pass ← runs {run} (suite" in r.stdout
    (b,) = _suites(suite_lab)
    assert (b.stage, b.arch, b.case, b.suite) == ("SUITE", "cpu", "all-cases", {"cases": 2, "runs": [run]})
    assert [x for x in baselines.load(suite_lab) if x.stage == "SUITE"] == [b]  # no per-case baselines beside it
    text = lzma.decompress((suite_lab / "results" / "baselines.yaml.xz").read_bytes()).decode()
    assert "all-cases: {kind: suite, record: " in text and "suite: {cases: 2, runs: [" in text
    shown = run_cli(["baseline", "show", "stage-SUITE"], cwd=suite_lab)
    assert shown.returncode == 0 and "baselines (suite" in shown.stdout and run in shown.stdout


def test_accept_replaces_per_case_baselines_and_drop_gone_keeps_it(suite_lab):
    _accepted(suite_lab)
    old = baselines.Baseline("SUITE", "cpu", "n=16,id=0", "x.1", "src", metrics={"out": {"cosine": 1.0}})
    baselines.save(suite_lab, baselines.load(suite_lab) + [old])
    assert run_cli(["baseline", "accept", "stage-SUITE"], cwd=suite_lab).returncode == 0
    assert [b.case for b in baselines.load(suite_lab) if b.stage == "SUITE"] == ["all-cases"]
    r = run_cli(["baseline", "drop", "stage-SUITE", "--gone"], cwd=suite_lab)
    assert r.returncode == 0 and "nothing gone" in r.stdout, r.stdout + r.stderr
    assert len(_suites(suite_lab)) == 1
    r = run_cli(["baseline", "drop", "stage-SUITE"], cwd=suite_lab)  # the whole stage: its one baseline too
    assert r.returncode == 0 and _suites(suite_lab) == []


def test_accept_refuses_a_list_with_a_failure_or_a_case_not_run(suite_lab):
    r = run_cli(["run", "stage-NUDGE"], cwd=suite_lab)
    assert r.returncode == 1
    r = run_cli(["baseline", "accept", "stage-NUDGE"], cwd=suite_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "stage-NUDGE cpu: no suite baseline — it holds every one of the 2 cases passing, and 2 failed (" in r.stdout
    assert "(n=16,id=0: fail " in r.stdout
    assert run_cli(["run", "stage-SUITE", "--n", "16"], cwd=suite_lab).returncode == 0
    r = run_cli(["baseline", "accept", "stage-SUITE"], cwd=suite_lab)
    assert r.returncode == 1 and "1 have no result for the current source (n=32,id=1)" in r.stdout, r.stdout
    r = run_cli(["baseline", "accept", "stage-SUITE", "--n", "16"], cwd=suite_lab)
    assert r.returncode == 2 and r.stderr.strip() == ("dsv4-lab: stage-SUITE is a suite: its baseline holds every one "
                                                      "of its 2 cases — accept it without filters"), r.stderr
    assert _suites(suite_lab) == []


def test_the_gate_holds_it_from_the_source_alone_and_reproves_it_when_the_source_moves(suite_lab):
    _accepted(suite_lab)
    stage_file(suite_lab, "SUITE").write_text("")  # its records retired: nothing live
    code, out = _decide(suite_lab)
    assert code == 0 and "gate: pass" in out, out
    crit = suite_lab / "oracles" / "suite_add.py"
    crit.write_text(crit.read_text() + "\nMOVED = 1\n")  # the source moves, the rule does not
    code, out = _decide(suite_lab)
    assert code == 1, out
    assert "gate: stale" in out and "dsv4-lab run stage-SUITE --arch cpu" in out
    code, out = _decide(suite_lab, allow_run=True)  # re-proven here: both cases run and pass
    assert code == 0 and "gate: pass" in out and "all 2 pass at the new source — re-accept it" in out, out
    assert len(_records(suite_lab, "SUITE")) == 2
    crit.write_text(crit.read_text().replace("d < 1e-6", "d < -1.0"))  # now the rule fails every case
    code, out = _decide(suite_lab, allow_run=True)
    assert code == 1 and "gate: REGRESSIONS" in out, out
    assert "stage-SUITE cpu n=16,id=0  status" in out and "stage-SUITE cpu n=32,id=1  status" in out


def test_a_case_missing_after_the_source_moved_leaves_it_stale(suite_lab):
    _accepted(suite_lab)
    crit = suite_lab / "oracles" / "suite_add.py"
    crit.write_text(crit.read_text() + "\nMOVED = 1\n")
    assert run_cli(["run", "stage-SUITE", "--n", "16"], cwd=suite_lab).returncode == 0
    code, out = _decide(suite_lab)
    assert code == 1 and "gate: stale" in out and "REGRESSIONS" not in out, out


def test_compaction_retires_what_the_suite_baseline_stands_for(suite_lab):
    _accepted(suite_lab)
    ids = [r["id"] for r in _records(suite_lab, "SUITE")]
    (b,) = _suites(suite_lab)
    commit_all(suite_lab, "suite run")
    compact = _compact_script()
    assert compact.main(suite_lab) == 0
    assert stage_file(suite_lab, "SUITE").read_text() == ""  # both moved to the archive (none at HEAD yet)
    commit_all(suite_lab, "archived")
    assert compact.main(suite_lab) == 0
    (e,) = [x for x in read_retired(suite_lab) if x["stage"] == "SUITE"]
    assert b.record == ids[0].split(".")[0] and e["lines"] == len(ids) == 2  # it names the run: every line goes
    assert not (suite_lab / "results" / "archive" / "SUITE.jsonl.xz").exists()
    held = subprocess.run(e["how"].split(), cwd=suite_lab, capture_output=True, check=True).stdout
    assert set(ids) <= {json.loads(x)["id"] for x in lzma.decompress(held).splitlines() if x.strip()}
    code, out = _decide(suite_lab)
    assert code == 0 and "gate: pass" in out, out
    r = run_cli(["dashboard"], cwd=suite_lab, env_extra={"COLUMNS": "220"})
    line = next(x for x in r.stdout.splitlines() if "stage-SUITE" in x)
    assert "suite baseline: runs" in line and "✓ 2/2" in line, r.stdout


def test_records_of_another_source_are_not_taken_for_the_suite(suite_lab):
    """Records at the current source stay live when the suite baseline holds an older one."""
    _accepted(suite_lab)
    crit = suite_lab / "oracles" / "suite_add.py"
    crit.write_text(crit.read_text() + "\nMOVED = 1\n")
    assert run_cli(["run", "stage-SUITE"], cwd=suite_lab).returncode == 0
    commit_all(suite_lab, "new source")
    assert _compact_script().main(suite_lab) == 0
    live = [json.loads(x) for x in stage_file(suite_lab, "SUITE").read_text().splitlines() if x.strip()]
    sealed = suite_lab / "results" / "records" / "SUITE.jsonl.xz"
    if sealed.exists():
        live += [json.loads(x) for x in lzma.decompress(sealed.read_bytes()).splitlines() if x.strip()]
    assert len(live) == 2  # the new source's two; the old two archived as stale


@pytest.mark.parametrize("label, body, says", [
    ("all-cases", "suite: {cases: 2, runs: []}", "suite.runs: expected a non-empty list"),
    ("all-cases", "suite: {cases: 0, runs: [r]}", "suite.cases: 0 cases hold nothing"),
    ("all-cases", "suite: {cases: 2}", "missing 'runs'"),
    ("all-cases", "metrics: {out: {cosine: 1.0}}, suite: {cases: 2, runs: [r]}", "metrics: unknown key"),
    ("n=16,id=0", "suite: {cases: 2, runs: [r]}", "a suite baseline is labelled all-cases"),
])
def test_a_bad_suite_baseline_is_one_line(suite_lab, label, body, says):
    text = f"version: 1\nbaselines:\n  SUITE:\n    cpu:\n      {label}: {{kind: suite, record: r, src: s, {body}}}\n"
    (suite_lab / "results").mkdir(exist_ok=True)
    (suite_lab / "results" / "baselines.yaml.xz").write_bytes(lzma.compress(text.encode()))
    r = run_cli(["gate", "--no-run"], cwd=suite_lab)
    err = r.stderr.strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err and says in err, err


def test_run_missing_resumes_a_run_cut_short(suite_lab):
    import os
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "run_missing.py"

    def resume(stage):
        return subprocess.run([sys.executable, str(script), stage, "--arch", "cpu"], cwd=suite_lab, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(script.parent.parent)})

    assert run_cli(["run", "stage-SUITE", "--n", "16"], cwd=suite_lab).returncode == 0
    r = resume("stage-SUITE")
    assert r.returncode == 0 and "1 of 2 cases have a verdict for the current source (0 not a pass); running the other 1" \
        in r.stdout, r.stdout + r.stderr
    assert [x["case"]["n"] for x in _records(suite_lab, "SUITE")] == [16, 32]
    r = resume("SUITE")
    assert r.returncode == 0 and "running the other 0" in r.stdout and len(_records(suite_lab, "SUITE")) == 2
    assert run_cli(["run", "stage-NUDGE"], cwd=suite_lab).returncode == 1
    r = resume("stage-NUDGE")
    assert r.returncode == 1 and "(2 not a pass)" in r.stdout, r.stdout
    assert resume("stage-NOPE").returncode == 2
