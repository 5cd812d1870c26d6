"""Stage I1 on Hopper (sm_90a): the lightning indexer's FP8 MQA logits, flat (docs/INDEXER.md).

Math (oracles/indexer.py)
    logits[i, j] = k_scale[j] · Σ_h w[i, h] · relu(q[i, h] · k[j])        ks[i] ≤ j < ke[i]
                 = −inf                                                    elsewhere
    (relu(x · s) = s · relu(x) for the positive key scale: applied once per key after the head
    sum.)  q [s, h, d] e4m3, k [s_kv, d] e4m3, fp32 accumulation; h ∈ {32, 64}, d ∈ {32, 64, 128}
    (64, 128 by default): N = 2 · h, K = d below.

The MMA: keys along M, heads along N.  One FP8 wgmma Sᵀ = K_tile · Q_wᵀ, M = 64 keys, N = the
    heads of the warpgroup's 2 tokens, K = d (k32 steps), both operands K-major.  A thread holds
    2 rows (keys r, r + 8) × N/4 columns: it sums its columns (relu, × w), two butterfly shuffles
    over the quad finish the head sum (heads along M would need 8 lanes and 4 warps).

Ranges and the −inf fill.  A token block's key range is the union of its 8 tokens' non-empty
    ranges rounded out to whole tiles [tile_begin, tile_end); inside it the epilogue selects −inf
    per element, outside it the fill warps write −inf: every element written exactly once.

Persistent CTAs.  One CTA an SM tabulates every token block's tile range and their prefix sums in
    shared memory (`block_tile_table`), then takes an equal share of the (token block, key tile)
    pairs (`table_share`): logits are per key, so no combine.  Q has two slots.

Warp roles (640 threads)
    warpgroup 4, warp 16    load: per block of the share its Q, then its K tiles into a
                            STAGES-slot TMA ring running on across blocks (setmaxnreg 24)
    warpgroup 4, warps 17-19  fill: −inf outside the tile ranges of blocks cta, cta + CTAs, …
    warpgroups 0 … 3        8 tokens a block, warpgroup w tokens 2w, 2w + 1; all read every
                            64-key K tile: MMA, then the fused epilogue (relu, × w, head sum,
                            × k_scale, range select, store; setmaxnreg 112).  The tensor core
                            serialises the four MMAs, so three epilogues run under the fourth's
                            MMA: each K tile read from L2 serves 8 tokens.
The MMA, loads, head sum and store are stages/common/indexer.py's.

Limits: s a multiple of BLOCK_Q, s_kv of BLOCK_K; the table within shared memory (s ≤ 34808 at
h 64, d 128); row-major, 16-byte aligned, static shapes."""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from stages.common import hang_guard
from stages.common.device import SMEM_LIMIT
from stages.common.device import sm_count as device_sm_count
from stages.common.indexer import (
    DIM,
    HEADS,
    LogitsOperands,
    block_tile_table,
    check_flat_shape,
    check_heads,
    check_logits,
    check_output,
    fill_outside,
    head_partial,
    head_weights,
    launch,
    load_key_tile,
    load_row_scales,
    q_rows,
    row_scale_regs,
    sm90_fragments,
    sm90_logits_mma,
    sm90_store_logits,
    start_cta,
    table_share,
    table_tiles,
    token_ranges,
)
from stages.common.inspection import expose
from stages.common.sm90_idioms import wgmma_sync
from stages.common.sm90_setup import TmaPipe, smem_struct, smem_tensors, tma_pipelines, tma_tiles
from stages.common.tma import sm90_tma_load


