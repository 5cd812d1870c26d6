"""`dsv4-lab inspect`: the planted mismatch fails "P in registers", matching MMAs pass."""

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness.execution import kernelinspect as insp
from harness.execution.compile import tensor_specs
from harness.spec.matrix import expand
from harness.spec.spec import KernelRef, load_spec
from stages.common import inspection
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def spec():
    return load_spec(root=ROOT)


def _case(stage, **flt):
    return expand(stage, {k: {v} for k, v in flt.items()})[0].dict


def _check(rep, prefix: str) -> insp.Check:
    found = [c for c in rep.checks if c.name.startswith(prefix)]
    assert found, f"no check starting {prefix!r} in {[c.name for c in rep.checks]}"
    return found[0]


# No tracing


def test_expose_is_a_no_op_without_an_inspection():
    kernel = SimpleNamespace()
    assert inspection._recorder is None
    inspection.expose(kernel, qk_mma=object(), p_path="registers")
    assert vars(kernel) == {}


def test_layout_offsets_colex_and_nested():
    assert insp.layout_offsets((2, 3), (1, 2)) == [0, 1, 2, 3, 4, 5]
    assert insp.layout_offsets((2, 3), (3, 1)) == [0, 3, 1, 4, 2, 5]
    assert insp.layout_offsets(((2, 2), 2), ((1, 4), 2)) == [0, 1, 4, 5, 2, 3, 6, 7]


def test_swizzle_128b_permutes_rows_of_a_1024_element_block():
    sw = insp.swizzle_fn("S<3,4,3>")
    assert sw(0) == 0 and sw(8) == 8 and sw(64) == 64  # bits 7..9 clear: unchanged
    assert sw(128) == 128 ^ 16 and sw(7 << 7) == (7 << 7) ^ (7 << 4)  # bits 7..9 xor into 4..6
    assert sorted(sw(o) for o in range(1024)) == list(range(1024))  # a permutation
    assert insp.swizzle_fn("")(123) == 123


