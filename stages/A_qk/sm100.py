"""Stage A on Blackwell (sm_100a): S = Q · Kᵀ with tcgen05.mma (UMMA), TMA and TMEM.

Math
    S[i, j] = Σ_d Q[i, d] · K[j, d]        i < m = 128, j < n, d < hd
    bf16 inputs, fp32 accumulation, fp32 output, no scale.

Tiling: one CTA of 128 threads, one UMMA tile M = 128, N = n; hd in K-blocks of 64 bf16 (one
128-byte swizzle row), each four tcgen05.mma of K = 16.  Warp 0 is TMA producer and MMA issuer:
per K-block Q and K (K-major) into one of `stages` slots (a transaction-counted full barrier),
released by tcgen05.commit after the K-block's MMAs.  The fp32 accumulator lives in TMEM (128 ×
n, warp 0 allocates and frees); a commit after the last MMA arrives on the accumulator barrier
(128 consumer threads).  Epilogue: each thread reads its TMEM row 32 columns a
tcgen05.ld.32x32b.x32 and stores it.  Ordering: fence::after_thread_sync after the accumulator
wait, wait::ld before the stores, a before/after_thread_sync pair around the dealloc barrier."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import tcgen05
from cutlass.memory import TmemAllocator, get_num_tmem_alloc_cols

from stages.common import hang_guard
from stages.common.barriers import NamedBarrier
from stages.common.inspection import expose
from stages.common.sm100_idioms import (
    tcgen05_fence_after_sync,
    tcgen05_fence_before_sync,
    tma_umma_pipeline,
    tmem_free,
    umma_to_threads_pipeline,
)
from stages.common.tma import prefetch_descriptors, sm100_tma_load, tma_partition_tile


class Kernel:
    """S[m, n] (fp32) = Q[m, hd] · K[n, hd]ᵀ (bf16) with tcgen05.mma, TMA and TMEM.
        Limits: m == 128, n ∈ {128, 256}, hd ∈ {64, 128, 256, 512}; row-major, 16-byte aligned."""

    BLOCK_K = 64  # head-dim elements per K-block (128 bytes of bf16)
    MMA_K = 16  # K of one bf16 tcgen05.mma
    EPI_COLS = 32  # accumulator columns per tcgen05.ld (32x32b.x32)
    MAX_STAGES = 3  # shared slots; one slot is (128 + n) × 64 × 2 bytes ≤ 48 KiB
    THREADS = 128

    def __init__(self, *, m: int, n: int, hd: int):
        if m != 128:
            raise ValueError(f"stage A sm100: m must be 128, got {m}")
        if n not in (128, 256):
            raise ValueError(f"stage A sm100: n must be 128 or 256, got {n}")
        if hd not in (64, 128, 256, 512):
            raise ValueError(f"stage A sm100: hd must be 64, 128, 256 or 512, got {hd}")
        self.m, self.n, self.hd = m, n, hd
        self.num_k_blocks = hd // self.BLOCK_K
        self.stages = min(self.num_k_blocks, self.MAX_STAGES)
        self.mma_tiler = (m, n, self.BLOCK_K)

    @cute.jit
    def __call__(self, Q: cute.Tensor, K: cute.Tensor, S: cute.Tensor, stream: cuda.CUstream):
        ab_dtype = Q.element_type
        # Row-major Q [m, hd] and K [n, hd]: both UMMA operands are K-major.
        mma_op = tcgen05.MmaF16BF16Op(
            ab_dtype,
            cutlass.Float32,
            (self.m, self.n, self.MMA_K),
            tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM,
            tcgen05.OperandMajorMode.K,
            tcgen05.OperandMajorMode.K,
        )
        tiled_mma = cute.make_tiled_mma(mma_op)

        q_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, ab_dtype, self.stages)
        k_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, ab_dtype, self.stages)
        expose(self, qk_mma=(tiled_mma, self.mma_tiler), smem={"Q": q_smem, "K": k_smem})  # dsv4-lab inspect
        tma_q, tma_Q, q_bytes = sm100_tma_load("A", tiled_mma, Q, q_smem, self.mma_tiler)
        tma_k, tma_K, k_bytes = sm100_tma_load("B", tiled_mma, K, k_smem, self.mma_tiler)

        self.tx_bytes = q_bytes + k_bytes  # what one stage's two TMA loads deposit on its full barrier
        # TMEM columns for the (128 × n) fp32 accumulator, read off its layout.
        acc_fake = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2]))
        self.tmem_cols = get_num_tmem_alloc_cols(acc_fake)

        @cute.struct
        class Smem:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_addr: cutlass.Int32
            sQ: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(q_smem.outer)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(k_smem.outer)], 1024]

        self.smem_struct = Smem

        self.kernel(tiled_mma, tma_q, tma_Q, tma_k, tma_K, S, q_smem, k_smem).launch(
            grid=(1, 1, 1),
            block=(self.THREADS, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        mS: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if warp_idx == 0:
            prefetch_descriptors(tma_q, tma_k)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (MMA, MMA_M, MMA_K, stages)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (MMA, MMA_N, MMA_K, stages)

        # Operand pipeline: TMA (one elected thread + tx bytes) → UMMA (one
        # tcgen05.commit per release).
        ab_prod, ab_cons = tma_umma_pipeline(storage.ab_mbar, self.stages, self.tx_bytes, name="ab")
        # Accumulator pipeline: UMMA commit → all 128 epilogue THREADS.
        acc_prod, acc_cons = umma_to_threads_pipeline(storage.acc_mbar, self.THREADS, name="acc")

        # TMEM: warp 0 allocates, everyone reads the base address after TMEM_ALLOC.
        tmem = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_ALLOC), num_threads=self.THREADS),
        )
        tmem.allocate(self.tmem_cols)

        # Global tiles: Q (128, 64, num_k_blocks), K (n, 64, num_k_blocks), S (128, n).
        tile_crd = (0, 0, None)
        gQ = cute.local_tile(mQ, self.mma_tiler, tile_crd, proj=(1, None, 1))
        gK = cute.local_tile(mK, self.mma_tiler, tile_crd, proj=(None, 1, 1))
        gS = cute.local_tile(mS, self.mma_tiler, tile_crd, proj=(1, 1, None))

        thr_mma = tiled_mma.get_slice(0)
        tCgQ = thr_mma.partition_A(gQ)  # (MMA, MMA_M, MMA_K, num_k_blocks)
        tCgK = thr_mma.partition_B(gK)  # (MMA, MMA_N, MMA_K, num_k_blocks)
        tCgS = thr_mma.partition_C(gS)  # (MMA, MMA_M, MMA_N)
        tCrQ = tiled_mma.make_fragment_A(sQ)  # smem descriptors
        tCrK = tiled_mma.make_fragment_B(sK)

        # TMA partitions: one copy moves one K-block of Q (or K).
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, tCgQ, 3)
        tKsK, tKgK = tma_partition_tile(tma_k, sK, tCgK, 3)

        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(cutlass.Float32)
        acc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout
        tCtAcc = cute.make_tensor(tmem_ptr, acc_layout)  # (MMA, MMA_M, MMA_N) in TMEM

        if warp_idx == 0:
            self.mainloop(ab_prod, ab_cons, acc_prod, tiled_mma, tma_q, tQgQ, tQsQ, tma_k, tKgK, tKsK,
                          tCrQ, tCrK, tCtAcc)
        tmem.relinquish_alloc_permit()
        self.epilogue(acc_cons, tCtAcc, tCgS, tidx)

        # Everyone is done with TMEM: warp 0 frees it.
        tcgen05_fence_before_sync()
        tmem_free(tmem, tmem_ptr, self.tmem_cols,
                  pipeline.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_FREE), num_threads=self.THREADS))

    @cute.jit
    def mainloop(self, ab_prod, ab_cons, acc_prod, tiled_mma, tma_q, tQgQ, tQsQ, tma_k, tKgK, tKsK, tCrQ, tCrK,
                 tCtAcc):
        """Warp 0: TMA loads and MMAs, unrolled over ≤ 8 K-blocks; `stages` slots in flight."""
        hang_guard.role("load+mma")  # names this role's waits in a --debug-hangs build
        tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
        mma_k_steps = cute.size(tCrQ, mode=[2])
        acc_slot = acc_prod.acquire_and_advance()
        for _ in cutlass.range_constexpr(self.stages):
            h = ab_prod.acquire_and_advance()
            cute.copy(tma_q, tQgQ[(None, h.count)], tQsQ[(None, h.index)], tma_bar_ptr=h.barrier)
            cute.copy(tma_k, tKgK[(None, h.count)], tKsK[(None, h.index)], tma_bar_ptr=h.barrier)
        for kb in cutlass.range_constexpr(self.num_k_blocks):
            full = ab_cons.wait_and_advance()
            for kk in cutlass.range_constexpr(mma_k_steps):
                crd = (None, None, kk, full.index)
                cute.gemm(tiled_mma, tCtAcc, tCrQ[crd], tCrK[crd], tCtAcc)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            full.release()  # tcgen05.commit → slot empty once these MMAs have read it
            if kb + self.stages < self.num_k_blocks:
                h = ab_prod.acquire_and_advance()
                cute.copy(tma_q, tQgQ[(None, h.count)], tQsQ[(None, h.index)], tma_bar_ptr=h.barrier)
                cute.copy(tma_k, tKgK[(None, h.count)], tKsK[(None, h.index)], tma_bar_ptr=h.barrier)
        acc_slot.commit()  # tcgen05.commit → accumulator complete
        ab_prod.tail()  # wait until every slot's last empty-arrival has landed

    @cute.jit
    def epilogue(self, acc_cons, tCtAcc, tCgS, tidx):
        """All 4 warps: TMEM → registers → global, 32 columns at a time (warp w owns
        TMEM lanes 32w … 32w + 31 = rows of S)."""
        hang_guard.role("epilogue")  # names this role's waits in a --debug-hangs build
        epi_tiler = ((cute.size(tCtAcc, mode=[0, 0]), self.EPI_COLS),)
        tAcc_epi = cute.zipped_divide(tCtAcc, epi_tiler)  # ((128, 32), n / 32)
        gS_epi = cute.zipped_divide(tCgS, epi_tiler)
        t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), cutlass.Float32),
            tAcc_epi[(None, 0)],
        )
        thr_t2r = t2r.get_slice(tidx)
        tTRtAcc = thr_t2r.partition_S(tAcc_epi)  # (T2R, T2R_M, n / 32)
        tTRgS = thr_t2r.partition_D(gS_epi)  # (T2R, T2R_M, n / 32)
        tTRrAcc = cute.make_rmem_tensor(tTRgS[(None, None, 0)].shape, cutlass.Float32)

        acc_full = acc_cons.wait_and_advance()
        tcgen05_fence_after_sync()  # the MMAs' TMEM writes are visible to tcgen05.ld
        for c in cutlass.range_constexpr(cute.size(tTRtAcc, mode=[2])):
            cute.copy(t2r, tTRtAcc[(None, None, c)], tTRrAcc)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: registers valid
            cute.autovec_copy(tTRrAcc, tTRgS[(None, None, c)])
        acc_full.release()
