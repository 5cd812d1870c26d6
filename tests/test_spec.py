"""stages.yaml validation: every bad spec is one line naming file, line, key; exit 2."""

import textwrap
from pathlib import Path

import pytest

from harness.spec.spec import SpecError, load_spec, normalize_stage_name
from tests.conftest import run_cli

GOOD = """\
version: 1
stages:
  OK:
    title: add
    dir: stages/fake
    kernels: {cpu: {module: stages.fake.cpu, entry: Add}}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix: {n: [16, 32]}
    tolerances: {out: {cosine_min: 0.9999}}
"""


def write(lab: Path, text: str) -> Path:
    p = lab / "stages.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def error_of(lab: Path, text: str) -> str:
    write(lab, text)
    with pytest.raises(SpecError) as exc:
        load_spec(root=lab)
    return str(exc.value)


def test_project_spec_loads(project_root):
    spec = load_spec(root=project_root)
    assert "A" in spec.stages
    a = spec.stages["A"]
    assert set(a.kernels) == {"sm_90a", "sm_100a"}
    assert a.matrix == {"hd": [64, 128, 256, 512], "n": [128, 256], "m": [128]}
    assert a.tolerances["S"].cosine_min == 0.99999


def test_good_fake_spec_loads(fake_lab):
    write(fake_lab, GOOD)
    spec = load_spec(root=fake_lab)
    assert spec.stage("stage-ok").matrix == {"n": [16, 32]}


@pytest.mark.parametrize("bad, line, key, says", [
    (GOOD.replace("    title: add\n", "    title: add\n    colour: red\n"), 5, "stages.OK.colour", "unknown key"),
    (GOOD.replace("title: add", "title: [1, 2]"), 4, "stages.OK.title", "expected a string"),
    (GOOD.replace("stages.fake.cpu", "stages.fake.gone"), 6, "stages.OK.kernels.cpu.module", "not found"),
    (GOOD.replace("entry: Add", "entry: Subtract"), 6, "stages.OK.kernels.cpu.entry", "'Subtract' is not defined"),
    (GOOD.replace("oracles.add:reference", "oracles.add:nothing"), 9, "stages.OK.oracle", "'nothing' is not defined"),
    (GOOD.replace("{n: [16, 32]}", "{n: []}"), 10, "stages.OK.matrix.n", "empty list"),
    (GOOD.replace("matrix: {n: [16, 32]}", "matrix: {}"), 10, "stages.OK.matrix", "empty matrix"),
    (GOOD.replace("{n: [16, 32]}", "{n: 16}"), 10, "stages.OK.matrix.n", "expected a list"),
    (GOOD.replace("cosine_min: 0.9999", "cosine_min: high"), 11, "stages.OK.tolerances.out.cosine_min", "expected a number"),
    (GOOD.replace("{cpu:", "{sm80:"), 6, "stages.OK.kernels.sm80", "unknown arch"),
    (GOOD.replace("    dir: stages/fake\n", ""), 3, "stages.OK.dir", "missing required key"),
    (GOOD.replace("version: 1", "version: 7"), 1, "version", "unsupported version"),
    (GOOD + "  bad: [\n", 12, "", "not valid YAML"),
    (GOOD + "version: 1\n", 12, ": version: duplicate key", "keep one"),            # top level: the key alone
    (GOOD.replace("    title: add\n", "    title: add\n    title: sub\n"), 5, "stages.OK.title", "duplicate key"),
])
def test_bad_spec_is_one_line_with_file_line_and_key(fake_lab, bad, line, key, says):
    msg = error_of(fake_lab, bad)
    assert "\n" not in msg
    assert msg.startswith(f"stages.yaml:{line}: ") or (not key and msg.startswith("stages.yaml:")), msg
    assert key in msg and says in msg, msg


def test_cli_reports_bad_spec_without_traceback(fake_lab):
    write(fake_lab, GOOD.replace("{n: [16, 32]}", "{n: []}"))
    for args in (["list"], ["run", "stage-OK"], ["gate"], ["dashboard"]):
        r = run_cli(args, cwd=fake_lab)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert lines == [lines[0]] and "stages.yaml:10: stages.OK.matrix.n: empty list" in lines[0], r.stderr
        assert "Traceback" not in r.stderr + r.stdout


def test_stage_names():
    assert normalize_stage_name("stage-D1") == "D1"
    assert normalize_stage_name("d1") == "D1"
    assert normalize_stage_name("A") == "A"


def test_more_adds_a_few_cases_beside_the_matrix_product(fake_lab):
    """`more:` lists further products: new cases after the product, filterable."""
    from harness.spec.matrix import count, expand, parse_filters

    write(fake_lab, GOOD.replace("matrix: {n: [16, 32]}", "matrix: {n: [16, 32], w: [a]}\n"
                                 "    more: [{w: [b]}, {n: [64, 16], w: [c]}, {w: [a]}]"))
    st = load_spec(root=fake_lab).stage("stage-ok")
    assert st.matrix == {"n": [16, 32, 64], "w": ["a", "b", "c"]} and st.suite is None
    assert [c.dict for c in expand(st)] == [{"n": 16, "w": "a"}, {"n": 32, "w": "a"}, {"n": 16, "w": "b"},
                                            {"n": 64, "w": "c"}, {"n": 16, "w": "c"}]
    assert count(st) == 5
    assert [c.dict for c in expand(st, parse_filters(st, [("w", "c")]))] == [{"n": 64, "w": "c"}, {"n": 16, "w": "c"}]


