"""Stage I1 on Blackwell (sm_100a): the lightning indexer's FP8 MQA logits, flat.  Compiled and
inspected only (no Blackwell GPU): not run.  Math: the sm90 kernel's (oracles/indexer.py).

The MMA: tcgen05.mma kind::f8f6f4, Sᵀ = K_tile · Q_blockᵀ, M = 128 keys, N = 4 tokens × 64
heads, K = d (k32 steps), both K-major from shared memory, fp32 accumulator in TMEM.  TMEM lane
r holds key r, so epilogue thread r reads its whole row and the head sum is thread-local; its
stores are coalesced; the weights are shared-memory broadcasts.  Two accumulator buffers (512
columns, checked) overlap tile k + 1's MMA with tile k's epilogue.

Warp roles: indexer.py's `Sm100LogitsCta`, `mma_key_tiles`, `tmem_head_sums`; new here are the
flat key tiles (one TMA box of 128 keys a slot) and the per-token key ranges.
Limits: s a multiple of BLOCK_Q, s_kv of 128; h ∈ {32, 64}, d ∈ {32, 64, 128}; static shapes."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils

from stages.common import hang_guard
from stages.common.indexer import (
    DIM,
    F32,
    HEADS,
    LogitsOperands,
    Sm100LogitsCta,
    check_flat_shape,
    check_heads,
    check_logits,
    check_output,
    fill_outside,
    key_tile_range,
    launch,
    masked_logit,
    mma_key_tiles,
    q_rows,
    start_cta,
    tmem_head_sums,
    tmem_row_reader,
    to_output,
    token_ranges,
    weights_to_smem,
)
from stages.common.inspection import expose
from stages.common.sm100_idioms import tcgen05_fence_before_sync, tmem_free
from stages.common.tma import sm100_tma_load, tma_partition_tile


class Kernel(Sm100LogitsCta):
    """FP8 MQA logits on Blackwell tensor cores (tcgen05, TMEM accumulators): 4 query tokens ×
    128-key tiles per MMA, one thread per key in the epilogue, −inf written by the kernel."""

    BLOCK_Q = 4  # query tokens per CTA: N = 256
    BLOCK_K = 128  # keys per tile = M
    STAGES = 4  # K slots of 16 KiB

    def __init__(self, *, s: int, s_kv: int, heads: int = HEADS, head_dim: int = DIM, logits_dtype: str = "fp32",
                 compressed: bool = False):
        check_flat_shape("stage I1 sm100", s, s_kv, self.BLOCK_Q, self.BLOCK_K)
        check_heads("stage I1 sm100", heads, head_dim)
        self.out_dtype = check_logits("stage I1 sm100", logits_dtype)
        self.compressed = bool(compressed)  # logits [s, W] from ks (DeepGEMM's max_seqlen_k form)
        self.s, self.s_kv = s, s_kv
        self.heads, self.dim = heads, head_dim
        self.n = heads * self.BLOCK_Q
        self.mma_tiler = (self.BLOCK_K, self.n, head_dim)

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
        s = self.s
        check_output("stage I1 sm100", logits, self.out_dtype)
        self.width = logits.shape[1]  # s_kv, or W of the compressed form
        dtype = q.element_type
        mQ = q_rows(q, s * self.heads, self.dim)
        mma = self.logits_mma(dtype)
        k_smem = sm100_utils.make_smem_layout_a(mma, self.mma_tiler, dtype, self.STAGES)
        q_smem = sm100_utils.make_smem_layout_b(mma, self.mma_tiler, dtype, 1)
        expose(self, qk_mma=(mma, self.mma_tiler), smem={"K": k_smem, "Q": q_smem})  # dsv4-lab inspect
        tma_k, tma_K, self.k_bytes = sm100_tma_load("A", mma, kv, k_smem, self.mma_tiler)
        tma_q, tma_Q, self.q_bytes = sm100_tma_load("B", mma, mQ, q_smem, self.mma_tiler)
        self.plan(mma, dtype, k_smem, q_smem, "stage I1 sm100")
        ops = LogitsOperands(mma, tma_q, tma_Q, tma_k, tma_K, q_smem, k_smem)
        launch(self.kernel(ops, kv_scale, weights, ks, ke, logits), (s // self.BLOCK_Q, 1, 1), self.THREADS,
               self.smem_struct, stream)

    @cute.kernel
    def kernel(self, ops: LogitsOperands, mScale: cute.Tensor, mW: cute.Tensor, mKs: cute.Tensor, mKe: cute.Tensor,
               mOut: cute.Tensor):
        bq, bk, mma = self.BLOCK_Q, self.BLOCK_K, ops.mma
        tidx, warp_idx, storage = start_cta(ops, self.LOAD_WARP, self.smem_struct)
        block, _, _ = cute.arch.block_idx()
        cta = self.setup(storage, ops)
        gK = cute.local_tile(ops.mK, self.mma_tiler, (None, 0, 0), proj=(1, None, 1))  # (128, d, tiles)
        tKsK, tKgK = tma_partition_tile(ops.tma_k, cta.sK, mma.get_slice(0).partition_A(gK), 3)
        tile_begin, tile_end = key_tile_range(mKs, mKe, block * bq, bq, self.s_kv, bk)

        if warp_idx == self.LOAD_WARP:
            self.load_role(block, tile_begin, tile_end, cta.q_prod, cta.k_prod, ops.tma_q, cta.tQgQ, cta.tQsQ,
                           ops.tma_k, tKgK, tKsK)
        if warp_idx == self.MMA_WARP:
            mma_key_tiles(tile_begin, tile_end, cta.q_cons, cta.k_cons, cta.acc_prod, mma, cta.tCrK, cta.tCrQ,
                          cta.tmem_ptr, cta.acc_layout, self.acc_cols)
        if warp_idx >= self.FILL_WARPS[0]:
            fill_outside(mOut, mKs, block, bq, tile_begin, tile_end, bk, self.s_kv, self.width, self.compressed,
                         tidx - 32 * self.FILL_WARPS[0], self.FILL_THREADS)
        if warp_idx <= self.EPI_WARPS[-1]:
            self.epilogue(block, tidx, tile_begin, tile_end, cta.acc_cons, mma, cta.tmem_ptr, cta.acc_layout,
                          cta.sW, mW, mScale, mKs, mKe, mOut, cta.epi_sync)
            tcgen05_fence_before_sync()
            tmem_free(cta.tmem_alloc, cta.tmem_ptr, self.tmem_cols, cta.epi_sync)

    @cute.jit
    def load_role(self, block, tile_begin, tile_end, q_prod, k_prod, tma_q, tQgQ, tQsQ, tma_k, tKgK, tKsK):
        """Warp 5: the token block's Q once, then the K tiles of the range, one per slot."""
        hang_guard.role("load")  # names this role's waits in a --debug-hangs build
        if tile_end > tile_begin:
            q_slot = q_prod.acquire_and_advance()
            cute.copy(tma_q, tQgQ[(None, block)], tQsQ[(None, 0)], tma_bar_ptr=q_slot.barrier)
        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            k_slot = k_prod.acquire_and_advance()
            cute.copy(tma_k, tKgK[(None, tile)], tKsK[(None, k_slot.index)], tma_bar_ptr=k_slot.barrier)
        k_prod.tail()

    @cute.jit
    def epilogue(self, block, tidx, tile_begin, tile_end, acc_cons, mma, tmem_ptr, acc_layout, sW, mW, mScale, mKs,
                 mKe, mOut, epi_sync):
        """Warps 0-3, thread t key t: relu · w summed per token, × k_scale, −inf outside the range, stored."""
        hang_guard.role("epilogue")  # names this role's waits in a --debug-hangs build
        bq, bk = self.BLOCK_Q, self.BLOCK_K
        weights_to_smem(sW, mW, block * bq, self.n, tidx, self.EPI_THREADS, self.heads)
        lo, hi = token_ranges(mKs, mKe, block * bq, bq)
        epi_sync.arrive_and_wait()  # the weights are in shared memory
        rows = tmem_row_reader(mma, tmem_ptr, acc_layout, self.acc_cols, bk, self.n, self.EPI_COLS, tidx)
        sums = cute.make_rmem_tensor(bq, F32)

        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            full = acc_cons.wait_and_advance()
            tmem_head_sums(sums, rows, full.index, sW, bk, self.EPI_COLS)
            full.release()  # the buffer may take the MMAs of tile + 2
            key = tile * bk + tidx
            scale = mScale[key]
            for t in cutlass.range_constexpr(bq):
                if cutlass.const_expr(self.compressed):  # column key − ks of a row W wide
                    col = key - lo[t]
                    if (col >= 0) & (col < self.width):
                        mOut[block * bq + t, col] = to_output(masked_logit(sums[t] * scale, key, lo, hi, t), mOut)
                else:
                    mOut[block * bq + t, key] = to_output(masked_logit(sums[t] * scale, key, lo, hi, t), mOut)
