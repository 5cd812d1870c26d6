"""Worker isolation: each failure gets its status; the run goes on; Ctrl-C keeps results."""

import json
import os
import signal
import subprocess
import sys
import time

from harness.notebook.records import read_records, read_runs
from tests.conftest import ROOT, run_cli


def test_every_bad_case_gets_its_status_and_the_run_goes_on(fake_lab):
    t0 = time.monotonic()
    r = run_cli(["run", "--all"], cwd=fake_lab)
    wall = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    recs = read_records(fake_lab)
    by_mode = {rec.case.get("mode", f"ok{rec.case['n']}"): rec for rec in recs}
    assert by_mode["abort"].status == "crash" and "SIGABRT" in by_mode["abort"].error
    assert by_mode["hang"].status == "timeout" and "5 s" in by_mode["hang"].error
    assert by_mode["raise"].status == "crash" and "kernel raised on purpose" in by_mode["raise"].error
    assert by_mode["wrong"].status == "fail" and by_mode["wrong"].metrics["out"]["cosine"] < 0.9
    assert by_mode["unwritten"].status == "fail" and by_mode["unwritten"].metrics["out"]["unwritten"] == 8
    assert by_mode["ok"].status == "pass"          # after the bad ones: the run went on
    assert by_mode["ok16"].status == by_mode["ok32"].status == "pass"
    assert len(recs) == 8
    assert wall < 60
    runs = read_runs(fake_lab)
    (run,) = runs.values()
    assert run["interrupted"] is False and run["counts"] == {"pass": 3, "crash": 2, "timeout": 1, "fail": 2}
    assert "2 crash" in r.stdout and "1 timeout" in r.stdout


def test_passing_run_exits_zero_and_filters_apply(fake_lab):
    r = run_cli(["run", "stage-BAD", "--mode", "ok"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [rec.case["mode"] for rec in read_records(fake_lab)] == ["ok"]


def test_bad_filter_is_one_line_exit_2(fake_lab):
    r = run_cli(["run", "stage-BAD", "--mode", "sideways"], cwd=fake_lab)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "mode=sideways is not in the matrix" in r.stderr


def test_ctrl_c_keeps_finished_records_and_marks_run_interrupted(fake_lab):
    """SIGINT to the group: the case in flight is dropped, not a crash."""
    env = {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "stage-BAD", "--mode", "ok,hang", "--timeout", "60"],
                            cwd=fake_lab, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not read_records(fake_lab):
        time.sleep(0.2)
    assert read_records(fake_lab), "the ok case should be recorded while the hang case runs"
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    recs = read_records(fake_lab)
    assert [r.case["mode"] for r in recs] == ["ok"] and recs[0].status == "pass"
    (run,) = read_runs(fake_lab).values()
    assert run["interrupted"] is True
    for line in (fake_lab / "results" / "records" / "BAD.jsonl").read_text().splitlines():
        json.loads(line)  # nothing half-written


def test_the_results_table_cuts_no_case_label(fake_lab):
    """Labels differing only at their end read whole in a piped table."""
    tail = "x" * 90
    text = (fake_lab / "stages.yaml").read_text()
    text += f"""
  LONG:
    title: long case labels
    dir: stages/fake
    kernels: {{cpu: {{module: stages.fake.cpu, entry: Add}}}}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix: {{n: [16], variant: [{tail}_first, {tail}_second]}}
    kernel_params: [n]
    tolerances: {{out: {{cosine_min: 0.9999}}}}
"""
    (fake_lab / "stages.yaml").write_text(text)
    r = run_cli(["run", "stage-LONG"], cwd=fake_lab, env_extra={"COLUMNS": "100"})
    assert r.returncode == 0, r.stdout + r.stderr
    table = r.stdout[r.stdout.index("results"):]
    assert "…" not in table, table
    assert f"variant={tail}_first" in table and f"variant={tail}_second" in table, table


def test_each_case_is_judged_by_its_own_bounds(fake_lab):
    """`by:` reaches the verdict: n=32's rel_l2_max 0 fails, n=16 passes."""
    spec = fake_lab / "stages.yaml"
    old = "tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6}}\n    timeout_s: 20\n"
    assert spec.read_text().count(old) == 1
    spec.write_text(spec.read_text().replace(old, "tolerances: {out: {cosine_min: 0.9999, rel_l2_max: 1.0e-6, "
                                                  "by: {n: {32: {rel_l2_max: 0.0}}}}}\n    timeout_s: 20\n"))
    r = run_cli(["run", "stage-OK"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    by_n = {rec.case["n"]: rec for rec in read_records(fake_lab)}
    assert by_n[16].status == "pass" and 0 < by_n[16].metrics["out"]["rel_l2"] <= 1.0e-6, by_n[16]
    assert by_n[32].status == "fail" and "rel_l2" in by_n[32].error and "> 0" in by_n[32].error, by_n[32].error
