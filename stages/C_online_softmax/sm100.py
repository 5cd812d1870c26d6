"""Stage C on Blackwell (sm_100a): attention with an online softmax between two
tcgen05 MMAs, P kept on chip in TMEM (TMEM-P), one CTA.

Compiled for sm_100a and inspected (PTX inventory, ptxas) only: it has never
run on a Blackwell GPU.  Do not call it verified.

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
    n a multiple of 128 (the stage runs n ∈ {128, 256, 1024}).

Units and data flow (one CTA, 192 threads, warp-specialised)
    warp 5      TMA producer: Q once, then K_j and V_j into 2-slot rings.
                V is loaded from V (never from K, even when they alias).
    warp 4      MMA issuer: per KV tile, S = Q·K_jᵀ (SMEM × SMEM → TMEM), then,
                once P_j is in TMEM (and O rescaled), O += P_j·V_j (A from
                TMEM, "TS"; accumulate flag off for j = 0).
    warps 0-3   softmax warpgroup, thread t ↔ TMEM lane t ↔ query row t (warp
                w may only touch lanes 32w … 32w + 31), so every row
                reduction (max, sum) is thread-local:
                tcgen05.ld S row → max, exp2, sum → bf16 P; wait until PV_{j-1}
                has completed; if the max moved for any row of the warp,
                rescale O in TMEM (tcgen05.ld → × α → tcgen05.st, the
                correction pass); tcgen05.st P → tcgen05.wait::st → signal
                the MMA warp.  At the end: O row / l → bf16 → global, LSE.

    The rescale of O_{j-1} happens between PV_{j-1} (complete: the P-slot
    "empty" barrier is a tcgen05.commit after PV_{j-1}) and PV_j (not issued:
    the MMA warp waits for the P_j "full" barrier, arrived after the rescale's
    tcgen05.wait::st).  tcgen05.ld/st are warp-collective, so the decision
    is made per warp (vote.any over its 32 rows); a row whose max did not
    move is multiplied by α = 1.

TMEM (256 columns allocated): S fp32 in columns [0, 128); P bf16 in the upper
half of S, columns [64, 128) (two bf16 per column); O fp32 in [128, 192).
All offsets come from `TmemPlan` (stages/common/sm100_idioms.py).

Synchronisation (mbarriers via cutlass.pipeline; arrive counts in THREADS)
    q, k, v   PipelineTmaUmma   load warp (TMA tx bytes) → MMA warp (tcgen05.commit)
    s         PipelineUmmaAsync MMA warp commit → 128 softmax threads
    p         PipelineAsyncUmma 128 softmax threads → MMA warp; its release is a
              tcgen05.commit, so "P slot free" also means "PV_j complete"
    o         PipelineUmmaAsync MMA warp commit after the last PV → 128 threads

    S_j and P_j share TMEM columns, and QK_{j+1} overwrites both.  The softmax
    warps therefore hand the S buffer back (s "empty") only after PV_j has
    completed: after committing P_j they wait on the P slot's "free" barrier
    (the MMA warp's tcgen05.commit after PV_j), then release S.  QK_{j+1}
    never overwrites P_j while PV_j reads it, and nothing relies on the
    execution order of tcgen05.mma instructions.

Lessons of DSV4.md ("What the first attempt taught"), as handled here
    1  Every value used by more than one branch (TMEM plan, copies, fragments,
       pipelines) is built before the warp-role `if`s; the loop-carried row
       max and sum are Float32 values defined before the KV loop; the O
       rescale `if` defines nothing used after it.
    2  Every pipeline side made of threads counts threads: the softmax side is
       CooperativeGroup(Thread, 128); MMA/TMA sides are 1 (elected thread).
    3  After the tcgen05.st of P (and of the rescaled O): tcgen05.wait::st
       (fence_view_async_tmem_store) and tcgen05.fence::before_thread_sync,
       then the P-full arrive; the MMA warp does tcgen05.fence::after_thread_sync
       after its wait.
    4  Column offsets come from find_tmem_tensor_col_offset of the fragments
       (TmemPlan), checked against the tile shapes; P's bf16 pointer is the
       fp32 column offset recast (2 × columns in bf16 elements).
    5  P's TMEM view is the PV MMA's A-operand fragment, built from
       make_smem_layout_a of the PV tiler, K-major; the P store is partitioned
       from that same view.  Trace-time checks prove the S-load and P-store
       register fragments (and the O load/store pair) agree element by element.
    6  P spans pv_tiler K (the 128-wide KV tile) × 16 / 32 = 64 columns.
    7  hd = 64 only (the S accumulator and the PV A operand agree); other hd
       raise ValueError: SMEM-P is stage D1.
    8  N of QK = 128, N of PV = hd = 64: both valid tcgen05 bf16 N.
    9  Q, K, V, O are given a unit L mode ((rows, cols, 1)) before tiling.
    10 Not used: V has its own TMA and buffer (V may alias K, but K is never
       read for V).
    11 Process rule, followed while writing: after each change the scratch
       compile check re-ran stage B's hd = 64 cases first, then stage C's
       (PTX inventory, ptxas registers/spills).  C keeps B's data path and
       barriers unchanged and adds only the softmax math and the O rescale.
    12 Nothing here needs credentials.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.memory import TmemAllocator

from stages.common.sm100_idioms import (
    TmemPlan,
    attention_smem_struct,
    attention_views,
    check_same_fragment_coords,
    online_softmax_update,
    tcgen05_fence_after_sync,
    tcgen05_fence_before_sync,
    threads_to_umma_pipeline,
    tma_umma_pipeline,
    tmem_allocate,
    tmem_copy,
    tmem_free,
    umma_to_threads_pipeline,
)
from stages.common.inspection import expose
from stages.common.tma import prefetch_descriptors, sm100_tma_load, tma_partition_tile

BF16 = cutlass.BFloat16
F32 = cutlass.Float32


class Kernel:
    """O = softmax(Q·Kᵀ / sqrt(hd))·V and its LSE, online softmax, P in TMEM, on sm_100a.

    Limits: m = 128, hd = 64, n a positive multiple of 128; row-major,
    16-byte aligned, static shapes; one CTA.
    """

    TILE_M = 128  # query rows = UMMA M
    KV_TILE = 128  # keys per KV tile = N of QK = K of PV
    KV_STAGES = 2  # shared-memory slots for K and for V
    SOFTMAX_WARPS = (0, 1, 2, 3)
    MMA_WARP = 4
    LOAD_WARP = 5
    THREADS = 32 * 6
    SOFTMAX_THREADS = 32 * 4

    def __init__(self, *, m: int, n: int, hd: int):
        if m != self.TILE_M:
            raise ValueError(f"stage C sm100: m must be {self.TILE_M}, got {m}")
        if hd != 64:
            raise ValueError(f"stage C sm100: TMEM-P needs hd = 64, got {hd} (SMEM-P is stage D1)")
        if n <= 0 or n % self.KV_TILE != 0:
            raise ValueError(f"stage C sm100: n must be a positive multiple of {self.KV_TILE}, got {n}")
        self.m, self.n, self.hd = m, n, hd
        self.n_tiles = n // self.KV_TILE
        self.qk_tiler = (self.TILE_M, self.KV_TILE, hd)  # (M, N, K) of S = Q·Kᵀ
        self.pv_tiler = (self.TILE_M, hd, self.KV_TILE)  # (M, N, K) of O = P·V
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
        # (rows, cols, L = 1) views.  PV's B operand is Vᵀ: (N = hd, K = n), MN-major.
        mQ, mK, mV, mO = attention_views(Q, K, V, O, "stage C sm100")

        cta = tcgen05.CtaGroup.ONE
        qk_mma = sm100_utils.make_trivial_tiled_mma(
            BF16, BF16, OperandMajorMode.K, OperandMajorMode.K, F32, cta, self.qk_tiler[:2]
        )
        # P comes from TMEM, and an A operand in TMEM is K-major.
        pv_mma = sm100_utils.make_trivial_tiled_mma(
            BF16, BF16, OperandMajorMode.K, OperandMajorMode.MN, F32, cta, self.pv_tiler[:2],
            tcgen05.OperandSource.TMEM,
        )

        q_smem = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, BF16, 1)
        k_smem = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, BF16, self.KV_STAGES)
        v_smem = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, BF16, self.KV_STAGES)
        p_layout = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, BF16, 1)  # P's A-operand layout

        tma_q, tma_Q, self.q_bytes = sm100_tma_load("A", qk_mma, mQ, q_smem, self.qk_tiler)
        tma_k, tma_K, self.k_bytes = sm100_tma_load("B", qk_mma, mK, k_smem, self.qk_tiler)
        tma_v, tma_V, self.v_bytes = sm100_tma_load("B", pv_mma, mV, v_smem, self.pv_tiler)

        # Barriers of the six pipelines, the TMEM address, Q, K and V buffers.
        self.smem_struct = attention_smem_struct(BF16, q_smem, k_smem, v_smem, self.KV_STAGES, self.KV_STAGES)

        self.kernel(
            qk_mma, pv_mma, tma_q, tma_Q, tma_k, tma_K, tma_v, tma_V, mO, LSE, q_smem, k_smem, v_smem, p_layout
        ).launch(
            grid=(1, 1, 1),
            block=(self.THREADS, 1, 1),
            stream=stream,
            min_blocks_per_mp=1,  # .minnctapersm 1: ptxas may use > 168 registers, no spills
        )

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        v_smem: cute.ComposedLayout,
        p_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_k, tma_v)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (MMA, MMA_M, MMA_K, 1)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (MMA, MMA_N, MMA_K, stages)
        sV = storage.sV.get_tensor(v_smem.outer, swizzle=v_smem.inner)  # (MMA, MMA_N, MMA_K, stages)

        # ---- pipelines (arrive counts: elected thread = 1, softmax side = 128 threads)
        q_prod, q_cons = tma_umma_pipeline(storage.q_mbar, 1, self.q_bytes)
        k_prod, k_cons = tma_umma_pipeline(storage.k_mbar, self.KV_STAGES, self.k_bytes)
        v_prod, v_cons = tma_umma_pipeline(storage.v_mbar, self.KV_STAGES, self.v_bytes)
        s_prod, s_cons = umma_to_threads_pipeline(storage.s_mbar, self.SOFTMAX_THREADS)
        p_prod, p_cons = threads_to_umma_pipeline(storage.p_mbar, self.SOFTMAX_THREADS)
        o_prod, o_cons = umma_to_threads_pipeline(storage.o_mbar, self.SOFTMAX_THREADS)

        # TMEM: warp 0 allocates and frees; every warp reads the address after barrier 1.
        tmem_alloc = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=self.THREADS),
            allocator_warp_id=self.SOFTMAX_WARPS[0],
        )
        softmax_sync = pipeline.NamedBarrier(barrier_id=2, num_threads=self.SOFTMAX_THREADS)

        # ---- MMA operands (shared-memory descriptors)
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrQ = qk_mma.make_fragment_A(sQ)  # (MMA, MMA_M, MMA_K, 1)
        tSrK = qk_mma.make_fragment_B(sK)  # (MMA, MMA_N, MMA_K, stages)
        tOrV = pv_mma.make_fragment_B(sV)  # (MMA, MMA_N, MMA_K, stages)

        # ---- TMA partitions: Q (TMA, 1), K_j (TMA, n_tiles), V_j (TMA, n_tiles)
        gQ = cute.flat_divide(mQ, cute.select(self.qk_tiler, mode=[0, 2]))  # (128, hd, 1, 1, 1)
        gK = cute.flat_divide(mK, cute.select(self.qk_tiler, mode=[1, 2]))  # (128, hd, n_tiles, 1, 1)
        gV = cute.flat_divide(mV, cute.select(self.pv_tiler, mode=[1, 2]))  # (hd, 128, 1, n_tiles, 1)
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, qk_thr.partition_A(gQ), 3)
        tKsK, tKgK = tma_partition_tile(tma_k, sK, qk_thr.partition_B(gK), 3)
        tVsV, tVgV = tma_partition_tile(tma_v, sV, pv_thr.partition_B(gV), 3)
        tQgQ = tQgQ[None, 0, 0, 0]  # (TMA)
        tKgK = tKgK[None, None, 0, 0]  # (TMA, n_tiles)
        tVgV = tVgV[None, 0, None, 0]  # (TMA, n_tiles)

        # ---- TMEM: plan (S, P inside S, O), allocation by warp 0, address to all warps.
        tmem_plan = TmemPlan(qk_mma, pv_mma, self.qk_tiler, self.pv_tiler, p_layout, F32, BF16)
        tmem_cols = tmem_plan.alloc_cols
        tmem_ptr = tmem_allocate(tmem_alloc, tmem_cols)  # tcgen05.alloc by the allocator warp (0)
        tStS, tOrP, tOtO = tmem_plan.views(tmem_ptr)

        # ---- softmax-warpgroup TMEM copies; thread t ↔ lane t ↔ row t.
        s_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tStS)
        p_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x16, BF16, tOrP)
        o_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        o_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        cS = qk_thr.partition_C(cute.make_identity_tensor(self.qk_tiler[:2]))  # (row, key)
        cP = pv_thr.partition_A(cute.make_identity_tensor((self.TILE_M, self.KV_TILE)))  # (row, key)
        cO = pv_thr.partition_C(cute.make_identity_tensor(self.pv_tiler[:2]))  # (row, d)
        check_same_fragment_coords(s_load, cS, p_store, cP, "TMEM-P (S → P)")  # trace time
        expose(self, p_path="tmem", qk_mma=(qk_mma, self.qk_tiler), pv_mma=(pv_mma, self.pv_tiler),  # inspect
               smem={"Q": q_smem, "K": k_smem, "V": v_smem, "P (A layout)": p_layout},
               tmem=tmem_plan, tmem_pair=(s_load, cS, p_store, cP))
        check_same_fragment_coords(o_load, cO, o_store, cO, "O rescale")  # trace time

        gO = cute.flat_divide(mO, cute.select(self.pv_tiler, mode=[0, 1]))[None, None, 0, 0, 0]  # (128, hd)
        tOgO = pv_thr.partition_C(gO)

        n_tiles = self.n_tiles
        num_kb_qk = cute.size(tSrQ, mode=[2])
        num_kb_pv = cute.size(tOrV, mode=[2])

        # ======================= TMA load warp =======================
        if warp_idx == self.LOAD_WARP:
            q_slot = q_prod.acquire_and_advance()
            cute.copy(tma_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_slot.barrier)
            for j in cutlass.range(n_tiles, unroll=1):
                k_slot = k_prod.acquire_and_advance()
                cute.copy(tma_k, tKgK[None, j], tKsK[None, k_slot.index], tma_bar_ptr=k_slot.barrier)
                v_slot = v_prod.acquire_and_advance()
                cute.copy(tma_v, tVgV[None, j], tVsV[None, v_slot.index], tma_bar_ptr=v_slot.barrier)
            # Wait for the MMA warp's last releases so no arrive lands after exit.
            q_prod.tail()
            k_prod.tail()
            v_prod.tail()

        # ======================= MMA warp =======================
        if warp_idx == self.MMA_WARP:
            q_full = q_cons.wait_and_advance()
            for j in cutlass.range(n_tiles, unroll=1):
                # S = Q · K_jᵀ; the S buffer (holding P_{j-1}) is free only once PV_{j-1} completed.
                k_full = k_cons.wait_and_advance()
                s_free = s_prod.acquire_and_advance()
                tcgen05_fence_after_sync()
                for kb in cutlass.range_constexpr(num_kb_qk):
                    qk_mma.set(tcgen05.Field.ACCUMULATE, kb != 0)
                    cute.gemm(qk_mma, tStS, tSrQ[None, None, kb, 0], tSrK[None, None, kb, k_full.index], tStS)
                s_free.commit()  # tcgen05.commit → S_j ready for the softmax warps
                k_full.release()  # tcgen05.commit → K slot free once read
                # O += P_j · V_j, P_j read from TMEM.
                v_full = v_cons.wait_and_advance()
                p_full = p_cons.wait_and_advance()
                tcgen05_fence_after_sync()
                for kb in cutlass.range_constexpr(num_kb_pv):
                    if cutlass.const_expr(kb == 0):
                        pv_mma.set(tcgen05.Field.ACCUMULATE, j != 0)
                    else:
                        pv_mma.set(tcgen05.Field.ACCUMULATE, True)
                    cute.gemm(pv_mma, tOtO, tOrP[None, None, kb], tOrV[None, None, kb, v_full.index], tOtO)
                p_full.release()  # tcgen05.commit → P slot free = PV_j complete
                v_full.release()
            o_slot = o_prod.acquire_and_advance()
            o_slot.commit()  # tcgen05.commit → every MMA done, O final
            q_full.release()

        # ======================= softmax warpgroup =======================
        if warp_idx < self.MMA_WARP:
            thr_s = s_load.get_slice(tidx)
            thr_p = p_store.get_slice(tidx)
            thr_o = o_load.get_slice(tidx)
            thr_o_st = o_store.get_slice(tidx)
            tTR_tS = thr_s.partition_S(tStS)  # this thread's row of S in TMEM
            tRT_tP = thr_p.partition_D(tOrP)  # this thread's row of P in TMEM
            tTR_tO = thr_o.partition_S(tOtO)  # this thread's row of O in TMEM (load)
            tRT_tO = thr_o_st.partition_D(tOtO)  # the same row of O (store)
            tTR_gO = thr_o.partition_D(tOgO)  # this thread's row of O in global memory
            tTR_cO = thr_o.partition_D(cO)  # its (row, d) coordinates
            rS = cute.make_rmem_tensor(thr_s.partition_D(cS).shape, F32)
            rP = cute.make_rmem_tensor(thr_p.partition_S(cP).shape, BF16)
            rP_as_s = cute.make_tensor(rP.iterator, rS.layout)  # same registers, S's indexing
            rO = cute.make_rmem_tensor(tTR_cO.shape, F32)
            rO_out = cute.make_rmem_tensor(tTR_cO.shape, BF16)
            o_chunks = cute.size(tTR_cO, mode=[1])  # tcgen05.ld/st of 32 columns each
            rO_chunk = cute.make_rmem_tensor(tTR_cO[None, 0, None, None].shape, F32)
            row = tTR_cO[0][0]  # the query row this thread owns

            c = F32(self.scale_log2)
            row_max = F32(-math.inf)  # m_{j-1}, raw-score units
            row_sum = F32(0.0)  # l_{j-1}
            for j in cutlass.range(n_tiles, unroll=1):
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
                        for ch in cutlass.range_constexpr(o_chunks):  # 32 columns at a time
                            cute.copy(o_load, tTR_tO[None, ch, None, None], rO_chunk)
                            cute.arch.fence_view_async_tmem_load()
                            rO_chunk.store(rO_chunk.load() * alpha)
                            cute.copy(o_store, rO_chunk, tRT_tO[None, ch, None, None])
                cute.arch.fence_view_async_tmem_store()  # tcgen05.wait::st: P and O in TMEM
                tcgen05_fence_before_sync()
                p_slot.commit()  # 128 arrivals → the MMA warp may run PV_j
                row_max = new_max
                # P_j sits in S_j's columns: hand S back for QK_{j+1} only once
                # PV_j has read P_j (the P slot's "free" is a tcgen05.commit after PV_j).
                p_prod.acquire()
                tcgen05_fence_before_sync()
                s_full.release()

            # Epilogue: O row / l → bf16 → global; LSE (natural log).
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

            # All four warps are done with TMEM before warp 0 frees it.
            tmem_free(tmem_alloc, tmem_ptr, tmem_cols, softmax_sync)
