"""Stages D3–D5 on sm_100a, compiled on the CPU: TMEM, tiles, 128-byte rows, S mask, no spills."""

import pytest

from tests.conftest import sm100_decode_build, traced


# -- plain Python: plans


@pytest.mark.parametrize("module, shape, extra", [
    ("stages.D3_swa.sm100", "b4s1h64n256d512", {}),
    ("stages.D4_causal_swa.sm100", "b4s2h128n256d512", {}),
    ("stages.D5_sink_merge.sm100", "b4s2h128m128n256d512", {"sink": "5"}),
])
def test_each_rung_keeps_d2s_tmem_plan_and_refuses_one_that_does_not_fit(module, shape, extra):
    import importlib

    Kernel = importlib.import_module(module).Kernel
    k = Kernel(shape=shape, splits=1, **extra)
    assert k.o_split == 2 and k.budget["total"] == 2 * 64 + 256 <= 512  # S 2×64 + O 256 per CTA
    with pytest.raises(ValueError, match=r"TMEM budget: S 2×64 \+ O 512 = 640 columns > 512"):
        Kernel(shape=shape, splits=1, o_split=1, **extra)


def test_d5_tile_space_is_both_branches_and_its_sink_switch():
    from stages.D5_sink_merge.sm100 import Kernel

    k = Kernel(shape="b4s2h128m128n256d512", splits="many", sink="none")
    assert k.n_tiles == 2 + 4 and k.splits == 6 + 3 and not k.has_sink
    assert Kernel(shape="b4s2h128m128n256d512", splits=1, sink="-inf").has_sink
    assert Kernel(shape="b4s2h128m128n256d512", splits=1, sink=0).has_sink  # a YAML number
    with pytest.raises(ValueError, match="n_main must be a multiple of 64"):
        Kernel(shape="b4s2h128m100n256d512", splits=1, sink="none")


