"""Stage E on Blackwell (sm_100a): DSV4 decode attention over an FP8 paged cache — sparse
indices, the main and the extra (SWA) key lists under one softmax, attention sink, split-KV.
tcgen05 MMAs with S and O in tensor memory, P through shared memory.

Compiled for sm_100a and inspected (PTX inventory, ptxas) only: it has never run on a
Blackwell GPU.  Do not call it verified.

Math and contract: oracles/sparse_decode.py (the same tensors, constructor keywords and
__call__ signature as stages/E_sparse_decode/sm90.py).  Per query row (batch, token, head):
    O = softmax(Q·Kᵀ · scale) · V · 1/(1 + exp(sink[h] − LSE)),  LSE = ln Σ exp(Q·Kᵀ · scale)
over the valid keys of both lists (position < the list's length, index ≠ −1), K = V = the
dequantised cache rows, scale = 1/sqrt(512); a row with no valid key: O = 0, LSE = +∞.

What is new in this rung (everything else is the sm100 decode house of D2–D5,
stages/common/sm100_decode.py: S double-buffered in TMEM, O split by columns over two CTAs at
d = 512, the KV-once chunk ring seen as K and as Vᵀ, the one-thread-per-row online softmax with
the lonely-row rule, split-KV + SplitCombine)

    One token per CTA.  The two tokens of a sequence attend DIFFERENT key lists, so tokens
        cannot fold into M as in D2: the house runs over b·s_q "sequences" of one token each
        (DecodeShape(b·s_q, 1, h_q, …) — the same bytes of Q and O), h_q ≤ 128 rows per CTA
        (h_q = 64 leaves rows 64 … 127 as TMA zero padding, never stored), and the LSE views
        are re-indexed so flat row (b·s_q + t)·h_q + h lands at LSE[b, h, t].
    The key list replaces the TMA of KV.  The tile space is the main list's 64-key tiles, then
        the extra list's; a CTA visits the tiles of its split that hold a position below the
        list's length (scheduler.visit_tiles).  Dequantisation warps (warps 5 … 8, 128 threads;
        warp 5 first issues Q's TMA) gather the indexed rows with 16-byte global loads and write
        bf16 into the ring's K-major 128-byte-swizzled chunk slots, through a (key, column, slot)
        view of the ring proven at trace time to address exactly the MMA's operand bytes
        (`check_key_col_view`).  Per chunk of 64 keys × 128 columns: thread p writes key
        p // 8 + 16 r (r = 0 … 3), columns 16 (p mod 8) … + 15; the four keys' loads are all
        issued before any is converted.  An invalid key is never loaded (past the length the
        list may hold INT_MAX): its row is written as zeros.  Then fence.proxy.async (generic
        writes → the tensor core's async proxy) and a PipelineAsyncUmma arrive (128 threads →
        the MMA warp, whose release is tcgen05.commit: "slot free" once the MMAs that read it
        completed).  Scales per format (oracles/kvcache.py): simple — the token's fp32;
        model1 — e8m0 byte col // 64 of the token's 7 (columns 448 … 511: bf16 rope as stored);
        v4.1 — e8m0 byte col // 32 of 16.  e8m0 → fp32 moves the byte into the exponent field.
    The key mask.  With each tile the dequantisation threads publish 64 flags (0 or −∞) in a
        2-slot shared-memory mask ring (a PipelineAsync: 128 producer threads → 128 softmax
        threads, each of which releases it); each softmax thread adds them to its row's scores
        before the row max (invalid keys → −∞, the V rows are zeros, so P·V never meets a NaN).
    Sink: the house's row_scale hook with one split; SplitCombine applies it after the merge.

Why not TMA gather4 (cp.async.bulk.tensor.2d.tile::gather4, CuTeDSL 4.8.1's
CopyBulkTensor2DGather4G2SOp) yet: gather4 addresses rows of ONE 2-D tensor map (uniform row
stride, ≤ 256 elements per box row), its row coordinates read from a global index tensor.  The
`simple` and `model1` blocks are not a uniform row array (per-block scale planes, block padding
to 16 / 576 bytes), so a token's row is not `index · stride` of any 2-D view; v4.1 is (528-byte
rows, a multiple of 16) and is where gather4 fits — with −1 / past-length entries turned into
out-of-range rows (zero-filled) first, the raw e4m3 rows land in shared memory and these same
warps dequantise from there.  Probed on this CPU (not in this kernel): make_tiled_tma_atom with
CopyBulkTensor2DGather4G2SOp over a (512, rows) view of a v4.1 cache with idx as the coordinate
tensor builds and emits `cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4`, but
tma_partition of a plain (128 B × 64 rows) staging tile gave every instruction ONE index four
times (coordinate-tensor mode (512, 1) with strides (0, 0)); issuing the instruction with four
register row ids (as FlashMLA does) needs the descriptor address from CuTeDSL internals.  Also,
the shared memory is full: Q 128 KiB + 5 ring slots + P = 225 KiB of 227, so a raw staging tile
(64 × 528 B) costs two ring slots.  That, and sharing the dequantised tiles of the o_split CTA pair
(each dequantises all 512 columns of every tile here, only to use half as V), are what is left.

FlashMLA's sm100 sparse FP8 decode (github deepseek-ai/FlashMLA csrc/sm100/decode/sparse_fp8,
read, not copied) is the production shape of the same plan: a 2-CTA cluster of 64-head CTAs; the
raw e4m3 rows arrive by TMA gather4 from a 2-D tensor map over ALL cache tokens (uniform row
stride: its layout keeps each token's scales inline), 4 register indices per instruction, −1
replaced by a dummy row and a group of 4 invalid rows skipped; each CTA's producer warpgroup
dequantises HALF the columns and writes them into its own and the peer's shared memory
(st.async, completing a transaction count on the peer's barrier); a warp publishes the tile's
validity bits through a ready / free barrier pair (the key-mask ring here).  This kernel keeps
the house's one-CTA 128-row tiles and 16-byte loads instead.

Warp roles (288 threads)
    warps 0-3   softmax: house (S from TMEM, key mask, P → SMEM, O rescale, epilogue)
    warp 4      MMA: house (Q·Kᵀ chunk by chunk, P·V of this CTA's half)
    warps 5-8   Q by TMA (warp 5), then gather + dequantise every visited tile into the ring
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.cute.nvgpu import tcgen05
from cutlass.memory import TmemAllocator

from oracles.sparse_decode import SparseConfig
from stages.common.barriers import NamedBarrier
from stages.common.combine import SplitCombine, sink_factor
from stages.common.scheduler import DecodeShape, valid_tiles, visit_tiles
from stages.common.sm100_decode import (
    B200_SMS,
    KV_TILE,
    ROWS,
    SMEM_LIMIT,
    DecodeSm100,
    _TmemPlan,
)
from stages.common.sm100_idioms import (
    check_same_fragment_coords,
    check_smem_p,
    fragment_coords,
    mk_view,
    threads_to_umma_pipeline,
    tma_umma_pipeline,
    tmem_allocate,
    tmem_copy,
    tmem_free,
    tcgen05_fence_before_sync,
    umma_to_threads_pipeline,
)
from stages.common.tma import prefetch_descriptors, tma_partition_tile
from stages.E_sparse_decode.sm90 import (
    _convert16,
    _e8m0_to_f32,
    _load16,
    _load_f32,
    _load_u8,
    cache_block_bytes,
)

BF16 = cutlass.BFloat16
F32 = cutlass.Float32
D = 512
PIECE = 16  # columns one thread dequantises per key (16 e4m3 = one 16-byte load)
MASK_SLOTS = 2


def check_key_col_view(kw_smem, k_smem, k_coords) -> int:
    """Trace-time proof that the dequantisers' (key, col, slot) view `kw_smem` of the ring and
    the MMA's K operand layout `k_smem` (k_coords: (key, col) of each index of a slot, partitioned
    like the B operand) give every element of a slot the same offset before the (shared)
    swizzle, and the same slot stride.  Returns the elements compared; raises ValueError
    naming the first mismatch."""
    if str(kw_smem.inner) != str(k_smem.inner):
        raise ValueError(f"K write view: swizzles differ ({kw_smem.inner} vs {k_smem.inner})")
    k_one = cute.select(k_smem.outer, mode=[0, 1, 2])
    slots = cute.size(kw_smem.outer, mode=[2])
    if slots > 1 and kw_smem.outer((0, 0, 1)) != cute.select(k_smem.outer, mode=[3])(1):
        raise ValueError("K write view: the ring slots are a different stride apart")
    coords = fragment_coords(k_coords)
    for i in range(cute.size(k_coords)):
        key, col = coords[i]
        if kw_smem.outer((key, col, 0)) != k_one(i):
            raise ValueError(f"K write view: key {key}, column {col} is at {kw_smem.outer((key, col, 0))}, "
                             f"the MMA reads it at {k_one(i)}")
    return cute.size(k_coords)


class SparseKeys:
    """The tiles one CTA visits (a plain object of traced values; its methods are called only
    through the kernel's own methods, never inside a staged loop or `if` of the caller):
    n_first main-list tiles from first_begin, then n_local − n_first extra-list tiles from
    second_begin.  masked: the softmax threads apply the published key mask (mask())."""

    masked = True

    def __init__(self, plan, mask_pipe, s_mask):
        self.n_local, self.n_first, self.first_begin, self.second_begin = plan
        self.mask_pipe = mask_pipe
        self.s_mask = s_mask

    def atoms(self):
        return ()

    def clean_v(self, j, lines, slot):
        """Nothing to clean: an invalid key's row is written as zeros by the dequantisers."""

    @cute.jit
    def mask(self, j, rS, key_cols: cutlass.Constexpr, token):
        """Softmax thread: wait for tile j's flags, add them to its row's scores (register i
        holds key column key_cols[i], the house's trace-time map), release the mask slot."""
        st = pipeline.PipelineState(MASK_SLOTS, j, j % MASK_SLOTS, (j // MASK_SLOTS) % 2)
        self.mask_pipe.consumer_wait(st)
        for i in cutlass.range_constexpr(cute.size(rS)):
            rS[i] = rS[i] + self.s_mask[key_cols[i], st.index]
        self.mask_pipe.consumer_release(st)


class Kernel(DecodeSm100):
    """FP8 paged sparse decode on Blackwell: dequantisation warps fill the house's chunk ring,
    tcgen05 MMAs, one softmax over both lists, sink, split-KV (see the module doc).  Options
    beyond the stage's axes: o_split, s_stages, sm_count (DecodeSm100); an impossible TMEM plan
    raises ValueError("TMEM budget: …") here and again at trace time."""

    NAME = "stage E sm100"
    DEQUANT_WARPS = (5, 6, 7, 8)
    DEQUANT_THREADS = 32 * 4
    THREADS = 32 * 9

    def __init__(self, *, b: int, config: str, kv_format: str, splits, sm_count: int = B200_SMS,
                 o_split: int | None = None, s_stages: int = 2):
        c = SparseConfig.parse(config)
        if c.h_q > ROWS:
            raise ValueError(f"{self.NAME}: h_q ≤ {ROWS} (one token's heads per CTA), got {c.h_q}")
        self.c, self.fmt, self.b_real = c, kv_format, b
        self.block_bytes = cache_block_bytes(kv_format, c.block)
        self.extra_block_bytes = cache_block_bytes(kv_format, c.extra_block if c.has_extra else 1)
        self.main_tiles = -(-c.topk // KV_TILE)
        self.extra_tiles = -(-c.extra_topk // KV_TILE) if c.has_extra else 0
        tiles = self.main_tiles + self.extra_tiles
        n = tiles * KV_TILE
        self.setup_plan(DecodeShape(b * c.s_q, 1, c.h_q, n, D, n), splits, sm_count, o_split, s_stages, n_tiles=tiles)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, Q: cute.Tensor, KV: cute.Tensor, idx: cute.Tensor, topk_length: cute.Tensor,
                 KV_extra: cute.Tensor, idx_extra: cute.Tensor, extra_length: cute.Tensor, sink: cute.Tensor,
                 O: cute.Tensor, LSE: cute.Tensor, O_part: cute.Tensor, LSE_part: cute.Tensor,
                 stream: cuda.CUstream):
        self._check_sparse_tensors(Q, KV, idx, KV_extra, idx_extra, O, LSE, O_part, LSE_part)
        v, ops, tma_q, tma_Q = self.prepare(Q, O, LSE, O_part, LSE_part)
        qk_mma, pv_mma, q_smem, k_smem, v_smem, p_smem = ops
        kw_smem = self.key_col_layout(qk_mma, pv_mma, k_smem)
        launch_call = self.kernel(qk_mma, pv_mma, tma_q, tma_Q, KV, idx, topk_length, KV_extra, idx_extra,
                                  extra_length, sink, v.eO, v.mLSE, v.eOp, v.mLp, q_smem, k_smem, v_smem, p_smem,
                                  kw_smem)
        launch_call.launch(grid=self.launch_grid(), block=(self.THREADS, 1, 1), stream=stream, min_blocks_per_mp=1)
        if cutlass.const_expr(self.splits > 1):
            SplitCombine(v.all_rows, self.splits, D, sink_heads=self.c.h_q).launch(
                v.mOp, v.mLp, v.mO, v.mLSE, stream, sink=sink)

    def host_views(self, Q, O, LSE, O_part, LSE_part):
        """The house's views over b·s_q one-token sequences; LSE [b, h_q, s_q] re-indexed so
        flat row (b·s_q + t)·h_q + h is LSE[b, h, t] (shape (h_q, s_q, b), colexicographic)."""
        v = super().host_views(Q, O, LSE, O_part, LSE_part)
        c, b = self.c, self.b_real
        v.mLSE = cute.make_tensor(LSE.iterator, cute.make_layout((c.h_q, c.s_q, b), stride=(c.s_q, 1, c.h_q * c.s_q)))
        return v

    def key_col_layout(self, qk_mma, pv_mma, k_smem):
        """The dequantisers' (key, col, slot) view of the ring: the K-major 128-byte-swizzle
        atom tiled keys first — proven to be the MMA's bytes (check_key_col_view)."""
        atom = tcgen05.make_smem_layout_atom(tcgen05.SmemLayoutAtomKind.K_SW128, BF16)
        kw = cute.tile_to_shape(atom, (KV_TILE, self.chunk, self.slots), order=(0, 1, 2))
        k_coords, _ = self.kv_coords(qk_mma, pv_mma)
        check_key_col_view(kw, k_smem, k_coords)
        return kw

    def _check_sparse_tensors(self, Q, KV, idx, KV_extra, idx_extra, O, LSE, O_part, LSE_part) -> None:
        """Trace time: the case's shapes (cache block sizes in bytes included); "auto" splits
        capped to the scratch's capacity, a forced count must fit."""
        c, b = self.c, self.b_real
        want = {"Q": (Q, (b, c.s_q, c.h_q, D)), "idx": (idx, (b, c.s_q, c.topk)),
                "O": (O, (b, c.s_q, c.h_q, D)), "LSE": (LSE, (b, c.h_q, c.s_q)),
                "O_part": (O_part, (O_part.shape[0], b, c.s_q, c.h_q, D)),
                "LSE_part": (LSE_part, (O_part.shape[0], b, c.s_q, c.h_q))}
        if c.has_extra:
            want["idx_extra"] = (idx_extra, (b, c.s_q, c.extra_topk))
        for name, (t, shape) in want.items():
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{self.NAME}: {name} has shape {tuple(t.shape)}, the case needs {tuple(shape)}")
        if KV.shape[1] != self.block_bytes or (c.has_extra and KV_extra.shape[1] != self.extra_block_bytes):
            raise ValueError(f"{self.NAME}: {self.fmt} blocks of {c.block} / {c.extra_block} tokens are "
                             f"{self.block_bytes} / {self.extra_block_bytes} bytes; the caches have "
                             f"{KV.shape[1]} / {KV_extra.shape[1]}")
        cap = O_part.shape[0]
        if self.splits > cap:
            if self.splits_axis != "auto":
                raise ValueError(f"{self.NAME}: {self.splits} splits need a scratch of ≥ {self.splits} partials, "
                                 f"it holds {cap}")
            self.splits = cap
            self._set_grid()

    def _smem_struct(self, q_smem, k_smem, p_smem):
        """The house's storage plus the key-mask ring (2 × 64 fp32) and its barriers."""
        slots, s_stages = self.slots, self.s_stages

        @cute.struct
        class Smem:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * slots]
            s_mbar: cute.struct.MemRange[cutlass.Int64, 2 * s_stages]
            p_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            o_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            mask_mbar: cute.struct.MemRange[cutlass.Int64, 2 * MASK_SLOTS]
            tmem_addr: cutlass.Int32
            key_mask: cute.struct.Align[cute.struct.MemRange[F32, KV_TILE * MASK_SLOTS], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(q_smem.outer)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(k_smem.outer)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[BF16, cute.cosize(p_smem.outer)], 1024]

        size = int(Smem.size_in_bytes())
        if size > SMEM_LIMIT:
            raise ValueError(f"SMEM budget: the shared-storage struct takes {size} bytes > {SMEM_LIMIT}")
        return Smem

    def has_row_scale(self) -> bool:
        """The sink in the epilogue with one split; with split-KV the combine applies it."""
        return self.splits == 1

    def row_scale(self, lse, row, batch, sink):
        """The sink's factor on a final row.  Row = head: one token per CTA."""
        return sink_factor(sink[row % self.c.h_q], lse)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_q: cute.CopyAtom, mQ: cute.Tensor,
               KV: cute.Tensor, idx: cute.Tensor, topk_length: cute.Tensor, KV_extra: cute.Tensor,
               idx_extra: cute.Tensor, extra_length: cute.Tensor, sink: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mOp: cute.Tensor, mLSEp: cute.Tensor, q_smem: cute.ComposedLayout,
               k_smem: cute.ComposedLayout, v_smem: cute.ComposedLayout, p_smem: cute.ComposedLayout,
               kw_smem: cute.ComposedLayout):
        c = self.c
        bx, split, seq = cute.arch.block_idx()
        work = self.sched.work(bx // self.o_split, split, seq)
        batch = seq // c.s_q
        main_len = cutlass.max(cutlass.min(topk_length[batch], c.topk), 0)
        extra_len = cutlass.Int32(0)
        if cutlass.const_expr(c.has_extra):
            extra_len = cutlass.max(cutlass.min(extra_length[batch], c.extra_topk), 0)
        plan = visit_tiles(work.tile_begin, work.tile_end, self.main_tiles, valid_tiles(main_len, KV_TILE),
                           valid_tiles(extra_len, KV_TILE))
        lists = (KV, idx, main_len, KV_extra, idx_extra, extra_len)
        self.attend_sparse(plan, lists, work.token, split, seq, qk_mma, pv_mma, tma_q, mQ, mO, mLSE, mOp, mLSEp,
                           q_smem, k_smem, v_smem, p_smem, kw_smem, sink)

    @cute.jit
    def attend_sparse(self, plan, lists, rb, split, seq, qk_mma, pv_mma, tma_q, mQ, mO, mLSE, mOp, mLSEp,
                      q_smem, k_smem, v_smem, p_smem, kw_smem, sink):
        """The house's `attend` with the dequantisers in place of the KV TMA: the same shared
        memory (plus the mask ring), pipelines (the kv ring a PipelineAsyncUmma of 128 threads),
        TMEM plan and its trace-time check, fragments and agreement checks; then the roles."""
        tidx, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        half = bx % self.o_split
        shift = ((half + 1) * self.n_v) % self.n_chunks  # this CTA's V chunks last (house rule)
        if warp_idx == self.DEQUANT_WARPS[0]:
            prefetch_descriptors(tma_q)

        storage = utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)
        sK = storage.sKV.get_tensor(k_smem.outer, swizzle=k_smem.inner)
        sV = storage.sKV.get_tensor(v_smem.outer, swizzle=v_smem.inner)
        sKw = storage.sKV.get_tensor(kw_smem.outer, swizzle=kw_smem.inner)  # (key, col, slot): the same bytes
        sP = storage.sP.get_tensor(p_smem.outer, swizzle=p_smem.inner)
        s_mask = storage.key_mask.get_tensor(cute.make_layout((KV_TILE, MASK_SLOTS)))

        q_prod, q_cons = tma_umma_pipeline(storage.q_mbar, 1, self.q_bytes)
        kv_pipe = pipeline.PipelineAsyncUmma.create(
            num_stages=self.slots,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.DEQUANT_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            barrier_storage=storage.kv_mbar.data_ptr(),
        )
        mask_pipe = pipeline.PipelineAsync.create(
            num_stages=MASK_SLOTS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.DEQUANT_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.SOFTMAX_THREADS),
            barrier_storage=storage.mask_mbar.data_ptr(),
        )
        s_prod, s_cons = umma_to_threads_pipeline(storage.s_mbar, self.SOFTMAX_THREADS, self.s_stages)
        p_prod, p_cons = threads_to_umma_pipeline(storage.p_mbar, self.SOFTMAX_THREADS)
        o_prod, o_cons = umma_to_threads_pipeline(storage.o_mbar, self.SOFTMAX_THREADS)
        tmem_alloc = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_ALLOC),
                                                       num_threads=self.THREADS),
            allocator_warp_id=self.SOFTMAX_WARPS[0],
        )
        softmax_sync = pipeline.NamedBarrier(barrier_id=int(NamedBarrier.TMEM_FREE), num_threads=self.SOFTMAX_THREADS)
        keys = SparseKeys(plan, mask_pipe, s_mask)

        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrQ = qk_mma.make_fragment_A(sQ)
        tSrK = qk_mma.make_fragment_B(sK)
        tOrV = pv_mma.make_fragment_B(sV)
        tOrP = pv_mma.make_fragment_A(sP)[None, None, None, 0]
        gQ = cute.flat_divide(mQ, cute.select(self.q_tiler, mode=[0, 2]))
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, qk_thr.partition_A(gQ), 3)
        tQgQ = tQgQ[None, rb, 0, seq]

        s_mn = (ROWS, KV_TILE)
        o_mn = (ROWS, self.d_cta)
        tplan = _TmemPlan(qk_mma, pv_mma, s_mn, o_mn, (ROWS, self.chunk), self.s_stages)
        self._check_tmem_plan(tplan)  # ValueError("TMEM budget: …") when over 512 columns
        tmem_ptr = tmem_allocate(tmem_alloc, tplan.alloc_cols)
        tOtO = cute.make_tensor(tmem_ptr + tplan.o_col, tplan.o_layout)
        o_tiles = [cute.make_tensor(tmem_ptr + tplan.o_col + t * tplan.o_sub_cols, tplan.o_sub_layout)
                   for t in range(self.n_v)]
        tS_src0 = cute.make_tensor(tmem_ptr, tplan.s_layout)[(None, None), 0, 0]
        cS = qk_thr.partition_C(cute.make_identity_tensor(s_mn))[(None, None), 0, 0]
        cA = pv_thr.partition_A(cute.make_identity_tensor(s_mn))
        s_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tS_src0)
        p_copy = cute.make_tiled_copy_D(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BF16, num_bits_per_copy=128),
                                        s_load)
        sP_mk = mk_view(sP[None, None, None, 0])
        check_smem_p(s_load, cS, p_copy, cA, ROWS, KV_TILE)
        o_load = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        o_store = tmem_copy(tcgen05.St32x32bOp, tcgen05.Repetition.x32, F32, tOtO)
        cO = pv_thr.partition_C(cute.make_identity_tensor(o_mn))
        check_same_fragment_coords(o_load, cO, o_store, cO, "O rescale")
        gO = None
        if cutlass.const_expr(self.splits == 1):
            gO = mO[None, None, half, rb, seq]
        else:
            gO = mOp[None, None, half, rb, seq, split]
        tOgO = pv_thr.partition_C(gO)

        # ======================= roles =======================
        if warp_idx >= self.DEQUANT_WARPS[0]:
            self.dequant_role(q_prod, kv_pipe, mask_pipe, tma_q, tQgQ, tQsQ, sKw, s_mask, plan, lists, seq, shift,
                              tidx - 32 * self.DEQUANT_WARPS[0], warp_idx)
        if warp_idx == self.MMA_WARP:
            self.mma_role(q_cons, kv_pipe, s_prod, p_cons, o_prod, qk_mma, pv_mma, tSrQ, tSrK, tOrV, tOrP,
                          tmem_ptr, tplan.s_cols, tplan.s_layout, o_tiles, keys, None, shift)
        if warp_idx < self.MMA_WARP:
            self.softmax_role(s_cons, p_prod, o_cons, tOgO, s_load, p_copy, o_load, o_store, tmem_ptr, tplan.s_cols,
                              tplan.s_layout, tOtO, cS, cO, sP_mk, mLSE, mLSEp, tidx, rb, half, split, seq, keys,
                              sink)
            tcgen05_fence_before_sync()
            tmem_free(tmem_alloc, tmem_ptr, tplan.alloc_cols, softmax_sync)

    # ---- the dequantisation warps
    @cute.jit
    def dequant_role(self, q_prod, kv_pipe, mask_pipe, tma_q, tQgQ, tQsQ, sKw, s_mask, plan, lists, seq, shift,
                     ptid, warp_idx):
        """Warps 5-8 (`ptid` 0 … 127): Q once (warp 5, TMA); then per visited tile its 64 keys'
        indices (4 per thread), the mask flags, and the tile's chunks in the house's load order,
        each into the next ring slot (see the module doc)."""
        c = self.c
        if warp_idx == self.DEQUANT_WARPS[0]:
            q_slot = q_prod.acquire_and_advance()
            cute.copy(tma_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=q_slot.barrier)
        n_local, n_first, first_begin, second_begin = plan
        KV, idx, main_len, KV_extra, idx_extra, extra_len = lists
        batch = seq // c.s_q
        token = seq % c.s_q
        row = ptid // 8  # keys row, row + 16, row + 32, row + 48 of each tile
        piece = ptid % 8  # columns 16·piece … + 15 of each chunk
        for j in cutlass.range(n_local, unroll=1):
            second = j >= n_first
            tile = cutlass.Int32(cutlass.select_(second, second_begin + j - n_first, first_begin + j))
            index = cute.make_rmem_tensor(4, cutlass.Int32)
            if second:
                if cutlass.const_expr(c.has_extra):
                    self.key_indices(idx_extra, batch, token, tile, extra_len, c.extra_topk, row, index)
            else:
                self.key_indices(idx, batch, token, tile, main_len, c.topk, row, index)
            m_state = pipeline.PipelineState(MASK_SLOTS, j, j % MASK_SLOTS, ((j // MASK_SLOTS) % 2) ^ 1)
            mask_pipe.producer_acquire(m_state)
            if piece == 0:
                for r in cutlass.range_constexpr(4):
                    s_mask[row + 16 * r, m_state.index] = F32(0.0) if index[r] != -1 else -F32.inf
            mask_pipe.producer_commit(m_state)
            for p in cutlass.range_constexpr(self.n_chunks):
                st = self._ring_state(j * self.n_chunks + p, True)
                kv_pipe.producer_acquire(st)
                col0 = ((p + shift) % self.n_chunks) * self.chunk + PIECE * piece
                dst = sKw[None, None, st.index]
                if second:
                    if cutlass.const_expr(c.has_extra):
                        self.fill_piece(KV_extra, c.extra_block, self.extra_block_bytes, index, col0, row, piece, dst)
                else:
                    self.fill_piece(KV, c.block, self.block_bytes, index, col0, row, piece, dst)
                cute.arch.fence_view_async_shared()  # generic smem writes → the MMA's async proxy
                kv_pipe.producer_commit(st)
        g_end = n_local * self.n_chunks  # wait for the MMA warp's last releases before exit
        for i in cutlass.range_constexpr(self.slots):
            kv_pipe.producer_acquire(self._ring_state(g_end + i, True))
        if warp_idx == self.DEQUANT_WARPS[0]:
            q_prod.tail()

    @cute.jit
    def key_indices(self, idx, batch, token, tile, length, topk: cutlass.Constexpr[int], row, index):
        """index[r] ← the cache index of list position 64·tile + row + 16 r, or −1 when the key
        is invalid (position ≥ length, or −1 in the list).  The read is clamped into the list:
        a padded tail position never reads past it, and past the length nothing read is used."""
        for r in cutlass.range_constexpr(4):
            pos = tile * KV_TILE + row + 16 * r
            got = idx[batch, token, cutlass.min(pos, topk - 1)]
            index[r] = cutlass.Int32(-1)
            if pos < length:
                index[r] = got

    @cute.jit
    def fill_piece(self, cache, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int], index,
                   col0, row, piece, dst):
        """Columns col0 … col0 + 15 of this thread's 4 keys into the ring slot view `dst`
        (key, col): the 4 loads issued first, then converted (× scale → bf16) and stored;
        an invalid key (index −1) is not loaded and its piece is zeros."""
        base = cache.iterator.toint()
        raw = cute.make_rmem_tensor((8, 4), cutlass.Int32)
        raw.fill(0)
        scale = cute.make_rmem_tensor(4, F32)
        scale.fill(0.0)
        for r in cutlass.range_constexpr(4):
            if index[r] != -1:
                scale[r] = self.load_piece(base, index[r], block_size, block_bytes, col0, raw[None, r])
        for r in cutlass.range_constexpr(4):
            vals = cute.make_rmem_tensor(PIECE, BF16)
            self.convert_piece(raw[None, r], scale[r], col0, vals)
            cute.autovec_copy(vals, cute.local_tile(dst, (1, PIECE), (row + 16 * r, piece))[0, None])

    @cute.jit
    def load_piece(self, base, index, block_size: cutlass.Constexpr[int], block_bytes: cutlass.Constexpr[int],
                   col0, raw) -> cutlass.Float32:
        """Issue the loads of token `index`, columns col0 … col0 + 15, into raw (8 Int32): 16
        e4m3 bytes (raw[0:4]) — or model1's rope, 16 bf16 (raw[0:8]) — and return their scale."""
        blk = cutlass.Int64(index // block_size)
        off = cutlass.Int64(index % block_size)
        block = base + blk * block_bytes
        scale = F32(1.0)
        if cutlass.const_expr(self.fmt == "simple"):
            scale = _load_f32(block + block_size * D + off * 4)
            _load16(block + off * D + col0, raw, 0)
        elif cutlass.const_expr(self.fmt == "model1"):
            token = block + off * 576
            if col0 < 448:
                scale = _e8m0_to_f32(_load_u8(block + block_size * 576 + off * 8 + col0 // 64))
                _load16(token + col0, raw, 0)
            else:  # the rope: bf16 as stored, 2 bytes a column
                _load16(token + 448 + (col0 - 448) * 2, raw, 0)
                _load16(token + 448 + (col0 - 448) * 2 + 16, raw, 4)
        else:
            token = block + off * 528
            scale = _e8m0_to_f32(_load_u8(token + D + col0 // 32))
            _load16(token + col0, raw, 0)
        return scale

    @cute.jit
    def convert_piece(self, raw, scale, col0, vals):
        """vals (16 bf16) ← raw: 16 e4m3 × scale (fp32 math), or model1's rope as it is."""
        if cutlass.const_expr(self.fmt == "model1"):
            if col0 < 448:
                _convert16(raw, scale, vals)
            else:
                vals.store(cute.recast_tensor(raw, BF16).load())
        else:
            _convert16(raw, scale, vals)
