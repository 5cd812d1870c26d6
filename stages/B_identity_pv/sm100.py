"""Stage B on Blackwell (sm_100a): O = bf16(Q·Kᵀ)·V with P kept on chip (TMEM-P).
Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Math
    S_j = Q · K_jᵀ                  fp32, K_j = rows [128 j, 128 j + 128) of K
    P_j = bf16(S_j)                 identity softmax: no scale, no max, no sum
    O   = bf16( Σ_j P_j · V_j )     fp32 accumulation over the n / 128 KV tiles
    Q [m, hd], K [n, hd], V [n, hd], O [m, hd]: bf16, row-major.  m = 128,
    hd = 64, n a multiple of 128.

The CTA, its warps (5 TMA, 4 MMA, 0-3 the "softmax" warpgroup, thread t ↔ TMEM lane t ↔ row t)
and its pipelines are stages/common/sm100_setup.py's; TMEM (256 columns): S fp32 in [0, 128),
P bf16 in S's upper half [64, 128), O fp32 in [128, 192), all from `TmemPlan`
(sm100_idioms.py).  New in this rung: `softmax_role` (tcgen05.ld S → bf16 → tcgen05.st into P's
TMEM view → wait::st → signal) and its epilogue.  S_j and P_j share TMEM columns, so the softmax
warps release S only after PV_j completed (the P slot's "free" commit).

DSV4.md's lessons as in stage D1 (stages/D1_headdim/sm100.py); hd = 64 only (other hd raise
ValueError: SMEM-P is stage D1)."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import tcgen05

from stages.common import hang_guard
from stages.common.sm100_idioms import tcgen05_fence_after_sync, tcgen05_fence_before_sync, tmem_copy
from stages.common.sm100_setup import KernelOperands, TmemPAttention, free_tmem, launch, producer_warps
from stages.common.tma import prefetch_descriptors

BF16 = cutlass.BFloat16
F32 = cutlass.Float32


class Kernel(TmemPAttention):
    """O[m, hd] = bf16(Q·Kᵀ)·V, identity softmax, P in TMEM, on sm_100a tensor cores.

    Limits: m = 128, hd = 64, n a positive multiple of 128; row-major,
    16-byte aligned, static shapes; one CTA.
    """

    WHO = "stage B sm100"

    @cute.jit
    def __call__(self, Q: cute.Tensor, K: cute.Tensor, V: cute.Tensor, O: cute.Tensor, stream: cuda.CUstream):
        ops, mO = self.operands(Q, K, V, O)
        launch(self.kernel(ops.args(), mO), (1, 1, 1), stream)

    @cute.kernel
    def kernel(
        self,
        ops: KernelOperands,
        mO: cute.Tensor,
    ):
        qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem, v_smem, p_layout = ops
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_k, tma_v)
        cta, loads, tmem = self.setup(qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, q_smem, k_smem, v_smem,
                                      p_layout)
        o_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tmem.tOtO)
        gO = cute.flat_divide(mO, cute.select(self.pv_tiler, mode=[0, 1]))[None, None, 0, 0, 0]  # (128, hd)
        tOgO = cta.pv_thr.partition_C(gO)

        producer_warps(warp_idx, cta, loads, qk_mma, pv_mma, tmem.tStS, tmem.tOrP, tmem.tOtO, self.n_tiles, 1)
        if warp_idx < self.MMA_WARP:
            self.softmax_role(cta.s_cons, cta.p_prod, tmem.s_load, tmem.p_store, tmem.tStS, tmem.tOrP,
                              tmem.cS, tmem.cP, tidx)
            self.epilogue(cta.o_cons, o_load, tmem.tOtO, tOgO, tidx)
            free_tmem(cta, tmem.ptr, tmem.cols)  # all four warps are done with TMEM: warp 0 frees it

    @cute.jit
    def softmax_role(self, s_cons, p_prod, s_load, p_store, tStS, tOrP, cS, cP, tidx):
        """Warps 0-3, per KV tile: S row → registers → P = bf16(S) → P's TMEM view;
        S is handed back only once PV_j has read P_j (P lives in S's columns)."""
        hang_guard.role("softmax")  # names this role's waits in a --debug-hangs build
        thr_s = s_load.get_slice(tidx)
        thr_p = p_store.get_slice(tidx)
        tTR_tS = thr_s.partition_S(tStS)  # this thread's row of S in TMEM
        tRT_tP = thr_p.partition_D(tOrP)  # this thread's row of P in TMEM
        rS = cute.make_rmem_tensor(thr_s.partition_D(cS).shape, F32)
        rP = cute.make_rmem_tensor(thr_p.partition_S(cP).shape, BF16)
        rP_as_s = cute.make_tensor(rP.iterator, rS.layout)  # same registers, S's indexing
        for j in cutlass.range(self.n_tiles, unroll=1):
            s_full = s_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            cute.copy(s_load, tTR_tS, rS)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: rS valid
            # Identity softmax: P = bf16(S), register i ↔ the same (row, key).
            rP_as_s.store(rS.load().to(BF16))
            # P slot free ⇔ PV_{j-1} complete (waited already at the end of step j-1).
            p_slot = p_prod.acquire_and_advance()
            tcgen05_fence_after_sync()
            cute.copy(p_store, rP, tRT_tP)
            cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st: P is in TMEM
            tcgen05_fence_before_sync()
            p_slot.commit()  # 128 arrivals → the MMA warp may run PV_j
            # P_j sits in S_j's columns: hand S back for QK_{j+1} only once
            # PV_j has read P_j (the P slot's "free" is a tcgen05.commit after PV_j).
            p_prod.acquire()
            tcgen05_fence_before_sync()
            s_full.release()

    @cute.jit
    def epilogue(self, o_cons, o_load, tOtO, tOgO, tidx):
        """Warps 0-3: O row (TMEM) → bf16 → global memory, once the last PV completed."""
        hang_guard.role("epilogue")  # names this role's waits in a --debug-hangs build
        thr_o = o_load.get_slice(tidx)
        tTR_tO = thr_o.partition_S(tOtO)  # this thread's row of O in TMEM
        tTR_gO = thr_o.partition_D(tOgO)  # this thread's row of O in global memory
        rO = cute.make_rmem_tensor(tTR_gO.shape, F32)
        rO_out = cute.make_rmem_tensor(tTR_gO.shape, BF16)
        o_full = o_cons.wait_and_advance()
        tcgen05_fence_after_sync()
        cute.copy(o_load, tTR_tO, rO)
        cute.arch.fence_view_async_tmem_load()
        rO_out.store(rO.load().to(BF16))
        cute.autovec_copy(rO_out, tTR_gO)
        tcgen05_fence_before_sync()
        o_full.release()
