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
