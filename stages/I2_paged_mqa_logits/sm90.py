"""Stage I2 on Hopper (sm_90a): the lightning indexer's FP8 MQA logits over a paged cache.

Math (oracles/indexer.py; stage I1's, keys from a paged, fused cache)
    logits[i·next_n + t, j] = k_scale[j] · Σ_h w[i·next_n + t, h] · relu(q[i, t, h] · k[j])
                              for j ≤ pos = context_lens[i] − next_n + t, −inf elsewhere.
    Key j of sequence i is slot j % 64 of block block_table[i, j // 64]; a block of the fused
    cache [num_blocks, 64, 1, 132] holds 64 · 128 e4m3 values (token-major), then 64 fp32 scales.

New beside I1
    The cache as two tensors over the same bytes (indexer.paged_views): values (64, 128,
        num_blocks) e4m3, block stride 64 · 132 (one TMA box a block), scales (64, num_blocks).
    One cache block a slot and an MMA: M = its 64 keys, N = next_n · 64; the MMA warpgroups take
        turns (warpgroup w of W: the CTA's blocks w, w + W, …), so the others' epilogues overlap
        one's MMA.  W = 4 at next_n 2 (112 registers), 2 at next_n 3, 4 (240); next_n 1: W = 2,
        8 slots, two CTAs an SM.  The slots are a multiple of W, so a slot's previous block is
        the same warpgroup's (a parity wait cannot pass on another's).
    Persistent, balanced: CTAs-an-SM × SMs CTAs, each an equal share of the (sequence, block)
        pairs (`block_share`: every warp finds it by prefix sums, no metadata kernel).  A CTA
        walks its share's segments: the load warp loads the segment's Q into the next of two
        slots, then its blocks into the K ring (running on); the MMA warpgroups load the
        sequence's weights and limits, take their turns and free the Q slot.
    Only a sequence's blocks below its context are followed through block_table.
    The causal limit per token is a select (a NaN past the context never reaches a logit); the
        fill warps write −inf past each sequence's blocks up to max_len.  No combine.

Warp roles (128 · (W + 1) threads): as I1 — warpgroup W's first warp loads, its other 3 fill,
warpgroups 0 … W − 1 run the MMA and the fused epilogue (stages/common/indexer.py's pieces).

Limits: block_kv = 64, h ∈ {32, 64}, d ∈ {32, 64, 128} (64, 128 by default), next_n ∈ {1, 2, 3,
4}; static shapes."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from stages.common import hang_guard
from stages.common.indexer import (
    DIM,
    HEADS,
    LogitsOperands,
    block_share,
    causal_limits,
    check_heads,
    check_logits,
    check_output,
    check_paged_shape,
    fill_rows,
    head_partial,
    head_weights,
    launch,
    load_key_tile,
    load_row_scales,
    paged_views,
    q_rows,
    row_scale_regs,
    seq_blocks,
    sm90_fragments,
    sm90_logits_mma,
    sm90_store_logits,
    start_cta,
    token_limits,
)
from stages.common.device import sm_count as device_sm_count
from stages.common.inspection import expose
from stages.common.sm90_idioms import wgmma_sync
from stages.common.sm90_setup import TmaPipe, smem_struct, smem_tensors, tma_pipelines, tma_tiles
from stages.common.tma import sm90_tma_load


class Kernel:
    """Paged FP8 MQA logits on Hopper tensor cores: persistent CTAs on equal shares of the
    (sequence, cache block) pairs, one block per MMA (warpgroups take turns), −inf written by the
    kernel."""

    BLOCK_KV = 64  # keys per cache block = M of one warpgroup's MMA
    BLOCK_K = BLOCK_KV  # keys per tile = one cache block = one pipeline slot
    FILL_THREADS = 96  # the load warpgroup's other 3 warps
    LOAD_REGS = 24
    STAGES = 16  # slots of one cache block (8 KiB)

    def __init__(self, *, b: int, next_n: int, block_kv: int, heads: int = HEADS, head_dim: int = DIM,
                 logits_dtype: str = "fp32", context_2d: bool = False, stages: int = 0, mma_wg: int = 0,
                 mma_regs: int = 0, min_blocks: int = 0, sm_count: int | None = None):
        # stages, mma_wg, mma_regs, min_blocks, sm_count: the schedule's sizes (0 / None: the rule
        # below), for timing variants (scripts/ix_variants.py); the stage passes none of them.
        check_paged_shape("stage I2 sm90", block_kv, next_n, self.BLOCK_KV)
        check_heads("stage I2 sm90", heads, head_dim)
        self.out_dtype = check_logits("stage I2 sm90", logits_dtype)
        self.context_2d = bool(context_2d)  # context_lens [b, next_n]: token t sees keys < ctx[b, t]
        self.b, self.next_n = b, next_n
        self.heads, self.dim = heads, head_dim
        self.n = heads * next_n
        # MMA warpgroups on alternate blocks: four while a thread's accumulator (N / 4 registers)
        # and weights (N / 8) fit 112 registers (N ≤ 128: next_n ≤ 2 at 64 heads), so each
        # epilogue has three MMAs' time; two (240 registers each) above.
        # N ≤ 64 (next_n 1 at 64 heads): two MMA warpgroups, 8 slots and two CTAs an SM (the
        # launch bound keeps a thread at ≤ 64 registers, 80 KB of shared memory a CTA), so one
        # CTA's set-up, first loads and last epilogues run beside the other's steady state
        # (docs/INDEXER.md).
        pair = self.n <= 64
        self.STAGES = stages or (8 if pair else self.STAGES)
        self.min_blocks = min_blocks or (2 if pair else 0)
        self.NUM_MMA_WG = mma_wg or (2 if pair else 4 if self.n <= 128 else 2)
        self.LOAD_WG = self.NUM_MMA_WG
        self.LOAD_WARP = 4 * self.LOAD_WG
        self.MMA_THREADS = 128 * self.NUM_MMA_WG
        self.THREADS = self.MMA_THREADS + 128
        self.MMA_REGS = mma_regs or (112 if self.NUM_MMA_WG == 4 else 240)
        # setmaxnreg only where the MMA warpgroups need more than the launch's share.  At
        # next_n = 1 ptxas launches the kernel with few registers per thread; an increase
        # would ask for registers beyond the CTA's launch allocation (PTX: the increase waits
        # until the pool has them).  Where it is used, the load warpgroup's decrease frees what
        # the increase takes (tests/test_indexer.py checks it on the compiled kernels).
        self.rebalance = self.n >= 128  # next_n ≥ 2 at 64 heads
        # A warpgroup's K state steps W slots a block, so the block S slots before its next
        # one must be its own: with S a multiple of W it is, and its slot's last phase has
        # completed; else a faster warpgroup can wait on a slot whose previous fill (another
        # (W 3 with 8 slots once ended in a launch failure).
        if self.STAGES % self.NUM_MMA_WG:
            raise ValueError(f"stage I2 sm90: {self.STAGES} K slots for {self.NUM_MMA_WG} MMA warpgroups: the slots "
                             "must be a multiple of the warpgroups (each slot's previous block is then the same "
                             "warpgroup's)")
        # CTAs an SM × SMs, each an equal share of the (sequence, block) pairs (block_share), Q in
        # two slots reloaded at each of the share's sequences
        self.ctas = (device_sm_count("sm_90a") if sm_count is None else sm_count) * max(self.min_blocks, 1)
        self.Q_SLOTS = 2

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
        check_output("stage I2 sm90", logits, self.out_dtype)
        dtype = q.element_type
        self.max_len = logits.shape[1]  # keys per output row

        mQ = q_rows(q, b * n, self.dim)
        mKV, mScale = paged_views(kv_cache, dtype, bkv, self.dim)  # (slot, col, block) e4m3, (slot, block) fp32
        mma, tile, k_smem, q_smem = sm90_logits_mma(dtype, bkv, self.next_n, self.STAGES, self.Q_SLOTS, self.heads,
                                                    self.dim)
        expose(self, qk_mma=(mma, tile), smem={"K": k_smem, "Q": q_smem})  # dsv4-lab inspect
        tma_q, tma_Q, q_bytes = sm90_tma_load(mQ, q_smem, (n, self.dim))
        tma_k, tma_K, k_bytes = sm90_tma_load(mKV, k_smem, (bkv, self.dim))
        # Every MMA warpgroup reads Q; a K slot is one warpgroup's (they take turns).
        self.pipes = (TmaPipe("q", self.Q_SLOTS, q_bytes, self.MMA_THREADS // 32), TmaPipe("k", self.STAGES, k_bytes, 4))
        self.smem_struct = smem_struct(self.pipes, {"sQ": (dtype, q_smem), "sK": (dtype, k_smem)})
        ops = LogitsOperands(mma, tma_q, tma_Q, tma_k, tma_K, q_smem, k_smem)
        launch(self.kernel(ops, mScale, context_lens, block_table, weights, logits), (self.ctas, 1, 1),
               self.THREADS, self.smem_struct, stream, self.min_blocks)

    @cute.kernel
    def kernel(self, ops: LogitsOperands, mScale: cute.Tensor, mLens: cute.Tensor, mTable: cute.Tensor, mW: cute.Tensor,
               mOut: cute.Tensor):
        tidx, warp_idx, storage = start_cta(ops, self.LOAD_WARP, self.smem_struct)
        cta, _, _ = cute.arch.block_idx()
        sQ, sK = smem_tensors(storage, sQ=ops.q_smem, sK=ops.k_smem)  # (n, d, 2), (64, d, stages)
        q_pipe, k_pipe = tma_pipelines(storage, self.pipes)
        self.roles(cta, tidx, warp_idx, ops, q_pipe, k_pipe, sQ, sK, mScale, mLens, mTable, mW, mOut)

    @cute.jit
    def roles(self, cta, tidx, warp_idx, ops, q_pipe, k_pipe, sQ, sK, mScale, mLens, mTable, mW, mOut):
        """A persistent CTA's roles: every warp finds the share (`block_share`) and walks its segments —
                the load warp loads each segment's Q (two slots) and blocks, the MMA warpgroups take the
                blocks in turns (w, w + W, …), the fill warps write −inf past the blocks of sequences
                cta, cta + CTAs, …"""
        nn = self.next_n
        t2 = nn if self.context_2d else 0
        if warp_idx // 4 == self.LOAD_WG:
            if cutlass.const_expr(self.rebalance):
                cute.arch.setmaxregister_decrease(self.LOAD_REGS)
            if warp_idx == self.LOAD_WARP:
                share = block_share(mLens, self.b, cta, self.ctas, self.max_len, self.BLOCK_KV, t2)
                self.share_load(share, q_pipe, k_pipe, ops, sQ, sK, mLens, mTable)
            else:
                ftid = tidx - self.MMA_THREADS - 32
                for s in cutlass.range(cta, self.b, self.ctas, unroll=1):
                    done = seq_blocks(mLens, s, self.max_len, self.BLOCK_KV, t2) * self.BLOCK_KV
                    fill_rows(mOut, s * nn, nn, done, self.max_len, ftid, self.FILL_THREADS)
        else:
            if cutlass.const_expr(self.rebalance):
                cute.arch.setmaxregister_increase(self.MMA_REGS)
            share = block_share(mLens, self.b, cta, self.ctas, self.max_len, self.BLOCK_KV, t2)
            self.share_logits(share, tidx, q_pipe, k_pipe, ops.mma, sQ, sK, mScale, mTable, mW, mOut, mLens)

    @cute.jit
    def share_load(self, share, q_pipe, k_pipe, ops, sQ, sK, mLens, mTable):
        """Load warp: for each segment of the share (a sequence's run of blocks), its Q rows
        into the next Q slot, then its blocks through the table, one per K slot."""
        hang_guard.role("load")
        t2 = self.next_n if self.context_2d else 0
        q_load = tma_tiles(ops.tma_q, sQ, ops.mQ, (self.n, self.dim), (None, 0))
        kv_load = tma_tiles(ops.tma_k, sK, ops.mK, (self.BLOCK_KV, self.dim), (0, 0, None))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.Q_SLOTS)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.STAGES)
        seq, excl, begin, left = share
        lo = begin - excl  # the share's first block in its first sequence; 0 in the others
        while left > 0:
            take = cutlass.min(seq_blocks(mLens, seq, self.max_len, self.BLOCK_KV, t2) - lo, left)
            if take > 0:
                q_pipe.producer_acquire(q_state)
                cute.copy(q_load.atom, q_load.gmem[(None, seq)], q_load.smem[(None, q_state.index)],
                          tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
                q_state.advance()
                for j in cutlass.range(lo, lo + take, unroll=1):
                    load_key_tile(k_pipe, k_state, kv_load, mTable[seq, j])
                    k_state.advance()
                left = left - take
            lo = cutlass.Int32(0)
            seq = seq + 1

    @cute.jit
    def share_logits(self, share, tidx, q_pipe, k_pipe, mma, sQ, sK, mScale, mTable, mW, mOut, mLens):
        """MMA warpgroups, per segment: wait for its Q slot, the sequence's weights and limits into
                registers, warpgroup w's blocks (share positions ≡ w mod W; its K state runs on), each MMA
                and fused epilogue; the Q slot released after the segment by every warp."""
        hang_guard.role("mma")
        nn, bkv, step = self.next_n, self.BLOCK_KV, self.NUM_MMA_WG
        t2 = nn if self.context_2d else 0
        wg = tidx // 128
        tCrK, tCrQ, acc_shape, coords = sm90_fragments(mma, tidx % 128, sK, sQ, bkv, self.n)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.Q_SLOTS)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.STAGES)
        if wg > 0:
            k_state.advance(wg)
        sc = row_scale_regs(coords)
        sc_next = row_scale_regs(coords)
        seq, excl, begin, left = share
        lo = begin - excl  # the share's first block in its first sequence; 0 in the others
        skip = wg  # share positions to this warpgroup's next block: (wg − position) mod W
        while left > 0:
            take = cutlass.min(seq_blocks(mLens, seq, self.max_len, self.BLOCK_KV, t2) - lo, left)
            if take > 0:
                w = self.segment_weights(mW, coords, seq, share[0])
                if cutlass.const_expr(self.context_2d):
                    hi = token_limits(mLens, seq, nn)
                else:
                    ctx = cutlass.min(cutlass.max(mLens[seq], cutlass.Int32(0)), cutlass.Int32(self.max_len))
                    hi = causal_limits(ctx - nn, nn)
                last = lo + take - 1  # the segment's last block (a sequence block index)
                first = lo + skip  # this warpgroup's first block of it
                load_row_scales(sc_next, mScale[None, mTable[seq, cutlass.min(first, last)]], coords)
                q_pipe.consumer_wait(q_state)
                for j in cutlass.range(first, lo + take, step, unroll=1):
                    for r in cutlass.range_constexpr(cute.size(sc)):
                        sc[r] = sc_next[r]
                    load_row_scales(sc_next, mScale[None, mTable[seq, cutlass.min(j + step, last)]], coords)
                    k_pipe.consumer_wait(k_state)
                    acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
                    wgmma_sync(mma, acc, tCrK, tCrQ, a_slot=k_state.index, b_slot=q_state.index, zero_init=True)
                    k_pipe.consumer_release(k_state)
                    k_state.advance(step)
                    sm90_store_logits(mOut, seq * nn, acc, coords, w, j * bkv, sc, None, hi, tidx,
                                      head_partial, nn, width=self.max_len)
                q_pipe.consumer_release(q_state)
                q_state.advance()
                skip = (skip - take % step + step) % step
                left = left - take
            lo = cutlass.Int32(0)
            seq = seq + 1

    @cute.jit
    def segment_weights(self, mW, coords, seq, first_seq):
        """A segment's head weights, its sequence's; `first_seq` is the share's first sequence
        (a hook so a test fixture can plant a bug here)."""
        return head_weights(mW, coords, seq * self.next_n, self.heads)
