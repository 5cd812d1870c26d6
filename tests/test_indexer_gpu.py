"""On a GPU: wrong_i1 / wrong_i2 run cleanly with right −inf positions and are `fail`."""

import pytest

from harness.spec.matrix import expand
from harness.spec.spec import load_spec
from tests.conftest import planted, run_cases

pytestmark = pytest.mark.gpu


def _run(spec, stage, arch, tmp_path, where=None):
    cases = [c for c in expand(stage) if where is None or all(c.dict[k] == v for k, v in where.items())]
    return run_cases(spec, stage, cases, tmp_path, arch)


def test_lab_catches_dropped_relu_in_stage_i1(project_root, tmp_path):
    spec = load_spec(root=project_root)
    summary = _run(spec, planted(spec, "I1", "wrong_i1"), "sm_90a", tmp_path, where={"s": 128})
    # the 4 product cases and the more: ones
    assert len(summary.records) == 12
    assert {(r.case["heads"], r.case["head_dim"], r.case["logits_dtype"], r.case["compressed"])
            for r in summary.records} == {(64, 128, "fp32", False), (32, 128, "fp32", False), (64, 32, "fp32", False),
                                          (64, 64, "fp32", False), (64, 128, "bf16", False), (64, 128, "fp32", True)}
    for rec in summary.records:
        m = rec.metrics["logits"]
        print("wrong-I1", rec.case, rec.status, m)
        assert rec.status == "fail"
        assert m["unwritten"] == 0 and m["nonfinite"] == 0  # runs cleanly, −inf where it belongs
        assert m["cosine"] < 0.99  # and the logits are wrong


def test_lab_catches_stale_weights_in_the_persistent_i2(project_root, tmp_path):
    """wrong_i2 at b 8, ctx 3000: shares spanning sequences fail, every case."""
    spec = load_spec(root=project_root)
    summary = _run(spec, planted(spec, "I2", "wrong_i2"), "sm_90a", tmp_path,
                   where={"b": 8, "ctx": 3000, "heads": 64, "head_dim": 128})
    assert {(r.case["next_n"], r.case["logits_dtype"], r.case["context_2d"]) for r in summary.records} >= {
        (1, "fp32", False), (2, "fp32", False), (2, "fp32", True)}
    for rec in summary.records:
        m = rec.metrics["logits"]
        print("wrong-I2", rec.case, rec.status, m)
        assert rec.status == "fail"
        assert m["unwritten"] == 0 and m["nonfinite"] == 0
