"""Matrix expansion and filters."""

from __future__ import annotations

import pytest

from harness.matrix import FilterError, expand, parse_axis_flags, parse_filters, parse_where, select
from harness.spec import load_spec


@pytest.fixture
def stage_a(project_root):
    return load_spec(root=project_root).stages["A"]


def test_expansion_is_the_full_product_in_axis_order(stage_a):
    cases = expand(stage_a)
    assert len(cases) == 8
    assert cases[0].dict == {"hd": 64, "n": 128, "m": 128}
    assert cases[1].dict == {"hd": 64, "n": 256, "m": 128}
    assert cases[-1].label == "hd=512,n=256,m=128"
    assert len({c.label for c in cases}) == 8


def test_axis_flags_and_where(stage_a):
    pairs = parse_axis_flags(["--hd", "512", "--n=128,256"])
    assert pairs == [("hd", "512"), ("n", "128,256")]
    sel = select(expand(stage_a), parse_filters(stage_a, pairs))
    assert [c.dict["n"] for c in sel] == [128, 256] and all(c.dict["hd"] == 512 for c in sel)
    sel = select(expand(stage_a), parse_filters(stage_a, parse_where("hd=64|128,n=256")))
    assert [c.label for c in sel] == ["hd=64,n=256,m=128", "hd=128,n=256,m=128"]


@pytest.mark.parametrize("pairs, says", [
    ([("hdim", "64")], "no axis 'hdim'"),
    ([("hd", "96")], "hd=96 is not in the matrix — hd takes 64, 128, 256, 512"),
])
def test_bad_filters_say_what_is_allowed(stage_a, pairs, says):
    with pytest.raises(FilterError) as exc:
        parse_filters(stage_a, pairs)
    assert says in str(exc.value)


def test_bad_flag_syntax():
    with pytest.raises(FilterError):
        parse_axis_flags(["--hd"])
    with pytest.raises(FilterError):
        parse_axis_flags(["512"])
    with pytest.raises(FilterError):
        parse_where("hd512")


def test_bool_axis_values_parse(project_root):
    stage_b = load_spec(root=project_root).stages["B"]
    sel = select(expand(stage_b), parse_filters(stage_b, [("v_is_k", "true")]))
    assert sel and all(c.dict["v_is_k"] is True for c in sel)
