"""Stage D2 on sm_100a, compiled on the CPU: TMEM plan, K and V as one smem copy, splits, no spills."""

import pytest

from tests.conftest import sm100_decode_build, traced


# -- plain Python: the plans


def test_tmem_plan_fits_and_an_over_budget_plan_is_refused_with_its_columns():
    from stages.D2_decode.sm100 import Kernel, tmem_budget

    assert tmem_budget(512, 64, o_split=2, s_stages=2) == {
        "S": 64, "S_stages": 2, "O": 256, "P": 0, "total": 384, "alloc": 512, "limit": 512}
    assert tmem_budget(256, 64, o_split=1)["total"] == 384
    assert Kernel(shape="b1s1h128n256d512", splits=1).o_split == 2  # the default fits
    assert Kernel(shape="b1s1h128n256d256", splits=1).o_split == 1
    with pytest.raises(ValueError, match=r"TMEM budget: S 2×64 \+ O 512 = 640 columns > 512"):
        Kernel(shape="b1s1h128n256d512", splits=1, o_split=1)
    # S + O ≤ 512 fails either way
    with pytest.raises(ValueError, match=r"S 1×64 \+ O 512 = 576 columns > 512"):
        Kernel(shape="b1s1h128n256d512", splits=1, o_split=1, s_stages=1)


def test_split_plan_uses_the_scheduler_and_many_leaves_empty_splits():
    from stages.D2_decode.sm100 import Kernel

    k = Kernel(shape="b4s2h64n1152d512p100", splits="many")
    assert k.row_blocks == 1 and k.n_tiles == 18 and k.splits == 21
    last = k.sched.work(0, 20, 3)
    assert last.tile_begin >= last.tile_end  # an empty split: writes LSE = −inf, O = 0
    assert k.sched.work(0, 17, 0)[4:] == (17, 18)
    assert Kernel(shape="b4s64h128n1152d512", splits="auto").splits == 1  # 512 CTAs fill 148 SMs
    assert Kernel(shape="b1s1h64n256d512", splits="auto").splits > 1
    # both tokens in one 128-row block
    assert Kernel(shape="b1s2h64n256d512", splits=1).row_blocks == 1


def test_ring_never_deadlocks_on_the_next_tiles_qk():
    """QK_{j+1}'s early chunks reuse only K-only ring slots of tile j."""
    from stages.D2_decode.sm100 import ring_plan

    for d, o_split in ((64, 1), (128, 1), (256, 1), (512, 2), (512, 4)):
        r = ring_plan(d, o_split)
        assert r["qk_early"] >= 1, (d, o_split)
        for p in range(r["qk_early"]):
            prev = p + r["n_chunks"] - r["slots"]
            assert prev < r["n_nonv"], (d, o_split, p)


# -- traced checks


@pytest.mark.parametrize("stage, tensors, case, kw", [
    ("D2_decode", "decode import tensors", {"shape": "b1s1h128n256d512", "splits": 1}, {}),
    ("D5_sink_merge", "masked_decode import merge_tensors as tensors",
     {"shape": "b1s1h128m128n256d512", "splits": 1, "sink": "5", "branches": "k+k"}, {"branches": None}),
], ids=["D2", "D5"])
def test_trace_time_tmem_check_refuses_from_the_fragments(tmp_path, stage, tensors, case, kw):
    """Plan forced to "fits": the traced D2 (and D5) still refuses from the fragments."""
    args = {k: v for k, v in case.items() if k not in kw}
    r = traced("""
        import cutlass
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        import cutlass.cute as cute
        import stages.STAGE.sm100 as m
        import stages.common.sm100_decode as house  # where the constructor looks the plan up
        from oracles.TENSORS
        real = house.tmem_budget
        house.tmem_budget = lambda d, kv, o_split, s_stages: real(d, kv, 2, s_stages)  # lie: "fits"
        case = CASE
        k = m.Kernel(o_split=1, **ARGS)
        print("CONSTRUCTED")  # the constructor believed the lie: what refuses now is the traced check
        dt = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32, "int32": cutlass.Int32}
        fakes = [make_fake_compact_tensor(dt[s.dtype], s.shape, stride_order=tuple(reversed(range(len(s.shape)))),
                                          assumed_align=16) for s in tensors(case)]
        try:
            cute.compile(k, *fakes, make_fake_stream())
            print("COMPILED")
        except Exception as exc:
            print("REFUSED", exc)
    """.replace("STAGE", stage).replace("TENSORS", tensors).replace("CASE", repr(case)).replace("ARGS", repr(args)),
               tmp_path)
    out = r.stdout + r.stderr
    assert "CONSTRUCTED" in out and "COMPILED" not in out, out[-2000:]
    assert "TMEM budget: S 2×64 + O 512 = 640 columns > 512" in out, out[-2000:]


def test_v_view_is_the_same_bytes_as_k_and_a_wrong_view_is_refused(tmp_path):
    r = traced("""
        import cutlass.cute as cute
        import stages.D2_decode.sm100 as m

        @cute.jit
        def probe():
            for shape in ("b1s1h128n256d512", "b1s1h128n256d64"):
                k = m.Kernel(shape=shape, splits=1)
                qk, pv, q_smem, k_smem, v_smem, p_smem = k.operands()  # runs the check
                kc, vc = k.kv_coords(qk, pv)
                print("SAME", shape, m.check_kv_same_bytes(k_smem, v_smem, kc, vc))
                try:  # K's own layout read with V's (column, key) coordinates is not V
                    m.check_kv_same_bytes(k_smem, k_smem, kc, vc)
                    print("WRONG-ACCEPTED")
                except ValueError as exc:
                    print("WRONG-REFUSED", exc)

        probe()
    """, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    assert "SAME b1s1h128n256d512 8192" in out  # 64 keys × 128 columns, every element compared
    assert "SAME b1s1h128n256d64 4096" in out
    assert "WRONG-ACCEPTED" not in out and out.count("WRONG-REFUSED K/V same bytes") == 2, out[-2000:]


def test_representative_case_compiles_for_sm100a_without_spills(tmp_path, monkeypatch):
    """d = 512, more splits than tiles, NaN pad rows, the combine, via the compile path."""
    inv = sm100_decode_build(monkeypatch, tmp_path, "D2", {"shape": "b4s2h64n1152d512p100", "splits": "many"},
                             "tcgen05.ld", "tcgen05.commit", "cp.async.bulk.tensor", "fence.proxy.async.shared::cta")
    assert not any(k.startswith("tcgen05.mma.cta_group::2") for k in inv)
