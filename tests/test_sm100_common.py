"""stages/common's sm100 pieces: identity_coords and agreement checks (sm_100a)."""

from types import SimpleNamespace

import pytest

from tests.conftest import traced


# -- plain Python


class _Fake:
    """An identity-coordinate tensor stand-in."""

    def __init__(self, base, shape, stride, answers=None):
        self.iterator = base
        self.layout = SimpleNamespace(shape=shape, stride=stride)
        self._answers = answers

    def __getitem__(self, i):
        return self._answers[i]


def test_identity_coords_walks_modes_first_fastest_with_broadcasts():
    from cutlass.cute import ScaledBasis as E

    from stages.common.sm100_coords import identity_coords

    # ((2, 3), 2) : ((1@1, 0), 16@0) from (5, 7)
    t = _Fake((5, 7), ((2, 3), 2), ((E(1, 1), 0), E(16, 0)))
    want = [(5 + 16 * i2, 7 + i0) for i2 in range(2) for i1 in range(3) for i0 in range(2)]
    assert identity_coords(t) == want


@pytest.mark.parametrize("base, shape, stride", [
    ((0, 0), (4,), (3,)),  # not a coordinate tensor
    ((0, 0), (4,), ("E<0,1>",)),  # not a basis at all
    (((0, 1), 0), (4,), (0,)),  # a nested base coordinate
])
def test_identity_coords_refuses_what_it_cannot_evaluate(base, shape, stride):
    from stages.common.sm100_coords import NotStatic, identity_coords

    with pytest.raises(NotStatic):
        identity_coords(_Fake(base, shape, stride))


def test_fragment_coords_spot_check_and_fallback():
    """A Python evaluation disagreeing with CuTe stops the compile."""
    from cutlass.cute import ScaledBasis as E

    import stages.common.sm100_idioms as idioms

    size = lambda t: len(t._answers)  # noqa: E731
    orig = idioms.cute.size
    idioms.cute.size = size
    try:
        good = [(0, k) for k in range(8)]
        assert idioms.fragment_coords(_Fake((0, 0), (8,), (E(1, 1),), good)) == good
        bad = list(good)
        bad[4] = (0, 5)  # CuTe says register 4 (the middle) holds key 5
        with pytest.raises(ValueError, match="register 4"):
            idioms.fragment_coords(_Fake((0, 0), (8,), (E(1, 1),), bad))
        fallback = [(9, 9)] * 8
        assert idioms.fragment_coords(_Fake((0, 0), (8,), (3,), fallback)) == fallback
    finally:
        idioms.cute.size = orig


# -- traced partitions of B, C, D1

_SETUP = """
    import cutlass, cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
    from stages.common.sm100_coords import identity_coords
    from stages.common.sm100_idioms import (TmemPlan, tmem_copy, check_same_fragment_coords, check_smem_p,
                                            mk_view)
    BF16, F32 = cutlass.BFloat16, cutlass.Float32
    ONE = tcgen05.CtaGroup.ONE

    def mmas(qk_tiler, pv_tiler, source):
        qk = sm100_utils.make_trivial_tiled_mma(BF16, BF16, OperandMajorMode.K, OperandMajorMode.K, F32, ONE,
                                                qk_tiler[:2])
        pv = sm100_utils.make_trivial_tiled_mma(BF16, BF16, OperandMajorMode.K, OperandMajorMode.MN, F32, ONE,
                                                pv_tiler[:2], source)
        return qk, pv

    def tmem_p():
        # stage B / C (hd = 64): S 128 x 128 fp32, P inside S, O 128 x 64
        qk_tiler, pv_tiler = (128, 128, 64), (128, 64, 128)
        qk, pv = mmas(qk_tiler, pv_tiler, tcgen05.OperandSource.TMEM)
        p_layout = sm100_utils.make_smem_layout_a(pv, pv_tiler, BF16, 1)
        plan = TmemPlan(qk, pv, qk_tiler, pv_tiler, p_layout, F32, BF16)
        tStS, tOrP, tOtO = plan.views(cute.make_ptr(F32, 0, cute.AddressSpace.tmem))
        s_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tStS)
        p_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x16, BF16, tOrP)
        o_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        o_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        cS = qk.get_slice(0).partition_C(cute.make_identity_tensor((128, 128)))
        cP = pv.get_slice(0).partition_A(cute.make_identity_tensor((128, 128)))
        cO = pv.get_slice(0).partition_C(cute.make_identity_tensor((128, 64)))
        return qk, pv, s_load, p_store, o_load, o_store, cS, cP, cO

    def smem_p(kv=128, hd=128):
        # stage D1 (hd = 128): S 128 x kv fp32 in TMEM, P through shared memory
        qk_tiler, pv_tiler = (128, kv, hd), (128, hd, kv)
        qk, pv = mmas(qk_tiler, pv_tiler, tcgen05.OperandSource.SMEM)
        s_layout = qk.make_fragment_C(qk.partition_shape_C((128, kv))).layout
        tStS = cute.make_tensor(cute.make_ptr(F32, 0, cute.AddressSpace.tmem), s_layout)
        tS_src = tStS[(None, None), 0, 0]
        s_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tS_src)
        p_copy = cute.make_tiled_copy_D(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16,
                                                            num_bits_per_copy=128), s_load)
        cS = qk.get_slice(0).partition_C(cute.make_identity_tensor((128, kv)))[(None, None), 0, 0]
        cA = pv.get_slice(0).partition_A(cute.make_identity_tensor((128, kv)))
        return qk, pv, s_load, p_copy, cS, cA

    def shifted(shape, by):
        return cute.domain_offset(by, cute.make_identity_tensor(shape))
"""