def _plan(s_col, s_cols, o_col, o_cols, alloc, p=None):
    lay = lambda cols: SimpleNamespace(shape=((128, cols), 1, 1), stride=((65536, 1), 0, 0))  # noqa: E731
    plan = SimpleNamespace(s_col=s_col, s_cols=s_cols, o_col=o_col, o_cols=o_cols, alloc_cols=alloc,
                           s_layout=lay(s_cols), o_layout=lay(o_cols), p_cols=0, p_layout=None,
                           p_dtype=SimpleNamespace(width=16))
    if p:
        p_col, p_cols = p
        plan.p_col, plan.p_cols = p_col, p_cols
        plan.p_layout = SimpleNamespace(shape=((128, 16), 1, (p_cols // 8,)), stride=((131072, 1), 0, (16,)))
    return plan


def test_tmem_plan_checks_pass_for_stage_c_layout():
    rec = insp.Recorder()
    rec._tmem(_plan(0, 128, 128, 64, 256, p=(64, 64)))
    assert rec.report.checks and all(c.ok for c in rec.report.checks), rec.report.checks
    text = insp.render(rec.report)
    assert "P  columns [64, 128)" in text and "O  columns [128, 192)" in text


def test_tmem_overlap_and_budget_fail():
    rec = insp.Recorder()
    rec._tmem(_plan(0, 256, 128, 512, 1024))  # O starts inside S; 640 columns used
    failed = {c.name for c in rec.report.checks if not c.ok}
    assert "TMEM: S and O columns disjoint" in failed
    assert any(n.startswith("TMEM: allocation 1024") for n in failed)


def test_tmem_tag_bit_is_decoded():
    rec = insp.Recorder()
    plan = _plan(0, 128, 128, 64, 256)
    plan.o_layout = SimpleNamespace(shape=((128, 64), 1, 1), stride=((65536, 1), 0, 0))
    plan.o_col = 128 | 0x8000  # an A-fragment style tagged column offset
    rec._tmem(plan)
    text = insp.render(rec.report)
    assert "O  columns [128, 192)" in text and "0x8000 tag on 1 offsets" in text
    assert all(c.ok for c in rec.report.checks)
    assert insp.decode_tmem_address((5 << 16) | 0x8000 | 64) == (5, 64, True)


def _smem(inner: str):
    outer = SimpleNamespace(shape=((8, 8), (64, 1)), stride=((64, 512), (1, 0)))
    return SimpleNamespace(outer=outer, inner=inner, __str__=lambda: inner)


def test_p_smem_layout_check_passes_for_one_layout_and_fails_for_another_swizzle():
    rec = insp.Recorder()
    rec.p_write, rec.p_read = _smem("S<3,4,3>"), _smem("S<3,4,3>")
    rec._p_layouts()
    assert all(c.ok for c in rec.report.checks)
    rec = insp.Recorder()
    rec.p_write, rec.p_read = _smem("S<3,4,3>"), _smem("S<2,4,3>")  # written 128B-, read 64B-swizzled
    rec._p_layouts()
    same = _check(rec.report, "P via SMEM: the layout P is written with")
    assert not same.ok and "first difference" in same.detail


def test_main_exit_code_and_failing_check_named(monkeypatch, capsys, spec):
    bad = insp.Inspection(title="t", checks=[insp.Check("P in registers: x", False, "d")])
    monkeypatch.setattr(insp, "inspect_case", lambda *a: bad)
    assert insp.main(ROOT, spec.stage("B"), "sm_90a", expand(spec.stage("B"))) == 1
    assert "failed: P in registers" in capsys.readouterr().out
    good = insp.Inspection(title="t", checks=[insp.Check("c", True, "d")])
    monkeypatch.setattr(insp, "inspect_case", lambda *a: good)
    assert insp.main(ROOT, spec.stage("B"), "sm_90a", expand(spec.stage("B"))) == 0
    monkeypatch.setattr(insp, "inspect_case", lambda *a: insp.Inspection(title="t"))  # nothing checked
    assert insp.main(ROOT, spec.stage("B"), "sm_90a", expand(spec.stage("B"))) == 1


@pytest.mark.parametrize("args, says", [
    (["inspect", "B"], "--arch"),
    (["inspect", "B", "--arch", "all"], "name one arch"),
    (["inspect", "B", "--arch", "sm_90a", "--hd", "128"], "hd=128 is not in the matrix"),
])
def test_cli_bad_usage_is_one_line_exit_2(args, says):
    out = subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1


# Traced (one case per stage per arch)


def _inspect(spec, stage_id, arch, **flt):
    st = spec.stage(stage_id)
    return insp.inspect_case(ROOT, st, arch, _case(st, **flt))


@pytest.mark.parametrize("stage_id", ["B", "C"])
def test_sm90_register_p_accumulator_equals_a_operand(spec, stage_id):
    rep = _inspect(spec, stage_id, "sm_90a", n=128)
    assert rep.error is None, rep.error
    assert _check(rep, "P in registers").ok
    assert rep.ok, insp.render(rep)
    text = insp.render(rep)
    assert "instruction M×N×K = (64, 128, 16)" in text and "from RMEM" in text
    assert "S<3,4,3>" in text


def test_sm90_d1_smem_p_write_and_read_agree(spec):
    rep = _inspect(spec, "D1", "sm_90a", hd=128, n=128)
    assert rep.error is None, rep.error
    for prefix in ("P store: register i", "P store: writes cover", "P via SMEM: the layout",
                   "P via SMEM: the PV A operand"):
        assert _check(rep, prefix).ok, prefix
    assert rep.ok, insp.render(rep)


@pytest.mark.parametrize("stage_id", ["B", "C"])
def test_sm100_tmem_p_columns_and_fragments(spec, stage_id):
    rep = _inspect(spec, stage_id, "sm_100a", n=128)
    assert rep.error is None, rep.error
    assert _check(rep, "TMEM-P: tcgen05.ld of S").ok
    assert _check(rep, "TMEM: S and O columns disjoint").ok
    assert _check(rep, "TMEM: P inside S").ok
    assert rep.ok, insp.render(rep)
    assert "allocation 256 columns of 512" in insp.render(rep)


def test_sm100_d1_smem_p_and_tmem_budget(spec):
    rep = _inspect(spec, "D1", "sm_100a", hd=128, n=128)
    assert rep.error is None, rep.error
    assert _check(rep, "P store: register i").ok
    assert _check(rep, "TMEM: S and O columns disjoint").ok
    assert rep.ok, insp.render(rep)


def _fixture_stage(spec):
    st = spec.stage("B")
    ref = KernelRef(arch="sm_90a", module="tests.fixtures.inspect_mismatch", entry="Kernel",
                    path=ROOT / "tests" / "fixtures" / "inspect_mismatch.py")
    return st, ref


@pytest.mark.parametrize("split, ok", [("n", False), ("m", True)])
def test_planted_pv_a_operand_mismatch_fails(spec, split, ok):
    st, ref = _fixture_stage(spec)
    specs = tensor_specs(st, _case(st, n=128))
    rep = insp.inspect_in_process(ROOT, "sm_90a", ref.module, ref.entry, {"split": split}, specs, "fixture")
    assert rep.error is None, rep.error
    check = _check(rep, "P in registers")
    assert check.ok is ok, check
    if not ok:
        assert "thread 0 register" in check.detail and not rep.ok


def test_main_runs_the_fixture_to_exit_1(spec, capsys):
    st, ref = _fixture_stage(spec)
    wrong = dataclasses.replace(st, kernels={**st.kernels, "sm_90a": ref}, kernel_params=())
    assert insp.main(ROOT, wrong, "sm_90a", expand(st, {"n": {128}})) == 1
    out = capsys.readouterr().out
    assert "FAIL  P in registers" in out
