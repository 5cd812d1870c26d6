"""The README's main job on a machine with no GPU: it compiles stage A for both archs and
says plainly that nothing ran and why; it does not fail or pretend."""

from __future__ import annotations

import pytest

from harness.records import read_records
from tests.conftest import ROOT, run_cli


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_has_gpu(), reason="this is the no-GPU path")
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


def test_list_shows_archs_and_whether_they_run_here():
    r = run_cli(["list"], cwd=ROOT)
    assert r.returncode == 0 and "stage-A" in r.stdout and "sm_100a" in r.stdout
    assert ("compile only" in r.stdout) != _has_gpu() or "runs here" in r.stdout


def test_unknown_stage_and_bad_arch_are_one_line_exit_2():
    for args, says in ((["run", "stage-Z"], "no stage 'stage-Z'"), (["compile", "A", "--arch", "sm_80"], "unknown")):
        r = run_cli(args, cwd=ROOT)
        assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
