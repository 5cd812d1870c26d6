"""No GPU: compile stage A for both archs and say that nothing ran and why."""

import pytest

from harness.notebook.records import read_records
from tests.conftest import NO_SUCH_STAGE, ROOT, has_gpu, lab_env, run_cli


@pytest.mark.skipif(has_gpu(), reason="this is the no-GPU path")
def test_main_job_without_gpu_compiles_and_says_nothing_ran(tmp_path):
    import shutil

    lab = tmp_path / "lab"
    shutil.copytree(ROOT, lab, ignore=shutil.ignore_patterns(".git", ".cache", ".device", "scratch", "results",
                                                             "__pycache__", ".run"))
    r = run_cli(["run", "stage-A", "--hd", "64", "--n", "128"], cwd=lab,
                env_extra={"DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiled, not run: no GPU on this machine" in r.stdout
    assert "Nothing was run or verified for sm_100a" in r.stdout and "No case ran on a GPU" in r.stdout
    recs = read_records(lab, ["A"])
    assert sorted(x.arch for x in recs) == ["sm_100a", "sm_90a"] and {x.status for x in recs} == {"compiled"}
    assert all(x.compile["key"] for x in recs)


def test_list_shows_archs_and_whether_they_run_here(lab_copy, tmp_path):
    r = run_cli(["list"], cwd=lab_copy, env_extra=lab_env(lab_copy, tmp_path / "cache"))
    assert r.returncode == 0 and "stage-A" in r.stdout and "sm_100a" in r.stdout
    assert ("compile only" in r.stdout) != has_gpu() or "runs here" in r.stdout


def test_unknown_stage_and_bad_arch_are_one_line_exit_2(lab_copy, tmp_path):
    """On a copy of the lab, with a name no stage id can be."""
    for args, says in (([ "run", NO_SUCH_STAGE], f"no stage '{NO_SUCH_STAGE}'"),
                       (["compile", "A", "--arch", "sm_80"], "unknown")):
        r = run_cli(args, cwd=lab_copy, env_extra=lab_env(lab_copy, tmp_path / "cache"))
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_a_failure_in_user_code_is_one_line_with_the_traceback_kept(fake_lab):
    """A raising kernel: one line naming file:line, the traceback kept."""
    r = run_cli(["run", "stage-BAD", "--mode", "raise"], cwd=fake_lab)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    (rec,) = read_records(fake_lab, ["BAD"])
    assert rec.status == "crash" and "\n" not in rec.error
    assert "stages/fake/cpu.py:" in rec.error and "kernel raised on purpose" in rec.error
    assert rec.trace and "Traceback" in rec.trace and "kernel raised on purpose" in rec.trace
    shown = run_cli(["show", rec.id], cwd=fake_lab)
    assert shown.returncode == 0 and "kernel raised on purpose" in shown.stdout and "Traceback" in shown.stdout
    live = run_cli(["--traceback", "run", "stage-BAD", "--mode", "raise"], cwd=fake_lab)
    assert live.returncode == 1 and "Traceback" in live.stdout, live.stdout + live.stderr


def test_list_prints_titles_literally(fake_lab):
    text = (fake_lab / "stages.yaml").read_text().replace("out = a + b, correct", "'[m, n] [bold]x[/bold]'")
    (fake_lab / "stages.yaml").write_text(text)
    r = run_cli(["list"], cwd=fake_lab)
    assert r.returncode == 0, r.stderr
    assert "[m, n] [bold]x[/bold]" in r.stdout, r.stdout


def test_run_prints_the_real_records_path_and_help_shows_axis_flags(fake_lab):
    r = run_cli(["run", "stage-OK"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "records: results/records/OK.jsonl" in r.stdout and "<stage>" not in r.stdout
    for cmd in (["run"], ["compile"], ["history"], ["baseline", "show"]):
        h = run_cli([*cmd, "--help"], cwd=fake_lab)
        assert h.returncode == 0 and "stage-BAD: --n {16}  --mode {abort,raise,wrong,unwritten,ok,hang}" in h.stdout, h.stdout
