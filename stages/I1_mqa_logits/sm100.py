"""Stage I1 on Blackwell (sm_100a): the lightning indexer's FP8 MQA logits, flat.  Compile-only
here (no Blackwell GPU): compiled, not run.

Math: as the sm90 kernel (oracles/indexer.py), logits[i, j] = k_scale[j] · Σ_h w[i, h] ·
relu(q[i, h] · k[j]) inside [ks[i], ke[i]), −inf elsewhere.

The MMA: tcgen05.mma kind::f8f6f4, Sᵀ = K_tile · Q_blockᵀ, M = 128 keys, N = BLOCK_Q · 64 =
256 (4 query tokens × 64 heads), K = d = 128 (four k32 steps), both operands K-major from
shared memory, the fp32 accumulator in tensor memory (TMEM).

One thread per key: TMEM lane r holds key r of the tile, so the epilogue thread r reads its
whole row (tcgen05.ld 32x32b, 32 columns at a time) and the head sum is thread-local — no
shuffles (sm90 needs a quad butterfly).  Its stores are coalesced: consecutive threads write
consecutive keys of a token's row.  The weights sit in shared memory (read as broadcasts).

TMEM budget (checked at trace time): two accumulator buffers × 256 fp32 columns = 512
columns = all of TMEM, so the MMA of tile k + 1 overlaps the epilogue of tile k.

Warp roles (256 threads)
    warps 0-3   epilogue: TMEM → registers, relu · w, head sums, × k_scale, range select,
                store (thread t ↔ TMEM lane t ↔ key t of the tile)
    warp 4      MMA: per tile, one accumulator buffer, four tcgen05.mma, commit
    warp 5      load: Q's token block once, then the K tiles (TMA, STAGES slots)
    warps 6-7   fill: −inf outside the CTA's tile range

Limits: s a multiple of BLOCK_Q, s_kv a multiple of 128; h = 64, d = 128; static shapes.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import tcgen05
from cutlass.utils.tmem_allocator import TmemAllocator

from stages.common.indexer import check_row_per_thread, fill_neg_inf, key_tile_range, tmem_budget
from stages.common.inspection import expose
from stages.common.sm100_idioms import (
    tcgen05_fence_after_sync,
    tcgen05_fence_before_sync,
    tma_umma_pipeline,
    tmem_allocate,
    tmem_copy,
    tmem_free,
    umma_to_threads_pipeline,
)
from stages.common.tma import prefetch_descriptors, sm100_tma_load, tma_partition_tile

HEADS = 64
DIM = 128
F32 = cutlass.Float32


class Kernel:
    """FP8 MQA logits on Blackwell tensor cores (tcgen05, TMEM accumulators): 4 query tokens ×
    128-key tiles per MMA, one thread per key in the epilogue, −inf written by the kernel."""

    BLOCK_Q = 4  # query tokens per CTA: N = 256
    BLOCK_K = 128  # keys per tile = M
    MMA_K = 32  # K of one kind::f8f6f4 MMA
    EPI_COLS = 32  # accumulator columns per tcgen05.ld (32x32b.x32)
    ACC_STAGES = 2
    STAGES = 4  # K slots of 16 KiB
    EPI_WARPS = (0, 1, 2, 3)
    EPI_THREADS = 128
    MMA_WARP = 4
    LOAD_WARP = 5
    FILL_WARPS = (6, 7)
    FILL_THREADS = 64
    THREADS = 256
    _TMEM_ALLOC_BAR = 1
    _EPI_BAR = 2

    def __init__(self, *, s: int, s_kv: int):
        if s % self.BLOCK_Q:
            raise ValueError(f"stage I1 sm100: s must be a multiple of {self.BLOCK_Q}, got {s}")
        if s_kv % self.BLOCK_K or s_kv <= 0:
            raise ValueError(f"stage I1 sm100: s_kv must be a positive multiple of {self.BLOCK_K}, got {s_kv}")
        self.s, self.s_kv = s, s_kv
        self.n = HEADS * self.BLOCK_Q
        self.mma_tiler = (self.BLOCK_K, self.n, DIM)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        kv: cute.Tensor,
        kv_scale: cute.Tensor,
        weights: cute.Tensor,
        ks: cute.Tensor,
        ke: cute.Tensor,
        logits: cute.Tensor,
        stream: cuda.CUstream,
    ):
        s, n = self.s, self.n
        dtype = q.element_type
        mQ = cute.make_tensor(q.iterator, cute.make_layout((s * HEADS, DIM), stride=(DIM, 1)))
        mma_op = tcgen05.MmaF8F6F4Op(
            dtype, kv.element_type, F32, (self.BLOCK_K, n, self.MMA_K), tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM,
            tcgen05.OperandMajorMode.K,  # K tile [keys, d]: d contiguous (A, M = keys)
            tcgen05.OperandMajorMode.K,  # Q block [tokens · heads, d]: d contiguous (B, N = heads)
        )
        mma = cute.make_tiled_mma(mma_op)
        k_smem = sm100_utils.make_smem_layout_a(mma, self.mma_tiler, dtype, self.STAGES)
        q_smem = sm100_utils.make_smem_layout_b(mma, self.mma_tiler, dtype, 1)
        expose(self, qk_mma=(mma, self.mma_tiler), smem={"K": k_smem, "Q": q_smem})  # dsv4-lab inspect
        tma_k, tma_K, self.k_bytes = sm100_tma_load("A", mma, kv, k_smem, self.mma_tiler)
        tma_q, tma_Q, self.q_bytes = sm100_tma_load("B", mma, mQ, q_smem, self.mma_tiler)

        # TMEM budget, from the accumulator's own layout.
        acc = mma.make_fragment_C(mma.partition_shape_C(self.mma_tiler[:2]))
        self.acc_cols = tcgen05.find_tmem_tensor_col_offset(acc)
        self.tmem_cols = tmem_budget(self.ACC_STAGES, self.acc_cols, "stage I1 sm100")

        @cute.struct
        class Smem:
            k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.STAGES]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.ACC_STAGES]
            tmem_addr: cutlass.Int32
            w: cute.struct.Align[cute.struct.MemRange[F32, n], 16]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem.outer)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem.outer)], 1024]

        self.smem_struct = Smem
        self.kernel(mma, tma_q, tma_Q, tma_k, tma_K, kv_scale, weights, ks, ke, logits, q_smem, k_smem).launch(
            grid=(s // self.BLOCK_Q, 1, 1), block=(self.THREADS, 1, 1), smem=Smem.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        mScale: cute.Tensor,
        mW: cute.Tensor,
        mKs: cute.Tensor,
        mKe: cute.Tensor,
        mOut: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
    ):
        bq, bk = self.BLOCK_Q, self.BLOCK_K
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_k)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (MMA, 1, d/32, stages)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (MMA, 1, d/32, 1)
        sW = storage.w.get_tensor(cute.make_layout(self.n))

        k_prod, k_cons = tma_umma_pipeline(storage.k_mbar, self.STAGES, self.k_bytes)
        q_prod, q_cons = tma_umma_pipeline(storage.q_mbar, 1, self.q_bytes)
        acc_prod, acc_cons = umma_to_threads_pipeline(storage.acc_mbar, self.EPI_THREADS, self.ACC_STAGES)
        tmem_alloc = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=self._TMEM_ALLOC_BAR, num_threads=self.THREADS),
            allocator_warp_id=self.EPI_WARPS[0],
        )
        epi_sync = pipeline.NamedBarrier(barrier_id=self._EPI_BAR, num_threads=self.EPI_THREADS)

        # MMA operands and TMA partitions (built by every thread, before any branch).
        thr_mma = mma.get_slice(0)
        tCrK = mma.make_fragment_A(sK)
        tCrQ = mma.make_fragment_B(sQ)
        gK = cute.local_tile(mK, self.mma_tiler, (None, 0, 0), proj=(1, None, 1))  # (128, d, tiles)
        gQ = cute.local_tile(mQ, self.mma_tiler, (0, None, 0), proj=(None, 1, 1))  # (n, d, token blocks)
        tKsK, tKgK = tma_partition_tile(tma_k, sK, thr_mma.partition_A(gK), 3)
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, thr_mma.partition_B(gQ), 3)

        tmem_ptr = tmem_allocate(tmem_alloc, self.tmem_cols)
        acc_layout = mma.make_fragment_C(mma.partition_shape_C(self.mma_tiler[:2])).layout  # one buffer
        tile_begin, tile_end = key_tile_range(mKs, mKe, block * bq, bq, self.s_kv, bk)

        if warp_idx == self.LOAD_WARP:
            self.load_role(block, tile_begin, tile_end, q_prod, k_prod, tma_q, tQgQ, tQsQ, tma_k, tKgK, tKsK)
        if warp_idx == self.MMA_WARP:
            self.mma_role(tile_begin, tile_end, q_cons, k_cons, acc_prod, mma, tCrK, tCrQ, tmem_ptr, acc_layout)
        if warp_idx >= self.FILL_WARPS[0]:
            ftid = tidx - 32 * self.FILL_WARPS[0]
            for t in cutlass.range_constexpr(bq):
                fill_neg_inf(mOut, block * bq + t, 0, tile_begin * bk, ftid, self.FILL_THREADS)
                fill_neg_inf(mOut, block * bq + t, tile_end * bk, self.s_kv, ftid, self.FILL_THREADS)
        if warp_idx <= self.EPI_WARPS[-1]:
            self.epilogue(block, tidx, tile_begin, tile_end, acc_cons, mma, tmem_ptr, acc_layout, sW, mW, mScale, mKs, mKe, mOut, epi_sync)
            tcgen05_fence_before_sync()
            tmem_free(tmem_alloc, tmem_ptr, self.tmem_cols, epi_sync)

    @cute.jit
    def load_role(self, block, tile_begin, tile_end, q_prod, k_prod, tma_q, tQgQ, tQsQ, tma_k, tKgK, tKsK):
        """Warp 5: the token block's Q once, then the K tiles of the range, one per slot."""
        if tile_end > tile_begin:
            q_slot = q_prod.acquire_and_advance()
            cute.copy(tma_q, tQgQ[(None, block)], tQsQ[(None, 0)], tma_bar_ptr=q_slot.barrier)
        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            k_slot = k_prod.acquire_and_advance()
            cute.copy(tma_k, tKgK[(None, tile)], tKsK[(None, k_slot.index)], tma_bar_ptr=k_slot.barrier)
        k_prod.tail()

    @cute.jit
    def mma_role(self, tile_begin, tile_end, q_cons, k_cons, acc_prod, mma, tCrK, tCrQ, tmem_ptr, acc_layout):
        """Warp 4: per tile, an empty accumulator buffer, the K tile, four MMAs (K = 32 each),
        then commit the buffer (full once the MMAs complete) and release the K slot."""
        if tile_end > tile_begin:
            q_cons.wait_and_advance()
        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            slot = acc_prod.acquire_and_advance()
            acc = cute.make_tensor(tmem_ptr + slot.index * self.acc_cols, acc_layout)
            full = k_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            for kk in cutlass.range_constexpr(cute.size(tCrK, mode=[2])):
                mma.set(tcgen05.Field.ACCUMULATE, kk != 0)
                cute.gemm(mma, acc, tCrK[None, None, kk, full.index], tCrQ[None, None, kk, 0], acc)
            full.release()  # tcgen05.commit: the K slot is free once these MMAs have read it
            slot.commit()  # tcgen05.commit: the accumulator is full once they complete

    @cute.jit
    def epilogue(self, block, tidx, tile_begin, tile_end, acc_cons, mma, tmem_ptr, acc_layout, sW, mW, mScale, mKs, mKe, mOut, epi_sync):
        """Warps 0-3: thread t owns key t of each tile: its accumulator row (all heads of the 4
        tokens) → relu · w summed per token → × k_scale → −inf outside the token's range →
        logits[token, key]."""
        bq, bk, n, cols = self.BLOCK_Q, self.BLOCK_K, self.n, self.EPI_COLS
        for c in cutlass.range_constexpr(n // self.EPI_THREADS):
            col = c * self.EPI_THREADS + tidx
            sW[col] = mW[block * bq + col // HEADS, col % HEADS]
        lo = cute.make_rmem_tensor(bq, cutlass.Int32)
        hi = cute.make_rmem_tensor(bq, cutlass.Int32)
        for t in cutlass.range_constexpr(bq):
            lo[t] = mKs[block * bq + t]
            hi[t] = mKe[block * bq + t]
        epi_sync.arrive_and_wait()  # the weights are in shared memory

        # The accumulator seen in 32-column chunks; thread t's tcgen05.ld fragment of chunk c is
        # row t, columns 32c … 32c + 31 (proved at trace time).
        acc0 = cute.make_tensor(tmem_ptr, acc_layout)
        epi_tiler = ((bk, cols),)
        acc0_epi = cute.zipped_divide(acc0, epi_tiler)  # ((128, 32), n / 32)
        t2r = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, acc0_epi[(None, 0)])
        ident = cute.zipped_divide(mma.get_slice(0).partition_C(cute.make_identity_tensor((bk, n))), epi_tiler)
        check_row_per_thread(t2r, ident, bk, cols)
        thr = t2r.get_slice(tidx)
        r = cute.make_rmem_tensor(thr.partition_D(ident[(None, 0)]).shape, F32)
        chunks = n // cols
        per_token = chunks // bq
        sums = cute.make_rmem_tensor(bq, F32)

        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            full = acc_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            acc_epi = cute.zipped_divide(cute.make_tensor(tmem_ptr + full.index * self.acc_cols, acc_layout),
                                         epi_tiler)
            sums.fill(0.0)
            for c in cutlass.range_constexpr(chunks):
                cute.copy(t2r, thr.partition_S(acc_epi[(None, c)]), r)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                part = F32(0.0)
                for j in cutlass.range_constexpr(cols):
                    part += cute.arch.fmax(r[j], F32(0.0)) * sW[c * cols + j]
                sums[c // per_token] = sums[c // per_token] + part
            tcgen05_fence_before_sync()
            full.release()  # the buffer may take the MMAs of tile + 2
            key = tile * bk + tidx
            scale = mScale[key]
            for t in cutlass.range_constexpr(bq):
                inside = (key >= lo[t]) & (key < hi[t])
                mOut[block * bq + t, key] = F32(cutlass.select_(inside, sums[t] * scale, -F32.inf))
