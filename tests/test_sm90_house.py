"""sm90 pieces A–D1 share: `smem_struct` equals the hand structs; the register-P house calls hooks."""

import subprocess

from tests.conftest import traced


def _traced(script: str, tmp_path) -> subprocess.CompletedProcess:
    return traced(script, tmp_path, "sm_90a")


def test_smem_struct_matches_the_hand_written_structs(tmp_path):
    """D1's and register-P storage equal the old structs; a reordered one does not."""
    r = _traced("""
        import cutlass
        import cutlass.cute as cute
        from cutlass.tensor_utils import LayoutEnum
        import cutlass.utils.hopper_helpers as sm90_utils
        from stages.common.sm90_setup import TmaPipe, smem_struct

        @cute.jit
        def probe():
            bf16 = cutlass.BFloat16
            bm, bn, hd, st = 64, 64, 512, 1
            q = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bm, bn, hd), bf16, 1)
            k = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (bm, bn, hd), bf16, st)
            v = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (bm, hd, bn), bf16, st)
            p = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bm, hd, bn), bf16, 1)

            @cute.struct
            class HandD1:
                q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
                k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * st]
                v_mbar: cute.struct.MemRange[cutlass.Int64, 2 * st]
                row_factor: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bm], 16]
                sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(k)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(v)], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(p)], 1024]

            @cute.struct
            class HandRegisterP:
                q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
                kv_mbar: cute.struct.MemRange[cutlass.Int64, 4]
                sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(k)], 1024]
                sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(v)], 1024]

            d1 = smem_struct((TmaPipe("q", 1, 0, 4), TmaPipe("k", st, 0, 4), TmaPipe("v", st, 0, 8)),
                             {"sQ": (bf16, q), "sK": (bf16, k), "sV": (bf16, v), "sP": (bf16, p)}, row_factor_rows=bm)
            rp = smem_struct((TmaPipe("q", 1, 0, 8), TmaPipe("kv", 2, 0, 8)),
                             {"sQ": (bf16, q), "sK": (bf16, k), "sV": (bf16, v)})
            swapped = smem_struct((TmaPipe("q", 1, 0, 8), TmaPipe("kv", 2, 0, 8)),
                                  {"sQ": (bf16, q), "sV": (bf16, v), "sK": (bf16, k)})
            for name, made, hand in (("D1", d1, HandD1), ("RP", rp, HandRegisterP), ("SWAPPED", swapped, HandRegisterP)):
                same = made._offsets == hand._offsets and made.size_in_bytes() == hand.size_in_bytes()
                print(name, "SAME" if same else "DIFFERENT", made.size_in_bytes(), made._offsets)
            print("SQ-ALIGNED", d1._offsets["sQ"] % 1024 == 0, d1._offsets["row_factor"])

        probe()
    """, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "D1 SAME" in out and "RP SAME" in out, out[-3000:]
    assert "SWAPPED DIFFERENT" in out, out[-3000:]  # a reordering is seen
    assert "SQ-ALIGNED True 48" in out, out[-3000:]  # 3 pipelines × 2 mbarriers × 8 B (one slot each)
    assert "D1 SAME 205824 " in out, out[-3000:]  # stage D1's measured hd = 512 shared memory


def test_register_p_house_calls_the_rungs_hooks(tmp_path):
    """A raising hook stops stage B in the hook; unchanged, it traces through."""
    r = _traced("""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
        import stages.B_identity_pv.sm90 as b
        from tests.fixtures.wrong_b.sm90 import Kernel as WrongB

        class Between(b.Kernel):
            @cute.jit
            def between(self, acc_s, acc_o, state):
                raise RuntimeError("HOOK-BETWEEN")

        class PFromScores(b.Kernel):
            def p_from_scores(self, acc_s, thr_pv, tile_mk, dtype):
                raise RuntimeError("HOOK-P")

        class SeesWrongB(WrongB):  # the fixture's own p_from_scores runs, then we stop
            def p_from_scores(self, acc_s, thr_pv, tile_mk, dtype):
                out = super().p_from_scores(acc_s, thr_pv, tile_mk, dtype)
                raise RuntimeError("HOOK-WRONG-B")

        def fakes():
            t = lambda dt, shape: make_fake_compact_tensor(dt, shape, stride_order=(1, 0), assumed_align=16)
            bf = cutlass.BFloat16
            return t(bf, (128, 64)), t(bf, (128, 64)), t(bf, (128, 64)), t(bf, (128, 64))

        for cls in (Between, PFromScores, SeesWrongB, b.Kernel):
            try:
                cute.compile(cls(m=128, n=128, hd=64), *fakes(), make_fake_stream())
                print(cls.__name__, "COMPILED")
            except Exception as exc:
                hooks = [h for h in ("HOOK-BETWEEN", "HOOK-P", "HOOK-WRONG-B") if h in str(exc)]
                print(cls.__name__, "STOPPED", hooks or str(exc)[:300])
    """, tmp_path)
    out = r.stdout + r.stderr
    assert "Between STOPPED ['HOOK-BETWEEN']" in out, out[-3000:]
    assert "PFromScores STOPPED ['HOOK-P']" in out, out[-3000:]
    assert "SeesWrongB STOPPED ['HOOK-WRONG-B']" in out, out[-3000:]
    assert "Kernel COMPILED" in out, out[-3000:]
