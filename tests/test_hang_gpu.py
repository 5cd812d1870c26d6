"""On a GPU: hang_d2 with `--debug-hangs` is recorded `hang`."""

import dataclasses

import pytest

from harness.spec.matrix import expand
from harness.execution.runner import RunOptions, Runner, Task
from harness.spec.spec import KernelRef, load_spec

pytestmark = pytest.mark.gpu

CASE = {"shape": "b4s2h128n256d64", "splits": 1}  # 2 KV tiles a CTA: tile 1 is the skipped one


def _fixture(project_root):
    spec = load_spec(root=project_root)
    ref = KernelRef("sm_90a", "tests.fixtures.hang_d2.sm90", "Kernel",
                    project_root / "tests" / "fixtures" / "hang_d2" / "sm90.py")
    return spec, dataclasses.replace(spec.stages["D2"], kernels={"sm_90a": ref}, dir=ref.path.parent)


def test_planted_deadlock_is_a_hang_naming_pipeline_and_slot(project_root, tmp_path):
    spec, stage = _fixture(project_root)
    tasks = [Task(stage, "sm_90a", c) for c in expand(stage) if c.dict == CASE]
    assert len(tasks) == 1
    summary = Runner(spec, RunOptions(tasks=tasks, argv=["pytest"], debug_hangs=True, timeout_s=120),
                     results_root=tmp_path).run()
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
    tasks = [Task(stage, "sm_90a", c) for c in expand(stage) if c.dict == CASE]
    summary = Runner(spec, RunOptions(tasks=tasks, argv=["pytest"], debug_hangs=True), results_root=tmp_path).run()
    (rec,) = summary.records
    assert rec.status == "pass", (rec.status, rec.error)
    assert rec.compile["debug"] == "hangs"
