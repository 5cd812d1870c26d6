"""Stage I2 on Blackwell (sm_100a): the lightning indexer's FP8 MQA logits over a paged cache.
Compile-only here (no Blackwell GPU): compiled, not run.

Math: as the sm90 kernel (oracles/indexer.py): logits[i·next_n + t, j] = k_scale[j] ·
Σ_h w · relu(q[i, t, h] · k[j]) for j ≤ context_lens[i] − next_n + t, −inf elsewhere; key j of
sequence i is slot j % 64 of block block_table[i, j // 64] of the fused cache.

What is new beside I1's sm100 kernel
    M = 128 keys = two cache blocks.  Each block is its own TMA box (64 keys × 128 bytes, the
        block found through the table) into one half of the tcgen05 A operand's slot; the two
        boxes complete one barrier.  The half-slot view and the MMA's A layout are built from
        the same 128-byte-swizzle atom; `check_half_slots` proves at trace time that they
        address the same bytes.
    N = next_n · 64 (one sequence's tokens), two TMEM accumulator buffers (≤ 512 columns,
        checked at trace time).
    Epilogue thread t ↔ key t of the tile: the scale is read through the table (block
        2k + t // 64, slot t % 64); the causal select keeps NaN keys out.
    Grid (key chunks, b) as on sm90; the fill warps write −inf past the computed tiles.

Warp roles (256 threads): warps 0-3 epilogue, warp 4 MMA, warp 5 load, warps 6-7 fill.
Limits: block_kv = 64, h = 64, d = 128, next_n ∈ {1, 2, 3, 4}; static shapes.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import tcgen05
from cutlass.utils.tmem_allocator import TmemAllocator

from stages.common.indexer import check_row_per_thread, fill_neg_inf, tmem_budget
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
from stages.common.tma import prefetch_descriptors, sm90_tma_load, sm100_tma_load, tma_partition_tile

HEADS = 64
DIM = 128
F32 = cutlass.Float32


def check_half_slots(k_smem, half_smem, rows: int, half: int, stages: int) -> None:
    """Trace-time proof that key m, column c of the MMA's A slot s (k_smem: ((rows, 32), 1,
    d/32, stages)) is the same byte as key m % half, column c of half-slot 2s + m // half
    (half_smem: (half, d, 2 · stages)).  Sampled: every swizzle row, the half boundary, the
    column chunk boundaries, the first and last slot."""
    keys = sorted({*range(9), half - 1, half, half + 1, half + 8, rows - 1})
    cols = (0, 1, 15, 16, 31, 32, 63, 64, 127)
    for s in sorted({0, stages - 1}):
        for m in keys:
            for c in cols:
                a = k_smem(((m, c % 32), 0, c // 32, s))
                b = half_smem((m % half, c, 2 * s + m // half))
                if a != b:
                    raise ValueError(f"stage I2 sm100: A slot {s} (key {m}, col {c}) is byte {a}, its half-slot "
                                     f"view says {b}: a block's TMA box would land in the wrong rows")


class Kernel:
    """Paged FP8 MQA logits on Blackwell tensor cores: two cache blocks (128 keys) × next_n · 64
    heads per MMA, one epilogue thread per key, −inf written by the kernel."""

    BLOCK_KV = 64
    BLOCK_K = 128  # keys per tile = M = two cache blocks
    MMA_K = 32
    EPI_COLS = 32
    ACC_STAGES = 2
    STAGES = 4
    CHUNK_TILES = 16
    EPI_WARPS = (0, 1, 2, 3)
    EPI_THREADS = 128
    MMA_WARP = 4
    LOAD_WARP = 5
    FILL_WARPS = (6, 7)
    FILL_THREADS = 64
    THREADS = 256
    _TMEM_ALLOC_BAR = 1
    _EPI_BAR = 2

    def __init__(self, *, b: int, next_n: int, block_kv: int):
        if block_kv != self.BLOCK_KV:
            raise ValueError(f"stage I2 sm100: block_kv must be {self.BLOCK_KV}, got {block_kv}")
        if next_n not in (1, 2, 3, 4):
            raise ValueError(f"stage I2 sm100: next_n must be 1 … 4 (N = next_n · 64 ≤ 256), got {next_n}")
        self.b, self.next_n = b, next_n
        self.n = HEADS * next_n
        self.mma_tiler = (self.BLOCK_K, self.n, DIM)

    @cute.jit
    def __call__(
        self,
        q: cute.Tensor,
        kv_cache: cute.Tensor,
        context_lens: cute.Tensor,
        block_table: cute.Tensor,
        weights: cute.Tensor,
        logits: cute.Tensor,
        stream: cuda.CUstream,
    ):
        b, n, bkv = self.b, self.n, self.BLOCK_KV
        dtype = q.element_type
        num_blocks = kv_cache.shape[0]
        block_bytes = bkv * (DIM + 4)
        self.max_len = logits.shape[1]
        chunk_keys = self.CHUNK_TILES * self.BLOCK_K
        self.num_chunks = (self.max_len + chunk_keys - 1) // chunk_keys

        mQ = cute.make_tensor(q.iterator, cute.make_layout((b * n, DIM), stride=(DIM, 1)))
        mKV = cute.make_tensor(
            cute.recast_ptr(kv_cache.iterator, dtype=dtype),
            cute.make_layout((bkv, DIM, num_blocks), stride=(DIM, 1, block_bytes)),
        )
        mScale = cute.make_tensor(
            cute.recast_ptr(kv_cache.iterator + bkv * DIM, dtype=F32),
            cute.make_layout((bkv, num_blocks), stride=(1, block_bytes // 4)),
        )
        mma = cute.make_tiled_mma(tcgen05.MmaF8F6F4Op(
            dtype, dtype, F32, (self.BLOCK_K, n, self.MMA_K), tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM,
            tcgen05.OperandMajorMode.K,  # two cache blocks [128 keys, d] (A, M = keys)
            tcgen05.OperandMajorMode.K,  # Q [next_n · heads, d] (B, N = heads)
        ))
        k_smem = sm100_utils.make_smem_layout_a(mma, self.mma_tiler, dtype, self.STAGES)
        half_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (bkv, n, DIM), dtype, 2 * self.STAGES)
        check_half_slots(k_smem, half_smem, self.BLOCK_K, bkv, self.STAGES)
        q_smem = sm100_utils.make_smem_layout_b(mma, self.mma_tiler, dtype, 1)
        expose(self, qk_mma=(mma, self.mma_tiler), smem={"K": k_smem, "K half-slots": half_smem, "Q": q_smem})
        tma_k, tma_K, box = sm90_tma_load(mKV, half_smem, (bkv, DIM))  # one cache block per box
        self.k_bytes = 2 * box
        tma_q, tma_Q, self.q_bytes = sm100_tma_load("B", mma, mQ, q_smem, self.mma_tiler)

        acc = mma.make_fragment_C(mma.partition_shape_C(self.mma_tiler[:2]))
        self.acc_cols = tcgen05.find_tmem_tensor_col_offset(acc)
        self.tmem_cols = tmem_budget(self.ACC_STAGES, self.acc_cols, "stage I2 sm100")

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
        self.kernel(
            mma, tma_q, tma_Q, tma_k, tma_K, mScale, context_lens, block_table, weights, logits,
            q_smem, k_smem, half_smem,
        ).launch(grid=(self.num_chunks, b, 1), block=(self.THREADS, 1, 1), smem=Smem.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(
        self,
        mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mKV: cute.Tensor,
        mScale: cute.Tensor,
        mLens: cute.Tensor,
        mTable: cute.Tensor,
        mW: cute.Tensor,
        mOut: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        half_smem: cute.ComposedLayout,
    ):
        nn, bk, bkv = self.next_n, self.BLOCK_K, self.BLOCK_KV
        tidx, _, _ = cute.arch.thread_idx()
        chunk, seq, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_k)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # the MMA's view
        sK_half = storage.sK.get_tensor(half_smem.outer, swizzle=half_smem.inner)  # the TMA's view (same bytes)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
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

        thr_mma = mma.get_slice(0)
        tCrK = mma.make_fragment_A(sK)
        tCrQ = mma.make_fragment_B(sQ)
        gQ = cute.local_tile(mQ, self.mma_tiler, (0, None, 0), proj=(None, 1, 1))  # (n, d, b)
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, thr_mma.partition_B(gQ), 3)
        gKV = cute.local_tile(mKV, (bkv, DIM), (0, 0, None))  # (64, d, num_blocks)
        tKsK, tKgK = tma_partition_tile(tma_k, sK_half, gKV, 2)

        tmem_ptr = tmem_allocate(tmem_alloc, self.tmem_cols)
        acc_layout = mma.make_fragment_C(mma.partition_shape_C(self.mma_tiler[:2])).layout

        ctx = cutlass.min(cutlass.max(mLens[seq], cutlass.Int32(0)), cutlass.Int32(self.max_len))
        last_block = cutlass.max((ctx + bkv - 1) // bkv - 1, cutlass.Int32(0))
        tile_begin = chunk * self.CHUNK_TILES
        tile_end = cutlass.max(cutlass.min(tile_begin + self.CHUNK_TILES, (ctx + bk - 1) // bk), tile_begin)

        if warp_idx == self.LOAD_WARP:
            self.load_role(seq, last_block, tile_begin, tile_end, q_prod, k_prod, tma_q, tQgQ, tQsQ, tma_k, tKgK, tKsK,
                           mTable)
        if warp_idx == self.MMA_WARP:
            self.mma_role(tile_begin, tile_end, q_cons, k_cons, acc_prod, mma, tCrK, tCrQ, tmem_ptr, acc_layout)
        if warp_idx >= self.FILL_WARPS[0]:
            chunk_end = cutlass.min((chunk + 1) * self.CHUNK_TILES * bk, cutlass.Int32(self.max_len))
            ftid = tidx - 32 * self.FILL_WARPS[0]
            for t in cutlass.range_constexpr(nn):
                fill_neg_inf(mOut, seq * nn + t, tile_end * bk, chunk_end, ftid, self.FILL_THREADS)
        if warp_idx <= self.EPI_WARPS[-1]:
            self.epilogue(seq, ctx, last_block, tidx, tile_begin, tile_end, acc_cons, mma, tmem_ptr, acc_layout,
                          sW, mW, mScale, mTable, mOut, epi_sync)
            tcgen05_fence_before_sync()
            tmem_free(tmem_alloc, tmem_ptr, self.tmem_cols, epi_sync)

    @cute.jit
    def load_role(self, seq, last_block, tile_begin, tile_end, q_prod, k_prod, tma_q, tQgQ, tQsQ, tma_k, tKgK, tKsK,
                  mTable):
        """Warp 5: the sequence's Q once, then per tile its two cache blocks (through the table,
        clamped to the sequence's last block), one TMA box into each half of the slot."""
        if tile_end > tile_begin:
            q_slot = q_prod.acquire_and_advance()
            cute.copy(tma_q, tQgQ[(None, seq)], tQsQ[(None, 0)], tma_bar_ptr=q_slot.barrier)
        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            k_slot = k_prod.acquire_and_advance()
            for w in cutlass.range_constexpr(2):
                phys = mTable[seq, cutlass.min(tile * 2 + w, last_block)]
                cute.copy(tma_k, tKgK[(None, phys)], tKsK[(None, k_slot.index * 2 + w)], tma_bar_ptr=k_slot.barrier)
        k_prod.tail()

    @cute.jit
    def mma_role(self, tile_begin, tile_end, q_cons, k_cons, acc_prod, mma, tCrK, tCrQ, tmem_ptr, acc_layout):
        """Warp 4: per tile, an empty accumulator buffer, the two blocks' slot, four MMAs."""
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
            full.release()
            slot.commit()

    @cute.jit
    def epilogue(self, seq, ctx, last_block, tidx, tile_begin, tile_end, acc_cons, mma, tmem_ptr, acc_layout,
                 sW, mW, mScale, mTable, mOut, epi_sync):
        """Warps 0-3: thread t owns key t of each tile (block 2k + t // 64, slot t % 64): relu · w
        summed per token, × the key's scale, −inf past each token's causal limit, stored."""
        nn, bk, bkv, n, cols = self.next_n, self.BLOCK_K, self.BLOCK_KV, self.n, self.EPI_COLS
        for c in cutlass.range_constexpr((n + self.EPI_THREADS - 1) // self.EPI_THREADS):
            col = c * self.EPI_THREADS + tidx
            if col < n:
                sW[col] = mW[seq * nn + col // HEADS, col % HEADS]
        epi_sync.arrive_and_wait()

        acc0 = cute.make_tensor(tmem_ptr, acc_layout)
        epi_tiler = ((bk, cols),)
        acc0_epi = cute.zipped_divide(acc0, epi_tiler)
        t2r = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, acc0_epi[(None, 0)])
        ident = cute.zipped_divide(mma.get_slice(0).partition_C(cute.make_identity_tensor((bk, n))), epi_tiler)
        check_row_per_thread(t2r, ident, bk, cols)
        thr = t2r.get_slice(tidx)
        r = cute.make_rmem_tensor(thr.partition_D(ident[(None, 0)]).shape, F32)
        chunks = n // cols
        per_token = chunks // nn
        sums = cute.make_rmem_tensor(nn, F32)
        first_pos = ctx - nn
        slot_in_block = tidx % bkv

        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            full = acc_cons.wait_and_advance()
            tcgen05_fence_after_sync()
            acc_epi = cute.zipped_divide(cute.make_tensor(tmem_ptr + full.index * self.acc_cols, acc_layout), epi_tiler)
            sums.fill(0.0)
            for c in cutlass.range_constexpr(chunks):
                cute.copy(t2r, thr.partition_S(acc_epi[(None, c)]), r)
                cute.arch.fence_view_async_tmem_load()
                part = F32(0.0)
                for j in cutlass.range_constexpr(cols):
                    part += cute.arch.fmax(r[j], F32(0.0)) * sW[c * cols + j]
                sums[c // per_token] = sums[c // per_token] + part
            tcgen05_fence_before_sync()
            full.release()
            key = tile * bk + tidx
            phys = mTable[seq, cutlass.min(tile * 2 + tidx // bkv, last_block)]
            scale = mScale[slot_in_block, phys]
            if key < self.max_len:
                for t in cutlass.range_constexpr(nn):
                    mOut[seq * nn + t, key] = F32(cutlass.select_(key <= first_pos + t, sums[t] * scale, -F32.inf))
