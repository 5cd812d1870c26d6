"""Stage D2 on Hopper (sm_90a): DSV4 decode attention — batches, tokens, MQA head packing,
split-KV with an LSE combine.

Math (stage D1's, per query row):  O = softmax(Q·Kᵀ · scale) · V,  LSE = ln Σ exp(Q·Kᵀ · scale),
scale = 1/sqrt(d), with DSV4's tensors: Q [b, s_q, h_q, d], KV [b, n_alloc, d] (ONE latent head:
K = V = KV, first n rows attended), O [b, s_q, h_q, d] bf16, LSE [b, h_q, s_q] fp32.  The online
softmax is stages/common/softmax.py (lonely-row rule included).

What is new in this rung
    Head packing.  All h_q heads of a token share the one KV head, so the 64 heads of one
        (batch, token) are the 64 rows (M) of a CTA's MMAs: Q and O are viewed as
        [b · s_q · h_q, d] row blocks of 64 rows — one contiguous TMA box each.
    Grid and split-KV.  stages/common/scheduler.py: grid (h_q/64 · s_q, splits, b), each CTA
        one row block × one KV split [tile_begin, tile_end).  With one split the CTA writes O
        and LSE; with several it writes fp32 partial O (normalised) and partial LSE into the
        scratch tensors, and a second launch (stages/common/combine.py) merges them by LSE.
        An empty split writes LSE = −∞ and O = 0, and the combine ignores it.
    K = V, read once.  One TMA load per KV tile into one shared-memory slot.  Q·Kᵀ reads it as
        the K-major B operand (keys × d); P·V reads THE SAME BYTES as Vᵀ (d × keys), the
        MN-major B operand.  Both layouts use the swizzle atom of one warpgroup's O slice
        (d/2 columns) and tile keys first; `_kv_layouts` builds both and proves at trace time
        that they address the same element at every swizzle row and mode boundary.
    NaN beyond n.  The TMA tensor of KV has extent n (not n_alloc) along the keys, and the
        scheduler never asks for a tile past n: a row ≥ n is never loaded (and would read as
        zeros if a box ever crossed it).

Warp roles (384 threads)
    warpgroup 2       load (its first warp): Q once, then the split's KV tiles into a 2-slot
                      TMA pipeline; setmaxnreg gives its registers to the MMA warpgroups
                      (24 here, 240 each there)
    warpgroup 0       S = Q·K_tileᵀ (m64 n{block_n}), online softmax, P → shared memory
                      (stmatrix, K-major A operand), α per row; then its half of O += P·V
    warpgroup 1       waits for P (named barrier P_FULL), its half of O += P·V, frees P
                      (P_EMPTY); O's d columns are split over the two warpgroups (d/2 each:
                      at d = 512 a 64 × 256 fp32 half is 128 registers per thread)
    epilogue          both warpgroups: O / ℓ → bf16 O (one split) or fp32 O_part, and LSE.
    A KV slot is released when both warpgroups' P·V on it has completed (8 consumer warps).
    The roles are separate methods so a later step can rebalance registers (setmaxnreg) and
    deepen the pipeline without touching the math.

Tiles and shared memory
      d     block_n   slots   Q + 2 KV slots + P                         ≈ dynamic smem
      64      128       2     8 + 2·16 + 16 KiB                            57 KiB
      128     128       2     16 + 2·32 + 16 KiB                           97 KiB
      256     128       2     32 + 2·64 + 16 KiB                          177 KiB
      512      64       2     64 + 2·64 +  8 KiB                          201 KiB

Limits: h_q a multiple of 64; d ∈ {64, 128, 256, 512}; n a multiple of block_n; splits ≤ the
scratch capacity (oracles/decode.py); static shapes, row-major, 16-byte aligned.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warp, warpgroup

from stages.common.barriers import NamedBarrier
from stages.common.combine import SplitCombine
from stages.common.inspection import expose
from stages.common.scheduler import SM_COUNT, DecodeGrid, DecodeShape, resolve_splits
from stages.common.sm90_idioms import acc_rows_cols, tma_pipeline, wgmma_sync
from stages.common.softmax import OnlineSoftmax, final_lse, scale_rows
from stages.common.tma import prefetch_descriptors, sm90_tma_load, tma_partition_tile

_SMEM_LIMIT = 227 * 1024  # Hopper: largest dynamic shared memory per CTA


def _same_bytes_samples(block_n: int, d: int, slice_n: int, stages: int):
    """(key, col, slot) points where the K and Vᵀ views are compared: every row of the 8-row
    swizzle pattern and the key mode's boundaries, times the column boundaries of the
    swizzle atom, of a warpgroup slice and of the tile, in the first and last slot."""
    keys = sorted({*range(8), 8, 9, block_n // 2, block_n - 1})
    cols = sorted({c for c in (0, 1, 7, 8, 15, 16, 31, 32, 63, 64, slice_n - 1, slice_n, slice_n + 1, d - 1) if c < d})
    slots = sorted({0, stages - 1})
    return [(k, c, s) for s in slots for k in keys for c in cols]


def check_same_bytes(k_layout, vt_layout, block_n: int, d: int, slice_n: int, stages: int) -> None:
    """Trace-time proof that Vᵀ(col, key, slot) and K(key, col, slot) are the same element
    of the KV slot buffer (sampled; see `_same_bytes_samples`).  Plain Python: the
    layouts are static, so each evaluation is an int."""
    for key, col, slot in _same_bytes_samples(block_n, d, slice_n, stages):
        a, b = k_layout((key, col, slot)), vt_layout((col, key, slot))
        if a != b:
            raise ValueError(
                f"stage D2 sm90: the V view of the KV tile is not K's bytes: K(key={key}, col={col}, slot={slot}) "
                f"= {a}, Vᵀ(col, key, slot) = {b}"
            )


def _kv_layouts(dtype, d: int, block_n: int, stages: int, slice_n: int):
    """Shared-memory layouts of the KV slots, seen two ways (same bytes):
        K   (block_n, d, stages)  K-major B operand of S = Q·Kᵀ
        Vᵀ  (d, block_n, stages)  MN-major B operand of O = P·V
    The swizzle atom is chosen from ONE warpgroup's O slice (slice_n columns) so each
    slice starts on an atom boundary (a valid wgmma descriptor on its own); both views
    tile keys first, so an atom holds 8 keys × (atom width) columns in either view."""
    k_kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, slice_n)
    v_kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.COL_MAJOR, dtype, slice_n)
    k_layout = cute.tile_to_shape(warpgroup.make_smem_layout_atom(k_kind, dtype), (block_n, d, stages), order=(0, 1, 2))
    vt_layout = cute.tile_to_shape(warpgroup.make_smem_layout_atom(v_kind, dtype), (d, block_n, stages), order=(1, 0, 2))
    check_same_bytes(k_layout, vt_layout, block_n, d, slice_n, stages)
    return k_layout, vt_layout


class Kernel:
    """DSV4 decode attention on Hopper tensor cores: 64 query heads of one token per CTA,
    KV read once per tile (K and V views of one slot), split-KV with an LSE combine."""

    BLOCK_M = 64  # query heads per CTA (one m64 wgmma row block)
    NUM_MMA_WG = 2  # warpgroups that own d/2 columns of O each
    LOAD_WG = NUM_MMA_WG  # the warpgroup after the MMA warpgroups; its first warp loads
    LOAD_WARP = 4 * LOAD_WG
    MMA_THREADS = 128 * NUM_MMA_WG
    THREADS = MMA_THREADS + 128
    # setmaxnreg: 2 · 128 · 240 + 128 · 24 = 64 512 ≤ 65 536 registers.  A CTA of 288 threads
    # (one load warp) gets the same 168-register cap at entry as 384, so a whole warpgroup
    # costs nothing more, and it is what lets the MMA warpgroups grow to 240.
    MMA_REGS = 240
    LOAD_REGS = 24
    HEAD_DIMS = (64, 128, 256, 512)
    KV_STAGES = 2

    def __init__(self, *, shape: str, splits, sm_count: int = SM_COUNT):
        p = DecodeShape.parse(shape)
        if p.d not in self.HEAD_DIMS:
            raise ValueError(f"stage D2 sm90: d must be one of {self.HEAD_DIMS}, got {p.d}")
        if p.h_q % self.BLOCK_M:
            raise ValueError(f"stage D2 sm90: h_q must be a multiple of {self.BLOCK_M}, got {p.h_q}")
        self.block_n = 64 if p.d == 512 else 128
        if p.n % self.block_n:
            raise ValueError(f"stage D2 sm90: n must be a multiple of {self.block_n} at d = {p.d}, got {p.n}")
        self.p = p
        num_tiles = p.n // self.block_n
        head_blocks = p.h_q // self.BLOCK_M
        ctas = head_blocks * p.s_q * p.b
        self.splits = resolve_splits(splits, ctas=ctas, num_tiles=num_tiles, sm_count=sm_count)
        self.sched = DecodeGrid(head_blocks, p.s_q, p.b, self.splits, num_tiles)
        self.rows = p.b * p.s_q * p.h_q
        self.scale_log2 = math.log2(math.e) / math.sqrt(p.d)
        self.stages = self.KV_STAGES
        smem = 2 * (self.BLOCK_M * p.d + self.stages * self.block_n * p.d + self.BLOCK_M * self.block_n) + 4096
        if smem > _SMEM_LIMIT:
            raise ValueError(f"stage D2 sm90: {smem} bytes of shared memory needed, {_SMEM_LIMIT} available")

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        KV: cute.Tensor,
        O: cute.Tensor,
        LSE: cute.Tensor,
        O_part: cute.Tensor,
        LSE_part: cute.Tensor,
        stream: cuda.CUstream,
    ):
        p, bm, bn, d = self.p, self.BLOCK_M, self.block_n, self.p.d
        dtype = Q.element_type
        self._check_tensors(Q, KV, O, LSE, O_part, LSE_part)
        rows, splits = self.rows, self.splits

        # Views: rows = (batch, token, head) row-major; KV with extent n along the keys.
        mQ = cute.make_tensor(Q.iterator, cute.make_layout((rows, d), stride=(d, 1)))
        mO = cute.make_tensor(O.iterator, cute.make_layout((rows, d), stride=(d, 1)))
        mKV = cute.make_tensor(KV.iterator, cute.make_layout((p.n, d, p.b), stride=(d, 1, p.n_alloc * d)))
        # LSE [b, h_q, s_q] indexed by row r = (batch·s_q + token)·h_q + head (CuTe's linear index).
        mLSE = cute.make_tensor(LSE.iterator, cute.make_layout((p.h_q, p.s_q, p.b), stride=(p.s_q, 1, p.h_q * p.s_q)))
        cap = O_part.shape[0]
        mOp = cute.make_tensor(O_part.iterator, cute.make_layout((cap * rows, d), stride=(d, 1)))
        mLp = cute.make_tensor(LSE_part.iterator, cute.make_layout(cap * rows))

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype,
            warpgroup.OperandMajorMode.K,  # Q rows: d contiguous
            warpgroup.OperandMajorMode.K,  # K tile: d contiguous
            cutlass.Float32,
            (1, 1, 1),
            tiler_mn=(bm, bn),
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype,
            warpgroup.OperandMajorMode.K,  # P [rows, keys]: keys contiguous
            warpgroup.OperandMajorMode.MN,  # Vᵀ (d, keys): d contiguous (= the K tile)
            cutlass.Float32,
            (1, self.NUM_MMA_WG, 1),
            tiler_mn=(bm, d // self.NUM_MMA_WG),
        )

        q_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (bm, bn, d), dtype, 1)
        k_smem, vt_smem = _kv_layouts(dtype, d, bn, self.stages, d // self.NUM_MMA_WG)
        p_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (bm, d, bn), dtype, 1)

        expose(self, p_path="smem", qk_mma=(qk_mma, (bm, bn, d)), pv_mma=(pv_mma, (bm, d, bn)),  # dsv4-lab inspect
               smem={"Q": q_smem, "K": k_smem, "Vt (K's bytes)": vt_smem, "P": p_smem},
               p_write_smem=p_smem, p_read_smem=p_smem, pv_a_tile=(bm, bn))

        tma_q, tma_Q, self.q_bytes = sm90_tma_load(mQ, q_smem, (bm, d))
        tma_kv, tma_KV, self.kv_bytes = sm90_tma_load(mKV, k_smem, (bn, d))

        @cute.struct
        class Smem:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            row_factor: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bm], 16]  # α, then 1/ℓ
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(p_smem)], 1024]

        self.smem_struct = Smem

        self.kernel(
            qk_mma, pv_mma, tma_q, tma_Q, tma_kv, tma_KV, mO, mLSE, mOp, mLp,
            q_smem, k_smem, vt_smem, p_smem,
        ).launch(grid=self.sched.grid, block=(self.THREADS, 1, 1), smem=Smem.size_in_bytes(), stream=stream)

        if cutlass.const_expr(splits > 1):
            SplitCombine(rows, splits, d).launch(mOp, mLp, mO, mLSE, stream)

    def _check_tensors(self, Q, KV, O, LSE, O_part, LSE_part) -> None:
        """Trace time: the tensors have the shapes the case names, and the scratch holds
        this kernel's splits."""
        p = self.p
        want = {
            "Q": (Q, (p.b, p.s_q, p.h_q, p.d)),
            "KV": (KV, (p.b, p.n_alloc, p.d)),
            "O": (O, (p.b, p.s_q, p.h_q, p.d)),
            "LSE": (LSE, (p.b, p.h_q, p.s_q)),
        }
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise ValueError(f"stage D2 sm90: {name} has shape {tuple(t.shape)}, the case needs {shape}")
        if self.splits > 1:
            cap = O_part.shape[0]
            if self.splits > cap or tuple(O_part.shape[1:]) != (p.b, p.s_q, p.h_q, p.d) or tuple(LSE_part.shape) != (cap, p.b, p.s_q, p.h_q):
                raise ValueError(
                    f"stage D2 sm90: {self.splits} splits need O_part ≥ ({self.splits}, {p.b}, {p.s_q}, {p.h_q}, {p.d}) "
                    f"and LSE_part to match, got {tuple(O_part.shape)} and {tuple(LSE_part.shape)}"
                )

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_kv: cute.CopyAtom,
        mKV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mOp: cute.Tensor,
        mLp: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        vt_smem: cute.ComposedLayout,
        p_smem: cute.ComposedLayout,
    ):
        bm, bn, d = self.BLOCK_M, self.block_n, self.p.d
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        work = self.sched.work(bx, by, bz)
        if warp_idx == self.LOAD_WARP:
            prefetch_descriptors(tma_q, tma_kv)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (64, d, 1)
        sK = storage.sKV.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (bn, d, stages)
        sVt = storage.sKV.get_tensor(vt_smem.outer, swizzle=vt_smem.inner)  # (d, bn, stages): the same bytes
        sP = storage.sP.get_tensor(p_smem.outer, swizzle=p_smem.inner)[None, None, 0]  # (64, bn)
        s_row = storage.row_factor.get_tensor(cute.make_layout(bm))

        # Q: consumed by warpgroup 0 (4 warps); a KV slot: by both MMA warpgroups (8 warps).
        q_pipe = tma_pipeline(storage.q_mbar, 1, self.q_bytes, 4)
        kv_pipe = tma_pipeline(storage.kv_mbar, self.stages, self.kv_bytes, self.MMA_THREADS // 32)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        has_work = work.tile_begin < work.tile_end
        if warp_idx // 4 == self.LOAD_WG:
            cute.arch.setmaxregister_decrease(self.LOAD_REGS)
            if warp_idx == self.LOAD_WARP:
                if has_work:
                    self.load(work, q_pipe, kv_pipe, tma_q, mQ, sQ, tma_kv, mKV, sK)
        else:
            cute.arch.setmaxregister_increase(self.MMA_REGS)
            if has_work:
                self.attend(work, tidx, q_pipe, kv_pipe, qk_mma, pv_mma, sQ, sK, sVt, sP, s_row, mO, mLSE, mOp, mLp)
            else:
                self.write_empty_split(work, tidx, mOp, mLp)

    @cute.jit
    def load(self, work, q_pipe, kv_pipe, tma_q, mQ, sQ, tma_kv, mKV, sK):
        """Load role (one warp): Q's row block once, then KV tiles [tile_begin, tile_end) of
        the batch into the slots as they free up."""
        bm, bn, d = self.BLOCK_M, self.block_n, self.p.d
        gQ = cute.local_tile(mQ, (bm, d), (None, 0))  # (64, d, row blocks)
        gKV = cute.local_tile(mKV, (bn, d), (None, 0, None))  # (bn, d, tiles, b)
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, gQ, 2)
        tKsK, tKgK = tma_partition_tile(tma_kv, sK, gKV, 2)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        q_pipe.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ[(None, self.sched.row_block(work))], tQsQ[(None, 0)], tma_bar_ptr=q_pipe.producer_get_barrier(q_state))

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for tile in cutlass.range(work.tile_begin, work.tile_end, unroll=1):
            kv_pipe.producer_acquire(kv_state)
            cute.copy(
                tma_kv, tKgK[(None, tile, work.batch)], tKsK[(None, kv_state.index)],
                tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state),
            )
            kv_state.advance()

    @cute.jit
    def attend(self, work, tidx, q_pipe, kv_pipe, qk_mma, pv_mma, sQ, sK, sVt, sP, s_row, mO, mLSE, mOp, mLp):
        """The two MMA warpgroups: S and the softmax in warpgroup 0, P·V split by column over
        both, then the epilogue (see the module doc)."""
        bm, bn, d = self.BLOCK_M, self.block_n, self.p.d
        wg = tidx // 128
        tid_wg = tidx % 128
        mma_threads = self.MMA_THREADS

        # S side (warpgroup 0's; built by every thread so all names exist before the branches).
        thr_qk = qk_mma.get_slice(tid_wg)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, d/16, 1)
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, d/16, stages)
        s_shape = thr_qk.partition_shape_C((bm, bn))
        tScS_rc = acc_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((bm, bn))))  # (row, key)
        p_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), sP.element_type), qk_mma
        )
        thr_p_store = p_store.get_slice(tid_wg)
        tPsP = thr_p_store.partition_D(sP)
        expose(self, p_store=(p_store, qk_mma, (bm, bn), (bm, bn)))  # dsv4-lab inspect; no code

        # O side: this thread's part of its warpgroup's d/2 columns.
        thr_pv = pv_mma.get_slice(tidx)
        tOrP = pv_mma.make_fragment_A(thr_pv.partition_A(sP))  # (MMA, 1, bn/16)
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sVt))  # (MMA, 1, bn/16, stages)
        o_shape = thr_pv.partition_shape_C((bm, d))
        tOcO_rc = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((bm, d))))  # (row, col)
        tOgO = self.o_destination(work, thr_pv, mO, mOp)  # before the loop: wgmma_sync re-sets pv_mma inside it
        acc_o = cute.make_rmem_tensor(o_shape, cutlass.Float32)
        acc_o.fill(0.0)
        acc_o_rc = acc_rows_cols(acc_o)

        num_rows = cute.size(tScS_rc, mode=[0])
        softmax = OnlineSoftmax.create(num_rows, self.scale_log2)

        kv_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if wg == 0:
            q_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

        for i in cutlass.range(work.tile_end - work.tile_begin, unroll=1):
            kv_pipe.consumer_wait(kv_cons)
            if wg == 0:
                acc_s = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                wgmma_sync(qk_mma, acc_s, tSrQ, tSrK, a_slot=0, b_slot=kv_cons.index, zero_init=True)
                alpha = softmax.update(acc_rows_cols(acc_s))
                r_p = cute.make_rmem_tensor(s_shape, sP.element_type)
                r_p.store(acc_s.load().to(sP.element_type))
                if i > 0:  # warpgroup 1 is done with the previous P and α
                    cute.arch.barrier(barrier_id=int(NamedBarrier.P_EMPTY), number_of_threads=mma_threads)
                cute.copy(p_store, thr_p_store.retile(r_p), tPsP)
                for r in cutlass.range_constexpr(num_rows):
                    if tScS_rc[r, 0][1] == 0:  # one lane of the row's quad
                        s_row[tScS_rc[r, 0][0]] = alpha[r]
                cute.arch.fence_proxy("async.shared", space="cta")  # P: generic writes → wgmma reads
            cute.arch.barrier(barrier_id=int(NamedBarrier.P_FULL), number_of_threads=mma_threads)
            for r in cutlass.range_constexpr(num_rows):
                scale_rows(acc_o_rc, r, s_row[tOcO_rc[r, 0][0]])
            wgmma_sync(pv_mma, acc_o, tOrP, tOrV, b_slot=kv_cons.index)
            kv_pipe.consumer_release(kv_cons)
            kv_cons.advance()
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.P_EMPTY), number_of_threads=mma_threads)

        # Finalize (warpgroup 0 holds the row state): 1/ℓ through the row buffer, LSE out.
        if wg == 0:
            cute.arch.barrier(barrier_id=int(NamedBarrier.P_EMPTY), number_of_threads=mma_threads)
            inv_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            lse = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            softmax.finalize(inv_sum, lse)
            for r in cutlass.range_constexpr(num_rows):
                row = tScS_rc[r, 0][0]
                if tScS_rc[r, 0][1] == 0:
                    s_row[row] = inv_sum[r]
                    self.store_lse(work, row, lse[r], mLSE, mLp)
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=mma_threads)
        for r in cutlass.range_constexpr(num_rows):
            scale_rows(acc_o_rc, r, s_row[tOcO_rc[r, 0][0]])
        self.store_o(acc_o, tOgO)

    @cute.jit
    def store_lse(self, work, row, lse, mLSE, mLp):
        """LSE of `row` of the CTA's block: final (one split; DSV4's +∞ for a keyless row)
        or this split's partial (−∞ for a keyless row: the combine ignores it)."""
        if cutlass.const_expr(self.splits == 1):
            mLSE[self.sched.row_block(work) * self.BLOCK_M + row] = final_lse(lse)
        else:
            mLp[self.sched.partial_row_block(work) * self.BLOCK_M + row] = lse

    @cute.jit
    def o_destination(self, work, thr_pv, mO, mOp):
        """This thread's part of the CTA's output block: bf16 O (one split) or this split's
        fp32 partial."""
        bm, d = self.BLOCK_M, self.p.d
        if cutlass.const_expr(self.splits == 1):
            return thr_pv.partition_C(cute.local_tile(mO, (bm, d), (self.sched.row_block(work), 0)))
        return thr_pv.partition_C(cute.local_tile(mOp, (bm, d), (self.sched.partial_row_block(work), 0)))

    @cute.jit
    def store_o(self, acc_o, tOgO):
        """The accumulator into `tOgO` (from `o_destination`), converted to its type."""
        out = cute.make_rmem_tensor(tOgO.shape, tOgO.element_type)
        out.store(acc_o.load().to(tOgO.element_type))
        cute.autovec_copy(out, tOgO)

    @cute.jit
    def write_empty_split(self, work, tidx, mOp, mLp):
        """A split with no KV tile (the MMA warpgroups): partial O = 0 and LSE = −∞ for its
        64 rows, so the combine reads a well-defined partial and ignores it.  (Plain stores:
        no tiled MMA is touched here, its traced value lives in the other branch.)"""
        if cutlass.const_expr(self.splits > 1):
            bm, d = self.BLOCK_M, self.p.d
            block = cute.local_tile(mOp, (bm, d), (self.sched.partial_row_block(work), 0))
            for k in cutlass.range_constexpr(bm * d // self.MMA_THREADS):
                e = k * self.MMA_THREADS + tidx  # consecutive threads, consecutive columns
                block[e // d, e % d] = cutlass.Float32(0.0)
            if tidx < bm:
                mLp[self.sched.partial_row_block(work) * bm + tidx] = -cutlass.Float32.inf
