"""Stage I1 on Hopper (sm_90a): the lightning indexer's FP8 MQA logits, flat.

Math (oracles/indexer.py)
    logits[i, j] = k_scale[j] · Σ_h w[i, h] · relu(q[i, h] · k[j])        ks[i] ≤ j < ke[i]
                 = −inf                                                    elsewhere
    (relu(x · s) = s · relu(x) for the positive per-key scale s, so the scale is applied once per
    key after the head sum.)  q [s, 64, 128] e4m3, k [s_kv, 128] e4m3, fp32 accumulation.

The MMA: keys along M, heads along N
    One FP8 wgmma computes Sᵀ = K_tile · Q_wᵀ with M = 64 keys, N = the 64 heads of each of the
    warpgroup's 4 query tokens (256), K = d = 128 (four k32 steps).  Both operands
    are K-major (row-major K [keys, d], Q [tokens · heads, d]), as FP8 wgmma requires.  With
    heads along N, the reduction over heads is a reduction over an accumulator row: each thread
    holds 2 rows (keys r, r + 8) × N/4 columns, sums its columns (relu, × w), then two butterfly
    shuffles over the row's quad finish the sum (stages/common/indexer.py).  Heads along M would need
    the sum across 8 lanes and 4 warps instead.

Ranges and the −inf fill
    The CTA's key range is the union of its tokens' non-empty ranges, rounded out to whole
    tiles: tiles [tile_begin, tile_end).  Inside it the epilogue selects −inf per element
    (a key outside its token's [ks, ke)); outside it the fill warps write −inf.  Every element
    of the CTA's rows is written exactly once, by the kernel.

Warp roles (384 threads)
    warpgroup 2, warp 8     load: Q's token block once, then the range's K tiles into a
                            STAGES-slot TMA pipeline (setmaxnreg 24)
    warpgroup 2, warps 9-11 fill: −inf outside the tile range (setmaxnreg 24)
    warpgroups 0, 1         8 query tokens per CTA, warpgroup w owns tokens 4w … 4w + 3 (its
                            half of the Q block is its B operand); both read every 64-key K tile
                            (a slot is free once both have): MMA, then the fused epilogue —
                            relu, × w, head sum, × k_scale, range select, store (setmaxnreg 240:
                            128 accumulator + 64 weight registers per thread).  The tensor core
                            serialises the two MMAs, so one warpgroup's epilogue runs under the
                            other's MMA without any explicit schedule.

Why this shape.  The first version (in git history) had both warpgroups on halves of one
128-key tile with 2 tokens per CTA; the second 4 tokens and alternate tiles.  Here each K tile
read from L2 serves 8 tokens (half the second's L2 → SMEM traffic of K), each wgmma is
m64n256k32, and the overlap of epilogue and MMA is kept.

Limits: s a multiple of BLOCK_Q, s_kv a multiple of BLOCK_K; h = 64, d = 128; row-major,
16-byte aligned, static shapes.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup

from stages.common.indexer import check_token_columns, fill_neg_inf, head_sum, key_tile_range
from stages.common.inspection import expose
from stages.common.sm90_idioms import acc_rows_cols, tma_pipeline, wgmma_sync
from stages.common.tma import prefetch_descriptors, sm90_tma_load, tma_partition_tile

HEADS = 64
DIM = 128


class Kernel:
    """FP8 MQA logits on Hopper tensor cores: 8 query tokens per CTA (4 per MMA warpgroup), 64-key
    tiles through a TMA pipeline read by both warpgroups, the relu-weight-head-sum fused after the
    MMA, −inf written by the kernel."""

    BLOCK_Q = 8  # query tokens per CTA: 4 per MMA warpgroup (N = 256 each)
    WG_Q = 4
    BLOCK_K = 64  # keys per tile = M of one warpgroup's MMA; the warpgroups take alternate tiles
    NUM_MMA_WG = 2
    LOAD_WG = 2
    LOAD_WARP = 4 * LOAD_WG
    MMA_THREADS = 128 * NUM_MMA_WG
    FILL_THREADS = 96  # warps 9-11
    THREADS = MMA_THREADS + 128
    MMA_REGS = 240
    LOAD_REGS = 24
    STAGES = 8  # K slots of 8 KiB

    def __init__(self, *, s: int, s_kv: int):
        if s % self.BLOCK_Q:
            raise ValueError(f"stage I1 sm90: s must be a multiple of {self.BLOCK_Q}, got {s}")
        if s_kv % self.BLOCK_K or s_kv <= 0:
            raise ValueError(f"stage I1 sm90: s_kv must be a positive multiple of {self.BLOCK_K}, got {s_kv}")
        self.s, self.s_kv = s, s_kv
        self.n = HEADS * self.WG_Q  # N of one warpgroup's MMA
        self.num_tiles = s_kv // self.BLOCK_K

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
        s, bq, bk, n = self.s, self.BLOCK_Q, self.BLOCK_K, self.n
        dtype = q.element_type
        mQ = cute.make_tensor(q.iterator, cute.make_layout((s * HEADS, DIM), stride=(DIM, 1)))
        mma = sm90_utils.make_trivial_tiled_mma(
            dtype, kv.element_type,
            warpgroup.OperandMajorMode.K,  # K tile [keys, d]: d contiguous (A, M = keys)
            warpgroup.OperandMajorMode.K,  # Q block [tokens · heads, d]: d contiguous (B, N = heads)
            cutlass.Float32,
            (1, 1, 1),
            tiler_mn=(bk, n),
        )
        check_token_columns(mma, (bk, n), HEADS, self.WG_Q)
        tile = (bk, n, DIM)
        k_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, tile, dtype, self.STAGES)
        q_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, tile, dtype, self.NUM_MMA_WG)  # a half per warpgroup
        expose(self, qk_mma=(mma, tile), smem={"K": k_smem, "Q": q_smem})  # dsv4-lab inspect
        tma_q, tma_Q, q_half = sm90_tma_load(mQ, q_smem, (n, DIM))
        self.q_bytes = self.NUM_MMA_WG * q_half
        tma_k, tma_K, self.k_bytes = sm90_tma_load(kv, k_smem, (bk, DIM))

        @cute.struct
        class Smem:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem)], 1024]

        self.smem_struct = Smem
        self.kernel(mma, tma_q, tma_Q, tma_k, tma_K, kv_scale, weights, ks, ke, logits, q_smem, k_smem).launch(
            grid=(s // bq, 1, 1), block=(self.THREADS, 1, 1), smem=Smem.size_in_bytes(), stream=stream
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
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_k)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (n, d, 1)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (bk, d, stages)
        q_pipe = tma_pipeline(storage.q_mbar, 1, self.q_bytes, self.MMA_THREADS // 32)
        k_pipe = tma_pipeline(storage.k_mbar, self.STAGES, self.k_bytes, self.MMA_THREADS // 32)  # both read each slot
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        tile_begin, tile_end = key_tile_range(mKs, mKe, block * self.BLOCK_Q, self.BLOCK_Q, self.s_kv, self.BLOCK_K)
        if warp_idx // 4 == self.LOAD_WG:
            cute.arch.setmaxregister_decrease(self.LOAD_REGS)
            if warp_idx == self.LOAD_WARP:
                self.load(block, tile_begin, tile_end, q_pipe, k_pipe, tma_q, mQ, sQ, tma_k, mK, sK)
            else:
                self.fill(block, tidx - self.MMA_THREADS - 32, tile_begin, tile_end, mOut)
        else:
            cute.arch.setmaxregister_increase(self.MMA_REGS)
            self.logits(block, tidx, tile_begin, tile_end, q_pipe, k_pipe, mma, sQ, sK, mScale, mW, mKs, mKe, mOut)

    @cute.jit
    def load(self, block, tile_begin, tile_end, q_pipe, k_pipe, tma_q, mQ, sQ, tma_k, mK, sK):
        """Load warp: the token block's Q rows (BLOCK_Q · 64 × 128) once, then the K tiles."""
        gQ = cute.local_tile(mQ, (self.n, DIM), (None, 0))  # (n, d, token blocks)
        gK = cute.local_tile(mK, (self.BLOCK_K, DIM), (None, 0))  # (bk, d, tiles)
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, gQ, 2)
        tKsK, tKgK = tma_partition_tile(tma_k, sK, gK, 2)
        if tile_end > tile_begin:
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            q_pipe.producer_acquire(q_state)
            for w in cutlass.range_constexpr(self.NUM_MMA_WG):
                cute.copy(tma_q, tQgQ[(None, block * self.NUM_MMA_WG + w)], tQsQ[(None, w)],
                          tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.STAGES)
        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            k_pipe.producer_acquire(k_state)
            cute.copy(tma_k, tKgK[(None, tile)], tKsK[(None, k_state.index)],
                      tma_bar_ptr=k_pipe.producer_get_barrier(k_state))
            k_state.advance()

    @cute.jit
    def fill(self, block, ftid, tile_begin, tile_end, mOut):
        """Fill warps: −inf in the block's rows outside the tile range (the epilogue writes
        every element inside it)."""
        first, last = tile_begin * self.BLOCK_K, tile_end * self.BLOCK_K
        for t in cutlass.range_constexpr(self.BLOCK_Q):
            row = block * self.BLOCK_Q + t
            fill_neg_inf(mOut, row, 0, first, ftid, self.FILL_THREADS)
            fill_neg_inf(mOut, row, last, self.s_kv, ftid, self.FILL_THREADS)

    @cute.jit
    def logits(self, block, tidx, tile_begin, tile_end, q_pipe, k_pipe, mma, sQ, sK, mScale, mW, mKs, mKe, mOut):
        """MMA warpgroups: warpgroup w, for every K tile: Sᵀ = K_tile · Q_wᵀ (64 keys × its 4 tokens
        · 64 heads), then the fused epilogue (see `head_sum`)."""
        wq, bk, n = self.WG_Q, self.BLOCK_K, self.n
        wg = tidx // 128
        row0 = block * self.BLOCK_Q + wg * wq  # this warpgroup's first token
        thr = mma.get_slice(tidx % 128)
        tCrK = mma.make_fragment_A(thr.partition_A(sK))  # (MMA, 1, d/32, stages)
        tCrQ = mma.make_fragment_B(thr.partition_B(sQ))  # (MMA, 1, d/32, 2)
        acc_shape = thr.partition_shape_C((bk, n))
        coords = acc_rows_cols(thr.partition_C(cute.make_identity_tensor((bk, n))))  # (key in tile, token·64 + head)
        num_rows = cute.size(coords, mode=[0])
        num_cols = cute.size(coords, mode=[1])
        per_token = num_cols // wq

        w = cute.make_rmem_tensor(num_cols, cutlass.Float32)
        for j in cutlass.range_constexpr(num_cols):
            col = coords[0, j][1]
            w[j] = mW[row0 + col // HEADS, col % HEADS]
        lo = cute.make_rmem_tensor(wq, cutlass.Int32)
        hi = cute.make_rmem_tensor(wq, cutlass.Int32)
        for t in cutlass.range_constexpr(wq):
            lo[t] = mKs[row0 + t]
            hi[t] = mKe[row0 + t]
        lane4 = tidx % 4

        if tile_end > tile_begin:
            q_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.STAGES)
        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            k_pipe.consumer_wait(k_state)
            acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
            wgmma_sync(mma, acc, tCrK, tCrQ, a_slot=k_state.index, b_slot=wg, zero_init=True)
            k_pipe.consumer_release(k_state)
            k_state.advance()
            acc_rc = acc_rows_cols(acc)
            for r in cutlass.range_constexpr(num_rows):
                key = tile * bk + coords[r, 0][0]
                scale = mScale[key]
                for t in cutlass.range_constexpr(wq):
                    total = self.head_sum(acc_rc, w, r, t * per_token, per_token) * scale
                    inside = (key >= lo[t]) & (key < hi[t])
                    value = cutlass.Float32(cutlass.select_(inside, total, -cutlass.Float32.inf))
                    if (r * wq + t) % 4 == lane4:  # the quad's lanes share the stores
                        mOut[row0 + t, key] = value

    @cute.jit
    def head_sum(self, acc_rc, w, r: cutlass.Constexpr[int], first: cutlass.Constexpr[int],
                 count: cutlass.Constexpr[int]) -> cutlass.Float32:
        """Σ_h w[h] · relu(S[r, h]) over one token's heads (stages/common/indexer.py); a method so
        a test fixture can plant a bug here."""
        return head_sum(acc_rc, w, r, first, count)
