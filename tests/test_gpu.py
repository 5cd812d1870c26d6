"""On a GPU: stage A runs; stage B with P permuted is reported `fail`."""

import pytest

from harness.spec.matrix import expand
from harness.spec.spec import load_spec
from tests.conftest import planted, run_cases

pytestmark = pytest.mark.gpu


def _run(spec, stage, arch, tmp_path):
    return run_cases(spec, stage, expand(stage), tmp_path, arch)


def test_stage_a_sm90_passes_its_matrix(project_root, tmp_path):
    spec = load_spec(root=project_root)
    summary = _run(spec, spec.stages["A"], "sm_90a", tmp_path)
    assert [r.status for r in summary.records] == ["pass"] * 8
    assert min(r.metrics["S"]["cosine"] for r in summary.records) >= 0.99999


def test_lab_catches_permuted_p_in_stage_b(project_root, tmp_path):
    spec = load_spec(root=project_root)
    summary = _run(spec, planted(spec, "B", "wrong_b"), "sm_90a", tmp_path)
    assert len(summary.records) == 4
    for rec in summary.records:
        print("wrong-B", rec.case, rec.status, rec.metrics["O"])
        assert rec.status == "fail"
        assert rec.metrics["O"]["unwritten"] == 0 and rec.metrics["O"]["nonfinite"] == 0  # runs cleanly
        assert rec.metrics["O"]["cosine"] < 0.5                                             # and is garbage
