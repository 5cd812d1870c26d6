"""On a GPU: D3–D5's planted bugs run cleanly and are reported `fail`."""

import pytest

from harness.spec.matrix import expand
from harness.spec.spec import load_spec
from tests.conftest import planted, run_cases

pytestmark = pytest.mark.gpu


def _run(spec, stage, tmp_path, keep):
    return run_cases(spec, stage, [c for c in expand(stage) if keep(c.dict)], tmp_path)


def _planted(project_root, stage_id: str):
    spec = load_spec(root=project_root)
    return spec, planted(spec, stage_id, f"wrong_{stage_id.lower()}")


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
