"""On a GPU: hang_d2 with `--debug-hangs` is recorded `hang`."""

import pytest

from harness.spec.matrix import expand
from harness.spec.spec import load_spec
from tests.conftest import planted, run_cases

pytestmark = pytest.mark.gpu

CASE = {"shape": "b4s2h128n256d64", "splits": 1}  # 2 KV tiles a CTA: tile 1 is the skipped one


def test_planted_deadlock_is_a_hang_naming_pipeline_and_slot(project_root, tmp_path):
    spec = load_spec(root=project_root)
    stage = planted(spec, "D2", "hang_d2")
    cases = [c for c in expand(stage) if c.dict == CASE]
    assert len(cases) == 1
    summary = run_cases(spec, stage, cases, tmp_path, debug_hangs=True, timeout_s=120)
    (rec,) = summary.records
    print(rec.status, rec.error)
    assert rec.status == "hang", (rec.status, rec.error)
    assert rec.error.startswith("hang in a --debug-hangs build: DSV4-HANG ")
    assert "pipeline=kv.full slot=1 phase=0" in rec.error and "role=mma" in rec.error
    assert rec.compile["debug"] == "hangs"
    assert summary.exit_code == 1


def test_the_same_case_built_normally_still_runs_the_real_kernel(project_root, tmp_path):
    """D2 itself with --debug-hangs: no hang, a pass."""
    spec = load_spec(root=project_root)
    stage = spec.stages["D2"]
    summary = run_cases(spec, stage, [c for c in expand(stage) if c.dict == CASE], tmp_path, debug_hangs=True)
    (rec,) = summary.records
    assert rec.status == "pass", (rec.status, rec.error)
    assert rec.compile["debug"] == "hangs"
