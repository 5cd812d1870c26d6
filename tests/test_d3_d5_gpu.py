"""On a GPU: D3–D5's planted bugs run cleanly and are reported `fail`."""

import dataclasses

import pytest

from harness.spec.matrix import expand
from harness.execution.runner import RunOptions, Runner, Task
from harness.spec.spec import KernelRef, load_spec

pytestmark = pytest.mark.gpu


def _run(spec, stage, tmp_path, keep):
    tasks = [Task(stage, "sm_90a", c) for c in expand(stage) if keep(c.dict)]
    return Runner(spec, RunOptions(tasks=tasks, argv=["pytest"]), results_root=tmp_path).run()


def _planted(project_root, stage_id: str):
    spec = load_spec(root=project_root)
    name = f"wrong_{stage_id.lower()}"
    ref = KernelRef("sm_90a", f"tests.fixtures.{name}.sm90", "Kernel", project_root / "tests" / "fixtures" / name / "sm90.py")
    return spec, dataclasses.replace(spec.stages[stage_id], kernels={"sm_90a": ref}, dir=ref.path.parent)


def _all_fail(summary, count: int, label: str) -> None:
    assert len(summary.records) == count
    for rec in summary.records:
        print(label, rec.case, rec.status, rec.metrics.get("O"), rec.metrics.get("LSE"), rec.error)
        assert rec.status == "fail", rec.case
        assert all(m["unwritten"] == 0 for m in rec.metrics.values())  # it ran and wrote everything


def test_lab_catches_off_by_one_fill_mask_in_stage_d3(project_root, tmp_path):
    spec, wrong = _planted(project_root, "D3")
    summary = _run(spec, wrong, tmp_path, lambda c: c["shape"] == "b4s1h64n256d512" and c["splits"] == 1)
    _all_fail(summary, 7, "wrong-D3")


def test_lab_catches_causal_limit_ignoring_the_token_in_stage_d4(project_root, tmp_path):
    spec, wrong = _planted(project_root, "D4")
    summary = _run(spec, wrong, tmp_path, lambda c: c["shape"] != "b4s1h64n256d512" and c["splits"] == 1)
    _all_fail(summary, 12, "wrong-D4")


def test_lab_catches_sink_applied_to_lse_in_stage_d5(project_root, tmp_path):
    spec, wrong = _planted(project_root, "D5")
    keep = {"-5", "0", "5", "inf"}
    summary = _run(spec, wrong, tmp_path, lambda c: c["splits"] == 1 and str(c["sink"]) in keep and c["branches"] != "0+0"
                   and c["shape"] == "b4s2h128m128n256d512")
    _all_fail(summary, 12, "wrong-D5")
