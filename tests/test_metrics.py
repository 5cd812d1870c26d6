"""Metrics vs hand-computed values; poison, unwritten, tolerances."""

import math

import pytest
import torch

from harness.execution.metrics import compare, poison_, unwritten_mask, violations
from harness.spec.spec import Tolerance


def test_hand_computed_values():
    ref = torch.tensor([3.0, 4.0])
    out = torch.tensor([3.0, 5.0])
    m = compare(out, ref)
    # cos = (9 + 20) / (5 * sqrt(34)); rel L2 = 1 / 5; max abs = 1
    assert m.cosine == pytest.approx(29 / (5 * math.sqrt(34)), rel=1e-12)
    assert m.rel_l2 == pytest.approx(0.2, rel=1e-12)
    assert m.max_abs == pytest.approx(1.0)
    assert m.nonfinite == 0 and m.unwritten == 0


def test_exact_and_opposite():
    ref = torch.tensor([1.0, -2.0, 0.5])
    assert compare(ref.clone(), ref).cosine == pytest.approx(1.0)
    assert compare(-ref, ref).cosine == pytest.approx(-1.0)
    assert compare(-ref, ref).rel_l2 == pytest.approx(2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_poison_is_a_nan_counted_as_unwritten(dtype):
    t = poison_(torch.empty(10, dtype=dtype))
    assert torch.isnan(t.float()).all()
    assert unwritten_mask(t).all()
    t[:4] = 1.0
    m = compare(t, torch.ones(10))
    assert m.unwritten == 6 and m.nonfinite == 0 and m.cosine is None


def test_computed_nan_is_not_unwritten():
    out = torch.tensor([1.0, float("nan"), 3.0])
    m = compare(out, torch.tensor([1.0, 2.0, 3.0]))
    assert m.nonfinite == 1 and m.unwritten == 0 and m.cosine is None


def test_oracle_infinity_must_match_exactly():
    ref = torch.tensor([1.0, float("inf")])
    assert compare(torch.tensor([1.0, float("inf")]), ref).nonfinite == 0
    assert compare(torch.tensor([1.0, 5.0]), ref).nonfinite == 1


def test_violations():
    tol = Tolerance(cosine_min=0.999, rel_l2_max=1e-2)
    assert violations({"cosine": 0.9999, "rel_l2": 1e-3, "nonfinite": 0, "unwritten": 0}, tol) == []
    why = violations({"cosine": 0.5, "rel_l2": 1.0, "nonfinite": 0, "unwritten": 3}, tol)
    assert any("unwritten" in w for w in why) and any("cosine" in w for w in why) and any("rel_l2" in w for w in why)
    assert violations({"cosine": None, "rel_l2": None, "nonfinite": 2, "unwritten": 0}, tol)