@pytest.mark.parametrize("more, says", [
    ("[{x: [1]}]", "stages.OK.more[0].x: not a matrix axis"),
    ("[{n: [word]}]", "stages.OK.more[0].n: 'word' is not of the axis's type"),
    ("{n: [8]}", "stages.OK.more: expected a list of matrices"),
    ("[{}]", "stages.OK.more[0]: empty matrix"),
])
def test_bad_more_is_one_line(fake_lab, more, says):
    msg = error_of(fake_lab, GOOD.replace("matrix: {n: [16, 32]}", f"matrix: {{n: [16, 32]}}\n    more: {more}"))
    assert "\n" not in msg and msg.startswith("stages.yaml:11: ") and says in msg, msg


def test_tolerances_by_an_axis_value(fake_lab):
    """`by:` bounds override the output's; another type (32 vs '32', 1 vs true) does not match."""
    from harness.spec.spec import Tolerance

    write(fake_lab, GOOD.replace("matrix: {n: [16, 32]}", "matrix: {n: [16, 32], w: [a, b]}").replace(
        "{out: {cosine_min: 0.9999}}",
        "{out: {cosine_min: 0.9999, rel_l2_max: 1.0e-3, by: {w: {b: {rel_l2_max: 2.0e-3}}, n: {32: {cosine_min: 0.99}}}}}"))
    st = load_spec(root=fake_lab).stage("stage-ok")
    assert st.tolerances_for({"n": 16, "w": "a"}) == {"out": Tolerance(cosine_min=0.9999, rel_l2_max=1.0e-3)}
    assert st.tolerances_for({"n": 16, "w": "b"}) == {"out": Tolerance(cosine_min=0.9999, rel_l2_max=2.0e-3)}
    assert st.tolerances_for({"n": 32, "w": "b"}) == {"out": Tolerance(cosine_min=0.99, rel_l2_max=2.0e-3)}
    assert st.tolerances_for({"n": "32", "w": "a"}) == {"out": Tolerance(cosine_min=0.9999, rel_l2_max=1.0e-3)}


BY = GOOD.replace("matrix: {n: [16, 32]}", "matrix: {n: [16, 32], w: [a, b]}").replace(
    "{out: {cosine_min: 0.9999}}", "{out: {cosine_min: 0.9999, rel_l2_max: 1.0e-3, by: BY}}")


@pytest.mark.parametrize("by, key, says", [
    ("{x: {a: {rel_l2_max: 2.0e-3}}}", "stages.OK.tolerances.out.by.x", "not a matrix axis (n, w) — name one of those"),
    ("{w: {c: {rel_l2_max: 2.0e-3}}}", "stages.OK.tolerances.out.by.w.c", "not a value of w (a, b) — name one of those"),
    ("{n: {'16': {rel_l2_max: 2.0e-3}}}", "stages.OK.tolerances.out.by.n.16", "not a value of n (16, 32)"),
    ("{w: {b: {rel_l2: 2.0e-3}}}", "stages.OK.tolerances.out.by.w.b.rel_l2", "unknown key — allowed: cosine_min"),
    ("{w: {b: {rel_l2_max: .nan}}}", "stages.OK.tolerances.out.by.w.b.rel_l2_max", "not a finite number"),
    ("{w: {b: {}}}", "stages.OK.tolerances.out.by.w.b", "no bounds — give one of"),
    ("{w: {b: {cosine_min: 0.5, rel_l2_max: 0.9}}}", "stages.OK.tolerances.out.by.w.b", "bounds that hold nothing"),
    ("{w: {}}", "stages.OK.tolerances.out.by.w", "empty — name a value of w"),
    ("{}", "stages.OK.tolerances.out.by", "empty — name an axis"),
    ("[w]", "stages.OK.tolerances.out.by", "expected a mapping"),
    ("{w: {b: {rel_l2_max: 1.0e-3, by: {}}}}", "stages.OK.tolerances.out.by.w.b.by", "unknown key"),
])
def test_bad_tolerances_by_is_one_line(fake_lab, by, key, says):
    msg = error_of(fake_lab, BY.replace("by: BY", f"by: {by}"))
    assert "\n" not in msg and msg.startswith("stages.yaml:11: ") and f" {key}: " in msg and says in msg, msg


def test_judge_refuses_tolerances_not_resolved_for_the_case(fake_lab):
    """judge refuses bounds still holding `by:`."""
    from harness.execution.metrics import judge

    write(fake_lab, BY.replace("by: BY", "by: {w: {b: {rel_l2_max: 2.0e-3}}}"))
    st = load_spec(root=fake_lab).stage("stage-ok")
    m = {"out": {"cosine": 0.99999, "rel_l2": 1.5e-3, "max_abs": 0.1, "nonfinite": 0, "unwritten": 0}}
    with pytest.raises(ValueError, match="tolerances_for"):
        judge(st.tolerances, m)
    assert judge(st.tolerances_for({"n": 16, "w": "a"}), m)[0] == "fail"
    assert judge(st.tolerances_for({"n": 16, "w": "b"}), m) == ("pass", None)
