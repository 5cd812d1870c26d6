"""Matrix expansion and filters."""

import time
import tracemalloc
from dataclasses import replace

import pytest

from harness.spec.matrix import (
    FilterError, MatrixSizeError, count, expand, parse_axis_flags, parse_filters, parse_where, select,
)
from harness.spec.spec import MAX_CASES, load_spec


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


# Size limit before building.

def _big(stage_a):
    """10**6 cases via a Stage built directly."""
    return replace(stage_a, matrix={f"a{i}": list(range(10)) for i in range(6)})


def test_a_matrix_past_the_limit_is_refused_before_it_is_built(stage_a):
    big = _big(stage_a)
    assert count(big) == 10**6 > MAX_CASES
    tracemalloc.start()
    t0 = time.monotonic()
    with pytest.raises(MatrixSizeError) as exc:
        expand(big)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.monotonic() - t0 < 0.5 and peak < 1 << 20, peak
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("stage-A: 1000000 cases (a0 10 × a1 10 × ") and str(MAX_CASES) in msg
    assert "--where a0=0" in msg and "fewer values" in msg


def test_filters_narrow_a_big_matrix_without_building_it(stage_a):
    big = _big(stage_a)
    filters = parse_filters(big, [("a0", "1"), ("a1", "2,3")])
    assert count(big, filters) == 2 * 10**4
    cases = expand(big, filters)
    assert len(cases) == 2 * 10**4 and {c.dict["a1"] for c in cases} == {2, 3}
    assert cases[0].label == "a0=1,a1=2,a2=0,a3=0,a4=0,a5=0"
    # as filtering the full product
    small = replace(stage_a, matrix={"a": [1, 2, 3], "b": ["x", "y"]})
    f = parse_filters(small, [("b", "y")])
    assert expand(small, f) == select(expand(small), f)


def test_filter_values_match_exactly_before_loosely(stage_a):
    st = replace(stage_a, matrix={"s": ["wide", "WIDE"], "t": [1.0e-5, 2], "b": [True, False]})
    assert parse_filters(st, [("s", "WIDE")]) == {"s": {"WIDE"}}
    assert parse_filters(st, [("s", "wide")]) == {"s": {"wide"}}
    assert parse_filters(st, [("t", "1e-5"), ("t", "2.0")]) == {"t": {1.0e-5, 2}}
    assert parse_filters(st, [("b", "True")]) == {"b": {True}}
    with pytest.raises(FilterError, match="s=Wide is not in the matrix"):
        parse_filters(st, [("s", "Wide")])
