"""Stage I2 on Blackwell (sm_100a): the lightning indexer's FP8 MQA logits over a paged cache.
Compiled and inspected only (no Blackwell GPU): not run.  Math: the sm90 kernel's.

New beside I1's sm100 kernel
    M = 128 keys = two cache blocks, each its own TMA box (found through the table) into one
        half of the A operand's slot, both on one barrier; `check_half_slots` proves the
        half-slot view and the MMA's A layout address the same bytes.
    N = next_n · 64, two TMEM accumulator buffers (≤ 512 columns, checked).
    Epilogue thread t ↔ key t (block 2k + t // 64, slot t % 64); the causal select keeps NaN out.
    Grid (key chunks, b); the fill warps write −inf past the computed tiles.
Warp roles and shared pieces: I1's sm100 kernel's (stages/common/indexer.py).
Limits: block_kv = 64, h ∈ {32, 64}, d ∈ {32, 64, 128}, next_n ∈ {1, 2, 3, 4}; static shapes."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.hopper_helpers as sm90_utils

from stages.common import hang_guard
from stages.common.indexer import (
    DIM,
    F32,
    HEADS,
    LogitsOperands,
    Sm100LogitsCta,
    causal_limits,
    check_heads,
    check_logits,
    check_output,
    check_paged_shape,
    fill_rows,
    launch,
    masked_logit,
    mma_key_tiles,
    paged_tiles,
    paged_views,
    q_rows,
    start_cta,
    token_limits,
    tmem_head_sums,
    tmem_row_reader,
    to_output,
    weights_to_smem,
)
from stages.common.inspection import expose
from stages.common.sm100_idioms import tcgen05_fence_before_sync, tmem_free
from stages.common.tma import sm90_tma_load, sm100_tma_load, tma_partition_tile


def check_half_slots(k_smem, half_smem, rows: int, half: int, stages: int, dim: int = DIM) -> None:
    """Trace-time proof that key m, column c of the MMA's A slot s (k_smem) is the byte of key
        m % half, column c of half-slot 2s + m // half (half_smem), sampled (swizzle rows, the half
        boundary, column chunk boundaries, first and last slot)."""
    keys = sorted({*range(9), half - 1, half, half + 1, half + 8, rows - 1})
    cols = [c for c in (0, 1, 15, 16, 31, 32, 63, 64, 127) if c < dim] + [dim - 1]
    for s in sorted({0, stages - 1}):
        for m in keys:
            for c in cols:
                a = k_smem(((m, c % 32), 0, c // 32, s))
                b = half_smem((m % half, c, 2 * s + m // half))
                if a != b:
                    raise ValueError(f"stage I2 sm100: A slot {s} (key {m}, col {c}) is byte {a}, its half-slot "
                                     f"view says {b}: a block's TMA box would land in the wrong rows")


class Kernel(Sm100LogitsCta):
    """Paged FP8 MQA logits on Blackwell tensor cores: two cache blocks (128 keys) × next_n · 64
    heads per MMA, one epilogue thread per key, −inf written by the kernel."""

    BLOCK_KV = 64
    BLOCK_K = 128  # keys per tile = M = two cache blocks
    STAGES = 4
    CHUNK_TILES = 16

    def __init__(self, *, b: int, next_n: int, block_kv: int, heads: int = HEADS, head_dim: int = DIM,
                 logits_dtype: str = "fp32", context_2d: bool = False):
        check_paged_shape("stage I2 sm100", block_kv, next_n, self.BLOCK_KV)
        check_heads("stage I2 sm100", heads, head_dim)
        self.out_dtype = check_logits("stage I2 sm100", logits_dtype)
        self.context_2d = bool(context_2d)  # context_lens [b, next_n]: token t sees keys < ctx[b, t]
        self.b, self.next_n = b, next_n
        self.heads, self.dim = heads, head_dim
        self.n = heads * next_n
        self.mma_tiler = (self.BLOCK_K, self.n, head_dim)

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
        check_output("stage I2 sm100", logits, self.out_dtype)
        dtype = q.element_type
        self.max_len = logits.shape[1]  # keys per output row: the grid's chunks cover them
        self.num_chunks = (self.max_len + self.CHUNK_TILES * self.BLOCK_K - 1) // (self.CHUNK_TILES * self.BLOCK_K)

        mQ = q_rows(q, b * n, self.dim)
        mKV, mScale = paged_views(kv_cache, dtype, bkv, self.dim)  # (slot, col, block) e4m3, (slot, block) fp32
        mma = self.logits_mma(dtype)
        k_smem = sm100_utils.make_smem_layout_a(mma, self.mma_tiler, dtype, self.STAGES)
        half_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bkv, n, self.dim), dtype, 2 * self.STAGES)
        check_half_slots(k_smem, half_smem, self.BLOCK_K, bkv, self.STAGES, self.dim)
        q_smem = sm100_utils.make_smem_layout_b(mma, self.mma_tiler, dtype, 1)
        expose(self, qk_mma=(mma, self.mma_tiler), smem={"K": k_smem, "K half-slots": half_smem, "Q": q_smem})
        tma_k, tma_K, box = sm90_tma_load(mKV, half_smem, (bkv, self.dim))  # one cache block per box
        self.k_bytes = 2 * box
        tma_q, tma_Q, self.q_bytes = sm100_tma_load("B", mma, mQ, q_smem, self.mma_tiler)
        self.plan(mma, dtype, k_smem, q_smem, "stage I2 sm100")
        ops = LogitsOperands(mma, tma_q, tma_Q, tma_k, tma_K, q_smem, k_smem)
        launch(self.kernel(ops, half_smem, mScale, context_lens, block_table, weights, logits),
               (self.num_chunks, b, 1), self.THREADS, self.smem_struct, stream)

    @cute.kernel
    def kernel(self, ops: LogitsOperands, half_smem: cute.ComposedLayout, mScale: cute.Tensor, mLens: cute.Tensor,
               mTable: cute.Tensor, mW: cute.Tensor, mOut: cute.Tensor):
        nn, bk, bkv, mma = self.next_n, self.BLOCK_K, self.BLOCK_KV, ops.mma
        tidx, warp_idx, storage = start_cta(ops, self.LOAD_WARP, self.smem_struct)
        chunk, seq, _ = cute.arch.block_idx()
        sK_half = storage.sK.get_tensor(half_smem.outer, swizzle=half_smem.inner)  # the TMA's view (same bytes)
        cta = self.setup(storage, ops)
        gKV = cute.local_tile(ops.mK, (bkv, self.dim), (0, 0, None))  # (64, d, num_blocks)
        tKsK, tKgK = tma_partition_tile(ops.tma_k, sK_half, gKV, 2)
        ctx, last_block, tile_begin, tile_end, chunk_end = paged_tiles(
            mLens, seq, chunk, self.max_len, bkv, bk, self.CHUNK_TILES, nn if self.context_2d else 0)

        if warp_idx == self.LOAD_WARP:
            self.load_role(seq, last_block, tile_begin, tile_end, cta.q_prod, cta.k_prod, ops.tma_q, cta.tQgQ,
                           cta.tQsQ, ops.tma_k, tKgK, tKsK, mTable)
        if warp_idx == self.MMA_WARP:
            mma_key_tiles(tile_begin, tile_end, cta.q_cons, cta.k_cons, cta.acc_prod, mma, cta.tCrK, cta.tCrQ,
                          cta.tmem_ptr, cta.acc_layout, self.acc_cols)
        if warp_idx >= self.FILL_WARPS[0]:
            fill_rows(mOut, seq * nn, nn, tile_end * bk, chunk_end, tidx - 32 * self.FILL_WARPS[0], self.FILL_THREADS)
        if warp_idx <= self.EPI_WARPS[-1]:
            self.epilogue(seq, ctx, last_block, tidx, tile_begin, tile_end, cta.acc_cons, mma, cta.tmem_ptr,
                          cta.acc_layout, cta.sW, mW, mScale, mTable, mOut, cta.epi_sync, mLens)
            tcgen05_fence_before_sync()
            tmem_free(cta.tmem_alloc, cta.tmem_ptr, self.tmem_cols, cta.epi_sync)

    @cute.jit
    def load_role(self, seq, last_block, tile_begin, tile_end, q_prod, k_prod, tma_q, tQgQ, tQsQ, tma_k, tKgK, tKsK,
                  mTable):
        """Warp 5: the sequence's Q once, then per tile its two cache blocks (through the table,
        clamped to the sequence's last block), one TMA box into each half of the slot."""
        hang_guard.role("load")  # names this role's waits in a --debug-hangs build
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
    def epilogue(self, seq, ctx, last_block, tidx, tile_begin, tile_end, acc_cons, mma, tmem_ptr, acc_layout,
                 sW, mW, mScale, mTable, mOut, epi_sync, mLens):
        """Warps 0-3, thread t key t (block 2k + t // 64, slot t % 64): relu · w per token, × the key's
                scale (through the table), −inf past each token's causal limit, stored."""
        hang_guard.role("epilogue")  # names this role's waits in a --debug-hangs build
        nn, bk, bkv = self.next_n, self.BLOCK_K, self.BLOCK_KV
        weights_to_smem(sW, mW, seq * nn, self.n, tidx, self.EPI_THREADS, self.heads)
        epi_sync.arrive_and_wait()  # the weights are in shared memory
        rows = tmem_row_reader(mma, tmem_ptr, acc_layout, self.acc_cols, bk, self.n, self.EPI_COLS, tidx)
        sums = cute.make_rmem_tensor(nn, F32)
        if cutlass.const_expr(self.context_2d):
            hi = token_limits(mLens, seq, nn)  # token t sees keys < context_lens[seq, t]
        else:
            hi = causal_limits(ctx - nn, nn)  # token t sees keys ≤ ctx − next_n + t
        slot_in_block = tidx % bkv

        for tile in cutlass.range(tile_begin, tile_end, unroll=1):
            full = acc_cons.wait_and_advance()
            tmem_head_sums(sums, rows, full.index, sW, bk, self.EPI_COLS)
            full.release()  # the buffer may take the MMAs of tile + 2
            key = tile * bk + tidx
            phys = mTable[seq, cutlass.min(tile * 2 + tidx // bkv, last_block)]
            scale = mScale[slot_in_block, phys]
            if key < self.max_len:
                for t in cutlass.range_constexpr(nn):
                    mOut[seq * nn + t, key] = to_output(masked_logit(sums[t] * scale, key, None, hi, t), mOut)