def test_identity_coords_equals_cute_indexing_on_the_kernels_partitions(tmp_path):
    """Every register of the compared partitions, all four warps: identity_coords gives t[i]."""
    r = traced(_SETUP + """
    def same(name, t, step=1):
        a = identity_coords(t)
        n = cute.size(t)
        ok = len(a) == n and all(a[i] == t[i] for i in range(0, n, step))
        print("SAME" if ok else "DIFFER", name, len(a))

    @cute.jit
    def probe():
        qk, pv, s_load, p_store, o_load, o_store, cS, cP, cO = tmem_p()
        for t in (0, 45, 127):
            same(f"S-load {t}", s_load.get_slice(t).partition_D(cS))
            same(f"P-store {t}", p_store.get_slice(t).partition_S(cP))
            same(f"O-store {t}", o_store.get_slice(t).partition_S(cO))
        qk, pv, s_load, p_copy, cS, cA = smem_p()
        same("A (M, K) view", mk_view(cA), step=7)  # every 7th of 16384 (traced indexing is slow)
        c_mk = cute.make_identity_tensor((128, 128))
        for t in (0, 64, 127):
            same(f"SMEM-P regs {t}", p_copy.get_slice(t).retile(s_load.get_slice(t).partition_D(cS)))
            same(f"SMEM-P dst {t}", p_copy.get_slice(t).partition_D(c_mk))

    probe()
    """, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "DIFFER" not in out, out[-3000:]
    assert out.count("SAME") == 3 * 3 + 1 + 2 * 3, out[-3000:]
    assert "SAME A (M, K) view 16384" in out and "SAME S-load 0 128" in out, out[-3000:]


def test_agreement_checks_still_refuse_a_planted_mismatch(tmp_path):
    """The kernels' own pairs pass; shifted, transposed or wrong A-operand views are refused."""
    r = traced(_SETUP + """
    def expect(name, fn):
        try:
            fn()
            print("ACCEPTED", name)
        except ValueError as exc:
            print("REFUSED", name, "|", exc)

    @cute.jit
    def probe():
        qk, pv, s_load, p_store, o_load, o_store, cS, cP, cO = tmem_p()
        expect("tmem-p ok", lambda: check_same_fragment_coords(s_load, cS, p_store, cP, "TMEM-P"))
        expect("o ok", lambda: check_same_fragment_coords(o_load, cO, o_store, cO, "O rescale"))
        cP_off = pv.get_slice(0).partition_A(shifted((128, 128), (0, 1)))  # P's keys off by one
        expect("tmem-p shifted", lambda: check_same_fragment_coords(s_load, cS, p_store, cP_off, "TMEM-P"))
        cO_off = pv.get_slice(0).partition_C(shifted((128, 64), (1, 0)))  # rows off by one
        expect("o shifted", lambda: check_same_fragment_coords(o_load, cO, o_store, cO_off, "O rescale"))
        qk, pv, s_load, p_copy, cS, cA = smem_p()
        expect("smem-p ok", lambda: check_smem_p(s_load, cS, p_copy, cA, 128, 128))
        cS_off = qk.get_slice(0).partition_C(shifted((128, 128), (0, 1)))[(None, None), 0, 0]
        expect("smem-p regs shifted", lambda: check_smem_p(s_load, cS_off, p_copy, cA, 128, 128))
        cA_off = pv.get_slice(0).partition_A(shifted((128, 128), (0, 16)))
        expect("smem-p A view shifted", lambda: check_smem_p(s_load, cS, p_copy, cA_off, 128, 128))

    probe()
    """, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    for ok in ("tmem-p ok", "o ok", "smem-p ok"):
        assert f"ACCEPTED {ok}" in out, out[-3000:]
    assert "REFUSED tmem-p shifted | TMEM-P: TMEM load and store register fragments disagree for thread 0" in out
    assert "REFUSED o shifted | O rescale: TMEM load and store register fragments disagree for thread 0" in out
    assert "REFUSED smem-p regs shifted | SMEM-P: S-load and P-store fragments disagree for thread 0" in out
    assert "REFUSED smem-p A view shifted | SMEM-P: A-operand (M, K) view maps (0, 0) to (0, 16)" in out


def test_rungs_take_their_operands_as_one_tuple(project_root):
    """sm100 rungs B, C, D1 take AttentionOperands.args() as one KernelOperands."""
    from stages.common.sm100_setup import KernelOperands

    assert len(KernelOperands._fields) == 12
    for rung in ("B_identity_pv", "C_online_softmax", "D1_headdim"):
        text = (project_root / "stages" / rung / "sm100.py").read_text()
        assert "ops: KernelOperands," in text and "self.kernel(ops.args()," in text, rung
        assert "*ops.args()" not in text and "tma_k: cute.CopyAtom" not in text, rung
