"""Stage I2 on Hopper (sm_90a): the lightning indexer's FP8 MQA logits over a paged cache.

Math (oracles/indexer.py; stage I1's, with keys from a paged, fused cache)
    logits[i·next_n + t, j] = k_scale[j] · Σ_h w[i·next_n + t, h] · relu(q[i, t, h] · k[j])
                              for j ≤ pos = context_lens[i] − next_n + t, −inf elsewhere.
    Key position j of sequence i is slot j % 64 of physical block block_table[i, j // 64]; a
    block of the fused cache [num_blocks, 64, 1, 132] bytes holds 64 · 128 e4m3 values
    (token-major), then 64 fp32 scales.

What is new beside I1
    The cache seen as two tensors over the same bytes: values (64, 128, num_blocks) e4m3 with
        a block stride of 64 · 132 bytes (a multiple of 16: one TMA box per block), and scales
        (64, num_blocks) fp32 starting 64 · 128 bytes into each block.
    One cache block per pipeline slot (one TMA box) and per MMA: M = the block's 64 keys,
        N = next_n · 64 heads; the two MMA warpgroups take alternate blocks (warpgroup w: the
        chunk's blocks w, w + 2, …), so one's epilogue overlaps the other's MMA (as I1).
    block_table lookup in the load warp (and for the scales, in the epilogue).  A table entry
        past the sequence's last block is never followed: the block index is clamped to the
        last one (its keys are then masked), so a garbage or out-of-range entry is harmless.
    Causal limit per token: the epilogue selects −inf past pos (by selection, so the NaN that
        a cache slot past the context may hold never reaches a logit).
    Split over keys: the grid is (chunks of CHUNK_TILES blocks, b); a CTA computes its chunk's
        blocks below the context length and the fill warps write −inf over the rest of the
        chunk (keys ≥ the blocks computed, up to max_len).  No combine: logits are per key.

Warp roles (384 threads): as I1 — warp 8 loads (Q block once, then one cache block per slot),
warps 9-11 fill −inf, warpgroups 0 and 1 run the MMA and the fused epilogue on alternate blocks.

Limits: block_kv = 64, h = 64, d = 128, next_n ∈ {1, 2, 3, 4}; static shapes.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from stages.common.indexer import check_token_columns, fill_neg_inf, head_sum
from stages.common.inspection import expose
from stages.common.sm90_idioms import acc_rows_cols, tma_pipeline, wgmma_sync
from stages.common.tma import prefetch_descriptors, sm90_tma_load, tma_partition_tile

HEADS = 64
DIM = 128


class Kernel:
    """Paged FP8 MQA logits on Hopper tensor cores: one sequence's next_n tokens × a chunk of
    its keys per CTA, one cache block per MMA (warpgroups alternate), −inf written by the kernel."""

    BLOCK_KV = 64  # keys per cache block = M of one warpgroup's MMA
    NUM_MMA_WG = 2
    BLOCK_K = BLOCK_KV  # keys per tile = one cache block = one pipeline slot
    CHUNK_TILES = 32  # tiles per CTA: 2048 keys
    LOAD_WG = 2
    LOAD_WARP = 4 * LOAD_WG
    MMA_THREADS = 128 * NUM_MMA_WG
    FILL_THREADS = 96
    THREADS = MMA_THREADS + 128
    MMA_REGS = 240
    LOAD_REGS = 24
    STAGES = 8  # slots of one cache block (8 KiB)

    def __init__(self, *, b: int, next_n: int, block_kv: int):
        if block_kv != self.BLOCK_KV:
            raise ValueError(f"stage I2 sm90: block_kv must be {self.BLOCK_KV}, got {block_kv}")
        if next_n not in (1, 2, 3, 4):
            raise ValueError(f"stage I2 sm90: next_n must be 1 … 4 (N = next_n · 64 ≤ 256), got {next_n}")
        self.b, self.next_n = b, next_n
        self.n = HEADS * next_n
        # setmaxnreg only where the MMA warpgroups need more than the launch's share.  At
        # next_n = 1 ptxas launches the kernel with 66 registers per thread; an increase to 240
        # would ask for registers beyond the CTA's launch allocation (PTX: the increase waits
        # until the pool has them).  Batch 1 (H100) ran the earlier kernel with that increase and
        # it passed, so this is hygiene, not a fix of an observed hang.
        self.rebalance = next_n >= 2

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
        self.max_blocks = block_table.shape[1]
        self.max_len = logits.shape[1]
        chunk_keys = self.CHUNK_TILES * self.BLOCK_K
        self.num_chunks = (self.max_len + chunk_keys - 1) // chunk_keys

        mQ = cute.make_tensor(q.iterator, cute.make_layout((b * n, DIM), stride=(DIM, 1)))
        # The fused cache's bytes as values (slot, col, block) e4m3 and scales (slot, block) fp32.
        mKV = cute.make_tensor(
            cute.recast_ptr(kv_cache.iterator, dtype=dtype),
            cute.make_layout((bkv, DIM, num_blocks), stride=(DIM, 1, block_bytes)),
        )
        mScale = cute.make_tensor(
            cute.recast_ptr(kv_cache.iterator + bkv * DIM, dtype=cutlass.Float32),
            cute.make_layout((bkv, num_blocks), stride=(1, block_bytes // 4)),
        )
        mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype,
            warpgroup.OperandMajorMode.K,  # a cache block [64 keys, d]: d contiguous (A, M = keys)
            warpgroup.OperandMajorMode.K,  # Q [next_n · heads, d]: d contiguous (B, N = heads)
            cutlass.Float32,
            (1, 1, 1),
            tiler_mn=(bkv, n),
        )
        check_token_columns(mma, (bkv, n), HEADS, self.next_n)
        tile = (bkv, n, DIM)
        k_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, tile, dtype, self.STAGES)
        q_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, tile, dtype, 1)
        expose(self, qk_mma=(mma, tile), smem={"K": k_smem, "Q": q_smem})  # dsv4-lab inspect
        tma_q, tma_Q, self.q_bytes = sm90_tma_load(mQ, q_smem, (n, DIM))
        tma_k, tma_K, self.k_bytes = sm90_tma_load(mKV, k_smem, (bkv, DIM))

        @cute.struct
        class Smem:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem)], 1024]

        self.smem_struct = Smem
        self.kernel(
            mma, tma_q, tma_Q, tma_k, tma_K, mScale, context_lens, block_table, weights, logits, q_smem, k_smem
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
    ):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, seq, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_k)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (n, d, 1)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (64, d, stages)
        q_pipe = tma_pipeline(storage.q_mbar, 1, self.q_bytes, self.MMA_THREADS // 32)
        k_pipe = tma_pipeline(storage.k_mbar, self.STAGES, self.k_bytes, 4)  # a slot is one warpgroup's
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # The sequence's context (clamped to the output's width) and this chunk's tiles below it.
        ctx = cutlass.min(cutlass.max(mLens[seq], cutlass.Int32(0)), cutlass.Int32(self.max_len))
        last_block = cutlass.max((ctx + self.BLOCK_KV - 1) // self.BLOCK_KV - 1, cutlass.Int32(0))
        tile_begin = chunk * self.CHUNK_TILES
        tile_end = cutlass.max(
            cutlass.min(tile_begin + self.CHUNK_TILES, (ctx + self.BLOCK_K - 1) // self.BLOCK_K), tile_begin
        )
        if warp_idx // 4 == self.LOAD_WG:
            if cutlass.const_expr(self.rebalance):
                cute.arch.setmaxregister_decrease(self.LOAD_REGS)
            if warp_idx == self.LOAD_WARP:
                self.load(seq, last_block, tile_begin, tile_end, q_pipe, k_pipe, tma_q, mQ, sQ, tma_k, mKV, sK, mTable)
            else:
                chunk_end = cutlass.min((chunk + 1) * self.CHUNK_TILES * self.BLOCK_K, cutlass.Int32(self.max_len))
                ftid = tidx - self.MMA_THREADS - 32
                for t in cutlass.range_constexpr(self.next_n):
                    fill_neg_inf(mOut, seq * self.next_n + t, tile_end * self.BLOCK_K, chunk_end, ftid, self.FILL_THREADS)
        else:
            if cutlass.const_expr(self.rebalance):
                cute.arch.setmaxregister_increase(self.MMA_REGS)
            self.logits(seq, ctx, last_block, tidx, tile_begin, tile_end, q_pipe, k_pipe, mma, sQ, sK,
                        mScale, mTable, mW, mOut)

    @cute.jit
    def load(self, seq, last_block, tile_begin, tile_end, q_pipe, k_pipe, tma_q, mQ, sQ, tma_k, mKV, sK, mTable):
        """Load warp: the sequence's Q rows once, then the chunk's cache blocks (through the
        block table, clamped to the sequence's last block), one per slot."""
        gQ = cute.local_tile(mQ, (self.n, DIM), (None, 0))  # (n, d, b)
        gKV = cute.local_tile(mKV, (self.BLOCK_KV, DIM), (0, 0, None))  # (64, d, num_blocks)
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, gQ, 2)
        tKsK, tKgK = tma_partition_tile(tma_k, sK, gKV, 2)
        if tile_end > tile_begin:
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            q_pipe.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ[(None, seq)], tQsQ[(None, 0)], tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.STAGES)
        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            k_pipe.producer_acquire(k_state)
            phys = mTable[seq, cutlass.min(tile, last_block)]
            cute.copy(tma_k, tKgK[(None, phys)], tKsK[(None, k_state.index)], tma_bar_ptr=k_pipe.producer_get_barrier(k_state))
            k_state.advance()

    @cute.jit
    def logits(self, seq, ctx, last_block, tidx, tile_begin, tile_end, q_pipe, k_pipe, mma, sQ, sK,
               mScale, mTable, mW, mOut):
        """MMA warpgroups: warpgroup w takes the chunk's blocks w, w + 2, … (Sᵀ = K_block · Qᵀ, 64
        keys × next_n · 64 heads), then the fused epilogue: relu, × w, head sum, × k_scale,
        causal select, store."""
        nn, n, bkv = self.next_n, self.n, self.BLOCK_KV
        wg = tidx // 128
        tid_wg = tidx % 128
        thr = mma.get_slice(tid_wg)
        tCrK = mma.make_fragment_A(thr.partition_A(sK))  # (MMA, 1, d/32, 2 · stages)
        tCrQ = mma.make_fragment_B(thr.partition_B(sQ))  # (MMA, 1, d/32, 1)
        acc_shape = thr.partition_shape_C((bkv, n))
        coords = acc_rows_cols(thr.partition_C(cute.make_identity_tensor((bkv, n))))  # (slot, token·64 + head)
        num_rows = cute.size(coords, mode=[0])
        num_cols = cute.size(coords, mode=[1])
        per_token = num_cols // nn

        w = cute.make_rmem_tensor(num_cols, cutlass.Float32)
        for j in cutlass.range_constexpr(num_cols):
            col = coords[0, j][1]
            w[j] = mW[seq * nn + col // HEADS, col % HEADS]
        lane4 = tidx % 4
        first_pos = ctx - nn  # token t sees keys ≤ first_pos + t

        if tile_end > tile_begin:
            q_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.STAGES)
        if wg == 1:
            k_state.advance()  # warpgroup 1 starts at the chunk's second block
        for block in cutlass.range(tile_begin + wg, tile_end, self.NUM_MMA_WG, unroll=1):
            k_pipe.consumer_wait(k_state)
            acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
            wgmma_sync(mma, acc, tCrK, tCrQ, a_slot=k_state.index, b_slot=0, zero_init=True)
            k_pipe.consumer_release(k_state)
            k_state.advance()
            k_state.advance()  # the other warpgroup's block
            phys = mTable[seq, cutlass.min(block, last_block)]
            acc_rc = acc_rows_cols(acc)
            for r in cutlass.range_constexpr(num_rows):
                slot = coords[r, 0][0]
                key = block * bkv + slot
                scale = mScale[slot, phys]
                for t in cutlass.range_constexpr(nn):
                    total = self.head_sum(acc_rc, w, r, t * per_token, per_token) * scale
                    value = cutlass.Float32(cutlass.select_(key <= first_pos + t, total, -cutlass.Float32.inf))
                    if (r * nn + t) % 4 == lane4:  # the quad's lanes share the stores
                        if key < self.max_len:
                            mOut[seq * nn + t, key] = value

    @cute.jit
    def head_sum(self, acc_rc, w, r: cutlass.Constexpr[int], first: cutlass.Constexpr[int],
                 count: cutlass.Constexpr[int]) -> cutlass.Float32:
        """Σ_h w[h] · relu(S[r, h]) over one token's heads (stages/common/indexer.py)."""
        return head_sum(acc_rc, w, r, first, count)
