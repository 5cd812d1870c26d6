"""Stage C on Blackwell (sm_100a): attention with an online softmax between two
tcgen05 MMAs, P kept on chip in TMEM (TMEM-P), one CTA.

Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math (row i of the 128 query rows, KV tiles j of 128 keys, scale = 1/sqrt(hd))
    S_j      = Q · K_jᵀ                                  fp32 in TMEM
    m_j      = max(m_{j-1}, max_k S_j[i, k])             running row max (raw scores)
    P_j      = exp2(S_j · c − m_j · c),  c = scale · log2(e)
    α_j      = exp2(m_{j-1} · c − m_j · c)               (α_0 = 0: m_{-1} = −inf)
    l_j      = α_j · l_{j-1} + Σ_k P_j[i, k]             running row sum (fp32 P)
    O_j      = α_j · O_{j-1} + bf16(P_j) · V_j           O in TMEM
    O        = bf16(O_last / l_last)
    LSE[i]   = ln Σ_k exp(scale · S[i, k]) = (m_last · c + log2 l_last) · ln 2
    Q, K, V, O bf16 row-major [m, hd] / [n, hd]; LSE fp32 [m].  m = 128, hd = 64,
    n a multiple of 128.

Warp roles (192 threads, stages/common/sm100_setup.py): warp 5 TMA (Q once, K_j and V_j into
2-slot rings, V never from K), warp 4 MMA (S = Q·K_jᵀ, then once P_j is in TMEM and O rescaled
O += P_j·V_j, A from TMEM, "TS"), warps 0-3 softmax (thread t ↔ TMEM lane t ↔ row t, so max
and sum are thread-local): S row → max, exp2, sum → bf16 P; wait for PV_{j-1}; rescale O if the
warp's max moved (tcgen05.ld → × α → tcgen05.st); tcgen05.st P → wait::st → signal.  End: O / l,
LSE.
    The rescale of O_{j-1} happens between PV_{j-1} (complete: the P slot's "empty" barrier is
    a tcgen05.commit after PV_{j-1}) and PV_j (not issued before P_j's "full" arrive, after the
    rescale's tcgen05.wait::st); the decision is per warp (vote.any over its 32 rows: tcgen05.ld/st
    are warp-collective); a row whose max did not move is multiplied by α = 1.

TMEM (256 columns): S fp32 [0, 128), P bf16 in S's upper half [64, 128), O fp32 [128, 192)
(`TmemPlan`).  New in this rung: `softmax_role` and the epilogue (O / l, LSE); set-up and
pipelines are sm100_setup.py's.  S_j and P_j share TMEM columns, so the softmax warps release S
only after PV_j completed (the P slot's "free" commit).  DSV4.md's lessons as in stage D1.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05

from stages.common import hang_guard
from stages.common.sm100_idioms import (
    check_same_fragment_coords,
    online_softmax_update,
    tcgen05_fence_after_sync,
    tcgen05_fence_before_sync,
    tmem_copy,
)
from stages.common.sm100_setup import KernelOperands, TmemPAttention, free_tmem, launch, producer_warps, rescale_o
from stages.common.tma import prefetch_descriptors

BF16 = cutlass.BFloat16
F32 = cutlass.Float32


class Kernel(TmemPAttention):
    """O = softmax(Q·Kᵀ / sqrt(hd))·V and its LSE, online softmax, P in TMEM, on sm_100a.

    Limits: m = 128, hd = 64, n a positive multiple of 128; row-major,
    16-byte aligned, static shapes; one CTA.
    """

    WHO = "stage C sm100"

    def __init__(self, *, m: int, n: int, hd: int):
        super().__init__(m=m, n=n, hd=hd)
        self.scale_log2 = math.log2(math.e) / math.sqrt(hd)  # softmax scale folded with log2(e)

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        K: cute.Tensor,
        V: cute.Tensor,
        O: cute.Tensor,
        LSE: cute.Tensor,
        stream: cuda.CUstream,
    ):
        ops, mO = self.operands(Q, K, V, O)
        launch(self.kernel(ops.args(), mO, LSE), (1, 1, 1), stream)

    @cute.kernel
    def kernel(
        self,
        ops: KernelOperands,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
    ):
        qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem, v_smem, p_layout = ops
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_k, tma_v)
        cta, loads, tmem = self.setup(qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem, v_smem,
                                      p_layout)
        # O in TMEM, loaded and stored 32 columns at a time (the rescale) and whole (the epilogue).
        o_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tmem.tOtO)
        o_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x32, F32, tmem.tOtO)
        cO = cta.pv_thr.partition_C(cute.make_identity_tensor(self.pv_tiler[:2]))  # (row, d)
        check_same_fragment_coords(o_load, cO, o_store, cO, "O rescale")  # trace time
        gO = cute.flat_divide(mO, cute.select(self.pv_tiler, mode=[0, 1]))[None, None, 0, 0, 0]  # (128, hd)
        tOgO = cta.pv_thr.partition_C(gO)

        producer_warps(warp_idx, cta, loads, qk_mma, pv_mma, tmem.tStS, tmem.tOrP, tmem.tOtO, self.n_tiles, 1)
        if warp_idx < self.MMA_WARP:
            row_max, row_sum = self.softmax_role(cta.s_cons, cta.p_prod, tmem.s_load, tmem.p_store, o_load, o_store,
                                                 tmem.tStS, tmem.tOrP, tmem.tOtO, tmem.cS, tmem.cP, cO, tidx)
            self.epilogue(cta.o_cons, o_load, tmem.tOtO, tOgO, cO, mLSE, row_max, row_sum, tidx)
            free_tmem(cta, tmem.ptr, tmem.cols)  # all four warps are done with TMEM: warp 0 frees it

    @cute.jit
    def softmax_role(self, s_cons, p_prod, s_load, p_store, o_load, o_store, tStS, tOrP, tOtO, cS, cP, cO, tidx):
        """Warps 0-3, per KV tile: S row → running max / sum → P = exp2 → P's TMEM view;
        between PV_{j-1} (complete) and PV_j (not yet issued) the O rescale by α.
        Returns the row's final (max, sum)."""
        hang_guard.role("softmax")  # names this role's waits in a --debug-hangs build
        thr_s = s_load.get_slice(tidx)
        thr_p = p_store.get_slice(tidx)
        thr_o = o_load.get_slice(tidx)
        tTR_tS = thr_s.partition_S(tStS)  # this thread's row of S in TMEM
        tRT_tP = thr_p.partition_D(tOrP)  # this thread's row of P in TMEM
        tTR_tO = thr_o.partition_S(tOtO)  # this thread's row of O in TMEM (load)
        tRT_tO = o_store.get_slice(tidx).partition_D(tOtO)  # the same row of O (store)
        tTR_cO = thr_o.partition_D(cO)  # its (row, d) coordinates
        rS = cute.make_rmem_tensor(thr_s.partition_D(cS).shape, F32)
        rP = cute.make_rmem_tensor(thr_p.partition_S(cP).shape, BF16)
        rP_as_s = cute.make_tensor(rP.iterator, rS.layout)  # same registers, S's indexing
        o_chunks = cute.size(tTR_cO, mode=[1])  # tcgen05.ld/st of 32 columns each
        rO_chunk = cute.make_rmem_tensor(tTR_cO[None, 0, None, 0].shape, F32)

        c = F32(self.scale_log2)
        row_max = F32(-math.inf)  # m_{j-1}, raw-score units
        row_sum = F32(0.0)  # l_{j-1}
        for j in cutlass.range(self.n_tiles, unroll=1):
            s_full = s_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            cute.copy(s_load, tTR_tS, rS)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: rS valid

            # m_j, α_j = 2^(m_{j-1}·c − m_j·c), P_j = 2^(S_j·c − m_j·c), l_j = α_j·l_{j-1} + Σ P_j.
            p, new_max, alpha, row_sum = online_softmax_update(rS.load(), row_max, row_sum, c)
            rP_as_s.store(p.to(BF16))

            # P slot free ⇔ PV_{j-1} complete ⇔ O_{j-1} final in TMEM (waited
            # already at the end of step j-1); PV_j waits for this slot's commit.
            p_slot = p_prod.acquire_and_advance()
            tcgen05_fence_after_sync()
            cute.copy(p_store, rP, tRT_tP)
            if j > 0:
                # Rescale O_{j-1} by alpha.  tcgen05.ld/st are warp-collective,
                # so the decision is warp-uniform: any row of the warp whose max
                # moved (the others multiply by alpha = 1).
                if cute.arch.vote_any_sync(new_max > row_max):
                    rescale_o(o_load, o_store, tTR_tO, tRT_tO, rO_chunk, alpha, 1, o_chunks)
            cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st: P and O in TMEM
            tcgen05_fence_before_sync()
            p_slot.commit()  # 128 arrivals → the MMA warp may run PV_j
            row_max = new_max
            # P_j sits in S_j's columns: hand S back for QK_{j+1} only once
            # PV_j has read P_j (the P slot's "free" is a tcgen05.commit after PV_j).
            p_prod.acquire()
            tcgen05_fence_before_sync()
            s_full.release()
        return row_max, row_sum

    @cute.jit
    def epilogue(self, o_cons, o_load, tOtO, tOgO, cO, mLSE, row_max, row_sum, tidx):
        """Warps 0-3, once the last PV completed: O row / l → bf16 → global; LSE
        (natural log) = (m·c + log2 l) · ln 2."""
        hang_guard.role("epilogue")  # names this role's waits in a --debug-hangs build
        thr_o = o_load.get_slice(tidx)
        tTR_tO = thr_o.partition_S(tOtO)
        tTR_gO = thr_o.partition_D(tOgO)  # this thread's row of O in global memory
        tTR_cO = thr_o.partition_D(cO)
        rO = cute.make_rmem_tensor(tTR_cO.shape, F32)
        rO_out = cute.make_rmem_tensor(tTR_cO.shape, BF16)
        row = tTR_cO[0][0]  # the query row this thread owns
        c = F32(self.scale_log2)
        o_full = o_cons.wait_and_advance()
        tcgen05_fence_after_sync()
        cute.copy(o_load, tTR_tO, rO)
        cute.arch.fence_view_async_tmem_load()
        inv_sum = F32(1.0) / row_sum
        rO_out.store((rO.load() * inv_sum).to(BF16))
        cute.autovec_copy(rO_out, tTR_gO)
        mLSE[row] = (row_max * c + cute.math.log2(row_sum, fastmath=True)) * F32(math.log(2.0))
        tcgen05_fence_before_sync()
        o_full.release()
