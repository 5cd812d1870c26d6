"""On a GPU: `bench --compare HEAD` (an A/A): "no detectable change"."""

import shutil
import subprocess

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.gpu


def test_bench_compare_head_on_an_unchanged_tree(project_root, tmp_path):
    from harness.notebook.records import read_records

    lab = tmp_path / "lab"
    shutil.copytree(project_root, lab, ignore=shutil.ignore_patterns(".git", ".cache", ".device", ".peers", "results",
                                                                     "__pycache__"))
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a/a"]):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=lab, check=True)
    r = run_cli(["bench", "stage-D1", "--hd", "128", "--compare", "HEAD", "--rounds", "20"], cwd=lab, timeout=900,
                env_extra={"DSV4_LAB_ROOT": str(lab), "DSV4_LAB_GIT": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    (rec,) = [x for x in read_records(lab, ["D1"], bench=True) if x.case.get("hd") == 128]
    c = rec.compare or {}
    assert rec.status == "pass" and rec.timing["us"] > 0 and "gpu_name" in rec.timing
    assert c["rev"] == "HEAD" and len(c["a_rounds"]) == len(c["b_rounds"]) == 20 and c["lo"] <= c["ratio"] <= c["hi"]
    assert c["verdict"] == "no detectable change", c
    assert "tree/HEAD" in r.stdout
