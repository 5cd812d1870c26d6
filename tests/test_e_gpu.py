"""On a GPU: stage E — the lab catches the planted bugs issue 14 names (tests/fixtures): a scale
from the wrong tile (wrong_e_scale) and index entries past topk_length honoured (wrong_e_len).
Each runs cleanly (every element written) and is reported `fail`; tests/test_e_oracle.py proves
on the CPU that both bugs move O past the stage's bound, so a pass here would be the lab's
blind spot."""

from __future__ import annotations

import dataclasses

import pytest

from harness.matrix import expand
from harness.runner import RunOptions, Runner, Task
from harness.spec import KernelRef, load_spec

pytestmark = pytest.mark.gpu


def _planted(project_root, name: str):
    spec = load_spec(root=project_root)
    ref = KernelRef("sm_90a", f"tests.fixtures.{name}.sm90", "Kernel", project_root / "tests" / "fixtures" / name / "sm90.py")
    return spec, dataclasses.replace(spec.stages["E"], kernels={"sm_90a": ref}, dir=ref.path.parent)


def _run_all_fail(project_root, tmp_path, name, keep, count):
    spec, wrong = _planted(project_root, name)
    tasks = [Task(wrong, "sm_90a", c) for c in expand(wrong) if keep(c.dict)]
    summary = Runner(spec, RunOptions(tasks=tasks, argv=["pytest"]), results_root=tmp_path).run()
    assert len(summary.records) == count
    for rec in summary.records:
        print(name, rec.case, rec.status, rec.metrics.get("O"), rec.error)
        assert rec.status == "fail", rec.case
        assert all(m["unwritten"] == 0 for m in rec.metrics.values())


def test_lab_catches_a_scale_from_the_wrong_tile(project_root, tmp_path):
    _run_all_fail(project_root, tmp_path, "wrong_e_scale",
                  lambda c: c["kv_format"] == "model1" and c["config"] == "s1h64_m96bs64" and c["splits"] == 1
                  and c["scenario"] in ("plain", "sink", "dup"), 3)


def test_lab_catches_entries_past_topk_length_honoured(project_root, tmp_path):
    _run_all_fail(project_root, tmp_path, "wrong_e_len",
                  lambda c: c["scenario"] == "topk_len" and c["config"] in ("s1h64_m96bs64", "s2h64_m200bs2_x64bs256")
                  and c["kv_format"] in ("simple", "model1") and c["splits"] == 1, 4)