@pytest.mark.parametrize("h_q, s_q, want", [
    (128, 1, [0]), (128, 2, [0, 1]), (64, 1, [0]), (64, 2, [1]), (64, 3, [1, 2]),
])
def test_block_last_token_is_the_last_token_with_a_row_in_the_block(h_q, s_q, want):
    """A 128-row block visits its last token's tiles."""
    from stages.D4_causal_swa.sm100 import Kernel

    k = Kernel(shape=f"b1s{s_q}h{h_q}n256d512", splits=1)
    assert [int(k.block_last_token(rb)) for rb in range(k.row_blocks)] == want
    for rb, t in enumerate(want):  # tokens ≤ t, and t
        rows = range(rb * 128, min((rb + 1) * 128, s_q * h_q))
        assert max(r // h_q for r in rows) == t


def _plan(branches, fills, begin, end, t_hi, s_q):
    from stages.common.sm100_keys import BranchKeys

    k = BranchKeys(branches, [(None, None)] * len(branches), fills, begin, end, t_hi, s_q, 64)
    return int(k.count), int(k.n_first), int(k.first_begin), int(k.second_begin)


def test_visit_plans_of_the_masked_rungs():
    from stages.common.sm100_keys import Branch

    swa = Branch("swa", 1152, 1152)
    assert _plan([swa], [0], 0, 18, 0, 1)[0] == 0  # a lonely batch visits nothing
    assert _plan([swa], [65], 0, 18, 0, 1)[0] == 2  # 65 keys: tiles 0 and 1 (the boundary)
    assert _plan([swa], [64], 0, 18, 0, 1)[0] == 1  # on a tile edge: no boundary tile
    assert _plan([swa], [1152], 5, 9, 0, 1)[:3] == (4, 4, 5)  # a split's own range
    assert _plan([swa], [100], 5, 9, 0, 1)[0] == 0  # a split above the fill level is empty
    causal = Branch("swa", 256, 256, causal=True)
    # fill 65, s_q 2: 1 tile, then 2
    assert _plan([causal], [65], 0, 4, 0, 2)[0] == 1
    assert _plan([causal], [65], 0, 4, 1, 2)[0] == 2
    assert _plan([causal], [1], 0, 4, 0, 2)[0] == 0  # fill < s_q: token 0 sees nothing
    main, swa2 = Branch("main", 128, 128), Branch("swa", 256, 256, causal=True)
    # main [0, 2), SWA [2, 6); split over the border
    assert _plan([main, swa2], [128, 256], 1, 4, 0, 1) == (3, 1, 1, 0)
    assert _plan([main, swa2], [0, 256], 0, 6, 0, 1)[:2] == (4, 0)  # empty main branch
    assert _plan([main, swa2], [70, 0], 0, 6, 0, 1)[:2] == (2, 2)  # empty SWA branch


# -- traced


def test_ring_rows_are_whole_lines_and_a_wrong_line_view_is_refused(tmp_path):
    """V rows past the fill are zeroed as whole 128-byte lines; a wrong view is refused."""
    r = traced("""
        import cutlass.cute as cute
        import stages.D3_swa.sm100 as m
        from stages.common.sm100_masks import check_lines

        @cute.jit
        def probe():
            for shape in ("b1s1h128n256d512", "b1s1h128n256d64"):
                k = m.Kernel(shape=shape, splits=1)
                qk, pv, q_smem, k_smem, v_smem, p_smem = k.operands()
                kc, vc = k.kv_coords(qk, pv)
                print("LINES", shape, check_lines(k_smem, kc, 64, k.chunk))
                try:  # V's MN-major view read as K-major lines is not line-aligned
                    check_lines(v_smem, vc, 64, k.chunk)
                    print("WRONG-ACCEPTED")
                except ValueError as exc:
                    print("WRONG-REFUSED", exc)

        probe()
    """, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    assert "LINES b1s1h128n256d512 8192" in out and "LINES b1s1h128n256d64 4096" in out, out[-2000:]
    assert "WRONG-ACCEPTED" not in out and out.count("WRONG-REFUSED KV lines") == 2, out[-2000:]


def test_mask_columns_are_trace_time_constants_and_a_row_shift_is_refused(tmp_path):
    """Register i of each S fragment holds key column i; a one-row shift is refused."""
    r = traced("""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import tcgen05
        import stages.D3_swa.sm100 as m
        from stages.common.sm100_idioms import tmem_copy
        from stages.common.sm100_masks import row_key_columns

        @cute.jit
        def probe():
            k = m.Kernel(shape="b1s1h128n256d512", splits=1)
            qk, pv, q_smem, k_smem, v_smem, p_smem = k.operands()
            s_frag = qk.make_fragment_C(qk.partition_shape_C((128, 64)))
            tS = cute.make_tensor(cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem), s_frag.layout)
            thr = qk.get_slice(0)
            cS = thr.partition_C(cute.make_identity_tensor((128, 64)))[(None, None), 0, 0]
            s_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, cutlass.Float32, tS[(None, None), 0, 0])
            print("COLS", row_key_columns(s_load, cS) == tuple(range(64)))
            shifted = thr.partition_C(cute.domain_offset((1, 0), cute.make_identity_tensor((128, 64))))
            try:
                row_key_columns(s_load, shifted[(None, None), 0, 0])
                print("WRONG-ACCEPTED")
            except ValueError as exc:
                print("WRONG-REFUSED", exc)

        probe()
    """, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    assert "COLS True" in out, out[-2000:]
    assert "WRONG-ACCEPTED" not in out and "WRONG-REFUSED S load: thread 0 holds a register of another row" in out, out[-2000:]


# D5's TMEM check: test_d2_sm100.py


@pytest.mark.parametrize("stage, case", [
    ("D4", {"shape": "b4s3h64n256d512", "fill": "at", "splits": "many"}),
    ("D5", {"shape": "b4s2h128m128n256d512", "branches": "k+k", "sink": 5, "splits": 1}),
])
def test_representative_case_compiles_for_sm100a_without_spills(stage, case, tmp_path, monkeypatch):
    """Compile path: D4 with three tokens, empty splits, combine; D5 with both branches and sink."""
    sm100_decode_build(monkeypatch, tmp_path, stage, case, "tcgen05.ld", "tcgen05.st", "tcgen05.commit",
                       "cp.async.bulk.tensor", "fence.proxy.async.shared::cta")