class Kernel:
    """FP8 MQA logits on Hopper: persistent CTAs on equal shares of the (8-token block, 64-key tile)
        pairs, 2 tokens an MMA warpgroup, the head sum fused after the MMA, −inf written by the kernel."""

    BLOCK_Q = 8  # query tokens a block: 2 per MMA warpgroup (N = 128 each)
    WG_Q = 2
    BLOCK_K = 64  # keys per tile = M of one warpgroup's MMA; every warpgroup reads every tile
    NUM_MMA_WG = 4
    LOAD_WG = NUM_MMA_WG
    LOAD_WARP = 4 * LOAD_WG
    MMA_THREADS = 128 * NUM_MMA_WG
    FILL_THREADS = 96  # the load warpgroup's other 3 warps
    THREADS = MMA_THREADS + 128
    # setmaxnreg: ptxas launches the 640 threads with 96 registers each; the load warpgroup's
    # decrease frees 128 · (96 − 24) = 9216, the MMA warpgroups' increase takes 512 · (112 − 96)
    # = 8192 of them (64 accumulator + 32 weight registers per thread)
    MMA_REGS = 112
    LOAD_REGS = 24
    STAGES = 8  # K slots of 8 KiB
    Q_SLOTS = 2  # Q blocks in shared memory: the current and the next

    def __init__(self, *, s: int, s_kv: int, heads: int = HEADS, head_dim: int = DIM, logits_dtype: str = "fp32",
                 compressed: bool = False):
        check_flat_shape("stage I1 sm90", s, s_kv, self.BLOCK_Q, self.BLOCK_K)
        check_heads("stage I1 sm90", heads, head_dim)
        self.out_dtype = check_logits("stage I1 sm90", logits_dtype)
        self.compressed = bool(compressed)  # logits [s, W] from ks (DeepGEMM's max_seqlen_k form)
        self.s, self.s_kv = s, s_kv
        self.heads, self.dim = heads, head_dim
        self.n = heads * self.WG_Q  # N of one warpgroup's MMA
        self.blocks = s // self.BLOCK_Q
        self.ctas = device_sm_count("sm_90a")
        # the Q slots, the K ring, the table (2 · blocks + 1 words; 1 KiB-aligned) and 1 KiB of barriers
        smem = (self.Q_SLOTS * self.BLOCK_Q * heads + self.STAGES * self.BLOCK_K) * head_dim
        smem += -(-4 * (2 * self.blocks + 1) // 1024) * 1024 + 1024
        if smem > SMEM_LIMIT:
            raise ValueError(f"stage I1 sm90: s = {s} needs {smem} B of shared memory (a table of its {self.blocks} "
                             f"token blocks beside Q and K), over the {SMEM_LIMIT} B an SM gives a CTA: split the "
                             "prefill into smaller chunks of tokens")

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
        s, bk, n = self.s, self.BLOCK_K, self.n
        check_output("stage I1 sm90", logits, self.out_dtype)
        self.width = logits.shape[1]  # s_kv, or W of the compressed form
        dtype = q.element_type
        mQ = q_rows(q, s * self.heads, self.dim)
        # Q: Q_SLOTS token blocks, a quarter of each per warpgroup (its B operand): slot q · W + w.
        mma, tile, k_smem, q_smem = sm90_logits_mma(dtype, bk, self.WG_Q, self.STAGES, self.Q_SLOTS * self.NUM_MMA_WG,
                                                    self.heads, self.dim)
        expose(self, qk_mma=(mma, tile), smem={"K": k_smem, "Q": q_smem})  # dsv4-lab inspect
        tma_q, tma_Q, q_half = sm90_tma_load(mQ, q_smem, (n, self.dim))
        tma_k, tma_K, k_bytes = sm90_tma_load(kv, k_smem, (bk, self.dim))
        warps = self.MMA_THREADS // 32  # every MMA warpgroup reads Q and every K slot
        self.pipes = (TmaPipe("q", self.Q_SLOTS, self.NUM_MMA_WG * q_half, warps),
                      TmaPipe("k", self.STAGES, k_bytes, warps))
        self.smem_struct = smem_struct(self.pipes, {"sQ": (dtype, q_smem), "sK": (dtype, k_smem),
                                                    "sTable": (cutlass.Int32, cute.make_layout(2 * self.blocks + 1))})
        ops = LogitsOperands(mma, tma_q, tma_Q, tma_k, tma_K, q_smem, k_smem)
        launch(self.kernel(ops, kv_scale, weights, ks, ke, logits), (self.ctas, 1, 1), self.THREADS, self.smem_struct,
               stream)

    @cute.kernel
    def kernel(self, ops: LogitsOperands, mScale: cute.Tensor, mW: cute.Tensor, mKs: cute.Tensor, mKe: cute.Tensor,
               mOut: cute.Tensor):
        bq, bk = self.BLOCK_Q, self.BLOCK_K
        tidx, warp_idx, storage = start_cta(ops, self.LOAD_WARP, self.smem_struct)
        launched, _, _ = cute.arch.block_idx()
        sQ, sK = smem_tensors(storage, sQ=ops.q_smem, sK=ops.k_smem)  # (n, d, slots), (bk, d, stages)
        q_pipe, k_pipe = tma_pipelines(storage, self.pipes)
        table = storage.sTable.get_tensor(cute.make_layout(2 * self.blocks + 1))
        block_tile_table(table, mKs, mKe, self.blocks, bq, self.s_kv, bk, tidx, self.THREADS, warp_idx)
        share = table_share(table, self.blocks, launched, self.ctas)
        if warp_idx // 4 == self.LOAD_WG:
            cute.arch.setmaxregister_decrease(self.LOAD_REGS)
            if warp_idx == self.LOAD_WARP:
                self.load(share, table, q_pipe, k_pipe, ops, sQ, sK)
            else:  # fill warps: −inf outside the tile ranges of blocks cta, cta + CTAs, …
                for i in cutlass.range(launched, self.blocks, self.ctas, unroll=1):
                    tb, tiles = table_tiles(table, self.blocks, i)
                    fill_outside(mOut, mKs, i, bq, tb, tb + tiles, bk, self.s_kv, self.width, self.compressed,
                                 tidx - self.MMA_THREADS - 32, self.FILL_THREADS)
        else:
            cute.arch.setmaxregister_increase(self.MMA_REGS)
            self.logits(share, table, tidx, q_pipe, k_pipe, ops.mma, sQ, sK, mScale, mW, mKs, mKe, mOut)

    @cute.jit
    def load(self, share, table, q_pipe, k_pipe, ops, sQ, sK):
        """Load warp: for each block of the share, its Q (one box a warpgroup) into the next Q
        slot, then its tiles of the share into the K ring."""
        hang_guard.role("load")  # names this role's waits in a --debug-hangs build
        W = self.NUM_MMA_WG
        q_load = tma_tiles(ops.tma_q, sQ, ops.mQ, (self.n, self.dim), (None, 0))
        k_load = tma_tiles(ops.tma_k, sK, ops.mK, (self.BLOCK_K, self.dim), (None, 0))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.Q_SLOTS)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.STAGES)
        block, first, left = share
        while left > 0:
            tb, tiles = table_tiles(table, self.blocks, block)
            take = cutlass.min(tiles - first, left)
            if take > 0:
                q_pipe.producer_acquire(q_state)
                for w in cutlass.range_constexpr(W):
                    cute.copy(q_load.atom, q_load.gmem[(None, block * W + w)], q_load.smem[(None, q_state.index * W + w)],
                              tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
                q_state.advance()
                for tile in cutlass.range(tb + first, tb + first + take, unroll=1):
                    load_key_tile(k_pipe, k_state, k_load, tile)
                    k_state.advance()
                left = left - take
            first = cutlass.Int32(0)
            block = block + 1

    @cute.jit
    def logits(self, share, table, tidx, q_pipe, k_pipe, mma, sQ, sK, mScale, mW, mKs, mKe, mOut):
        """MMA warpgroups, per block of the share: weights and ranges into registers, wait for its Q slot,
                then per tile Sᵀ = K_tile · Q_wᵀ and the fused epilogue (`sm90_store_logits`), −inf outside
                each token's [ks, ke); the Q slot freed after the block."""
        hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
        wq, bk, W = self.WG_Q, self.BLOCK_K, self.NUM_MMA_WG
        wg = tidx // 128
        tCrK, tCrQ, acc_shape, coords = sm90_fragments(mma, tidx % 128, sK, sQ, bk, self.n)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.Q_SLOTS)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.STAGES)
        sc = row_scale_regs(coords)
        block, first, left = share
        while left > 0:
            tb, tiles = table_tiles(table, self.blocks, block)
            take = cutlass.min(tiles - first, left)
            if take > 0:
                row0 = block * self.BLOCK_Q + wg * wq  # this warpgroup's first token
                w = head_weights(mW, coords, row0, self.heads)
                lo, hi = token_ranges(mKs, mKe, row0, wq)
                q_pipe.consumer_wait(q_state)
                for tile in cutlass.range(tb + first, tb + first + take, unroll=1):
                    # the tile's key scales: global loads in flight under the MMA, not in the epilogue
                    load_row_scales(sc, cute.local_tile(mScale, (bk,), (tile,)), coords)
                    k_pipe.consumer_wait(k_state)
                    acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
                    wgmma_sync(mma, acc, tCrK, tCrQ, a_slot=k_state.index, b_slot=q_state.index * W + wg,
                               zero_init=True)
                    k_pipe.consumer_release(k_state)
                    k_state.advance()
                    sm90_store_logits(mOut, row0, acc, coords, w, tile * bk, sc, lo, hi, tidx, self.head_partial, wq,
                                      compressed=self.width if self.compressed else None)
                q_pipe.consumer_release(q_state)
                q_state.advance()
                left = left - take
            first = cutlass.Int32(0)
            block = block + 1

    @cute.jit
    def head_partial(self, acc_rc, w, r: cutlass.Constexpr[int], first: cutlass.Constexpr[int],
                     count: cutlass.Constexpr[int]) -> cutlass.Float32:
        """A lane's share of Σ_h w[h] · relu(S[r, h]) over one token's heads
        (stages/common/indexer.py); a method so a test fixture can plant a bug here."""
        return head_partial(acc_rc, w, r, first, count)
