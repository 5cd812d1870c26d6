"""Stage D1 on Hopper (sm_90a): online-softmax attention for head dims 64 … 512.

Math (as stage C)
    s = Q · Kᵀ · scale,  scale = 1 / sqrt(hd)
    O = softmax(s) · V                      (row-wise softmax over the n keys)
    LSE[i] = ln Σ_j exp(s[i, j])            natural log, fp32
    Q [m, hd], K [n, hd], V [n, hd], O [m, hd] bf16 row-major; LSE [m] fp32.

    Online softmax over KV tiles, base 2, with c = scale · log2(e) and raw
    scores S = Q · K_tileᵀ:
      m_new = max(m, rowmax(S))                    raw-score units
      α     = 2^((m − m_new) · c)                  (= 0 on the first tile, m = −∞)
      P     = 2^(S · c − m_new · c)                ∈ (0, 1]
      ℓ     = α · ℓ + rowsum(P)
      O_acc = α · O_acc + bf16(P) · V_tile
    and at the end O = O_acc / ℓ,  LSE = (m · c + log2 ℓ) · ln 2.

The split: O across two warpgroups by head-dim column, P through shared memory
    At hd = 512 one warpgroup would need a 64 × 512 fp32 O tile = 256 registers
    per thread for O alone, which cannot fit.  So each CTA owns 64 query rows
    (grid = m / 64 CTAs) and has two warpgroups; warpgroup w owns the O columns
    [w·hd/2, (w+1)·hd/2): at most 64 × 256 fp32 = 128 registers per thread.
    The P·V tiled MMA expresses this directly: its atom layout is (1, 2, 1), two
    m64n(hd/2)k16 atoms side by side along N, one per warpgroup, both reading
    the same A = P and each its own half of Vᵀ.

    Warpgroup 0 alone computes S = Q·K_tileᵀ (m64n{BLOCK_N}) and the softmax
    (so S and the row state live only in its registers), stores P as bf16 into
    shared memory in the K-major layout that is the A operand of the
    shared-memory-sourced ("SS") P·V wgmma — stmatrix through a copy tiled like
    the S accumulator — and the per-row rescale factor α next to it.  Then
    `fence.proxy.async.shared::cta` (the wgmma reads shared memory through the
    async proxy) and a named barrier over both warpgroups ("P full").  Each
    warpgroup reads α for its rows, rescales its O half and runs its P·V_half.
    Before overwriting P and α for the next tile, warpgroup 0 waits on a second
    named barrier ("P empty") that warpgroup 1 arrives at when its P·V has
    completed.  At the end warpgroup 0 publishes 1/ℓ through the same row
    buffer and writes LSE; both warpgroups normalise and store their O half.

    Why this split rather than recomputing S in hd/128 CTAs: it does Q·Kᵀ once
    per row block (recomputation would quadruple that GEMM at hd = 512 and
    needs the full 64 × 512 Q and a 512-wide K tile in every CTA anyway), and
    it is the structure the DSV4 decode kernel needs (one P shared by the
    warpgroups that split d_v = 512).  The cost: warpgroup 1 idles while S and
    the softmax run.

Tiles and shared memory
    Q tile 64 × hd (loaded once by TMA), K tiles BLOCK_N × hd, Vᵀ tiles
    hd × BLOCK_N, each in a TMA pipeline of its own (warp 0 is the producer and
    refills a slot once its consumers release it: K after the S wgmma, V after
    both P·V wgmmas), P 64 × BLOCK_N, α/ℓ 64 fp32.
      hd   BLOCK_N  K/V slots   dynamic shared memory (n ≥ 2 tiles; measured struct size)
      64     128        2        8 + 2·(16+16) + 16 KiB + barriers  =  89 KiB
      128    128        2       16 + 2·(32+32) + 16 KiB + barriers  = 161 KiB
      256     64        2       32 + 2·(32+32) +  8 KiB + barriers  = 169 KiB
      512     64        1       64 + 64 + 64   +  8 KiB + barriers  = 201 KiB
    (with a single KV tile, n = BLOCK_N, there is one slot of each.)
    At hd = 512 there is one K and one V slot, but since they are separate
    pipelines the load of K_{j+1} overlaps the softmax and P·V of tile j and
    the load of V_{j+1} overlaps S_{j+1} and its softmax.

Limits: m a multiple of 64 (tested 128), hd ∈ {64, 128, 256, 512}, n a
multiple of BLOCK_N (tested 128, 256, 1024); row-major, 16-byte aligned,
static shapes.
"""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warp, warpgroup

from stages.common.sm90_idioms import acc_rows_cols, online_softmax_row, tma_pipeline, wgmma_sync
from stages.common.inspection import expose
from stages.common.tma import prefetch_descriptors, sm90_tma_load, tma_partition_tile, tma_produce, transpose_view

# Named barriers (id 0 is __syncthreads).
_BAR_P_FULL = 1  # P and the row factors are in shared memory (both warpgroups)
_BAR_P_EMPTY = 2  # warpgroup 1 is done reading them (wg 1 arrives, wg 0 waits)

_SMEM_LIMIT = 227 * 1024  # Hopper: largest dynamic shared memory per CTA


def _smem_layout_vt(dtype, hd: int, block_n: int, stages: int, slice_n: int):
    """Shared-memory layout of Vᵀ tiles (hd, block_n, stages), hd contiguous
    (MN-major B operand of P·V).  The swizzle atom is chosen from the width of
    ONE warpgroup's slice (slice_n columns), so that every slice starts on a
    swizzle-atom boundary and is a valid wgmma descriptor on its own; atoms
    repeat along the keys first, as in the library's B layouts."""
    kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.COL_MAJOR, dtype, slice_n)
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, (hd, block_n, stages), order=(1, 0, 2))


class Kernel:
    """O = softmax(Q·Kᵀ/sqrt(hd))·V and its natural-log LSE on Hopper tensor
    cores, for hd up to 512: 64 query rows per CTA, S and softmax in warpgroup 0,
    P in shared memory, O split by column between two warpgroups (SS wgmma)."""

    BLOCK_M = 64  # query rows per CTA (one m64 wgmma row block)
    NUM_WG = 2  # warpgroups per CTA; each owns hd / 2 columns of O
    HEAD_DIMS = (64, 128, 256, 512)

    def __init__(self, *, m: int, n: int, hd: int):
        if m < self.BLOCK_M or m % self.BLOCK_M != 0:
            raise ValueError(f"stage D1 sm90: m must be a positive multiple of 64, got {m}")
        if hd not in self.HEAD_DIMS:
            raise ValueError(f"stage D1 sm90: hd must be one of {self.HEAD_DIMS}, got {hd}")
        self.block_n = 128 if hd <= 128 else 64
        if n < self.block_n or n % self.block_n != 0:
            raise ValueError(f"stage D1 sm90: n must be a positive multiple of {self.block_n}, got {n}")
        self.m, self.n, self.hd = m, n, hd
        self.num_kv_tiles = n // self.block_n
        self.threads = 128 * self.NUM_WG
        self.scale_log2 = math.log2(math.e) / math.sqrt(hd)  # c above

        # Two K and two V slots where they fit, else one of each (hd = 512).
        tile_bytes = 2 * self.block_n * hd  # one bf16 K (or V) tile
        fixed = 2 * self.BLOCK_M * hd + 2 * self.BLOCK_M * self.block_n + 4096  # Q, P, barriers/rows/alignment
        stages = 2 if fixed + 2 * 2 * tile_bytes <= _SMEM_LIMIT else 1
        self.stages = min(stages, self.num_kv_tiles)

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        K: cute.Tensor,
        V: cute.Tensor,
        O: cute.Tensor,
        LSE: cute.Tensor,
        stream: cuda.CUstream,
    ):
        dtype = Q.element_type
        bm, bn, hd = self.BLOCK_M, self.block_n, self.hd
        qk_tile = (bm, bn, hd)  # (M, N, K) of S = Q·Kᵀ
        pv_tile = (bm, hd, bn)  # (M, N, K) of O = P·V

        # S = Q·Kᵀ: one warpgroup, m64 n{bn}.
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype,
            warpgroup.OperandMajorMode.K,  # Q [m, hd]: hd contiguous
            warpgroup.OperandMajorMode.K,  # K [n, hd]: hd contiguous
            cutlass.Float32,
            (1, 1, 1),
            tiler_mn=(bm, bn),
        )
        # O = P·V: two warpgroups side by side along N (= hd), A = P from shared memory.
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype,
            warpgroup.OperandMajorMode.K,  # P [rows, keys]: keys contiguous
            warpgroup.OperandMajorMode.MN,  # Vᵀ (hd, keys): hd contiguous
            cutlass.Float32,
            (1, self.NUM_WG, 1),
            tiler_mn=(bm, hd // self.NUM_WG),
        )

        q_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, qk_tile, dtype, 1)
        k_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, qk_tile, dtype, self.stages)
        v_smem = _smem_layout_vt(dtype, hd, bn, self.stages, hd // self.NUM_WG)
        p_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, pv_tile, dtype, 1)
        expose(self, p_path="smem", qk_mma=(qk_mma, qk_tile), pv_mma=(pv_mma, pv_tile),  # dsv4-lab inspect
               smem={"Q": q_smem, "K": k_smem, "V": v_smem, "P": p_smem},
               p_write_smem=p_smem, p_read_smem=p_smem, pv_a_tile=(bm, bn))

        Vt = transpose_view(V)  # V [n, hd] as Vᵀ (hd, n): the B operand of P·V, N = hd leading
        tma_q, tma_Q, self.q_bytes = sm90_tma_load(Q, q_smem, (bm, hd))
        tma_k, tma_K, self.k_bytes = sm90_tma_load(K, k_smem, (bn, hd))
        tma_v, tma_Vt, self.v_bytes = sm90_tma_load(Vt, v_smem, (hd, bn))

        @cute.struct
        class Smem:
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            v_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            row_factor: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, bm], 16]  # α, then 1/ℓ
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(v_smem)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(p_smem)], 1024]

        self.smem_struct = Smem

        self.kernel(
            qk_mma, pv_mma, tma_q, tma_Q, tma_k, tma_K, tma_v, tma_Vt, O, LSE,
            q_smem, k_smem, v_smem, p_smem,
        ).launch(
            grid=(self.m // bm, 1, 1),
            block=(self.threads, 1, 1),
            smem=Smem.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_v: cute.CopyAtom,
        mVt: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        v_smem: cute.ComposedLayout,
        p_smem: cute.ComposedLayout,
    ):
        bm, bn, hd = self.BLOCK_M, self.block_n, self.hd
        tidx, _, _ = cute.arch.thread_idx()
        row_block, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp_idx // 4  # warpgroup: 0 computes S and the softmax; both own half of O
        tid_wg = tidx % 128
        if warp_idx == 0:
            prefetch_descriptors(tma_q, tma_k, tma_v)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (64, hd, 1)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (bn, hd, stages)
        sV = storage.sV.get_tensor(v_smem.outer, swizzle=v_smem.inner)  # (hd, bn, stages)
        sP = storage.sP.get_tensor(p_smem.outer, swizzle=p_smem.inner)  # (64, bn, 1)
        sP = sP[None, None, 0]
        s_row = storage.row_factor.get_tensor(cute.make_layout(bm))  # α per row, then 1/ℓ

        # TMA pipelines: Q once; K consumed by warpgroup 0 (4 warps), V by both (8 warps).
        q_pipe = tma_pipeline(storage.q_mbar, 1, self.q_bytes, 4)
        k_pipe = tma_pipeline(storage.k_mbar, self.stages, self.k_bytes, 4)
        v_pipe = tma_pipeline(storage.v_mbar, self.stages, self.v_bytes, self.threads // 32)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Global tiles: Q (64, hd, m/64), K (bn, hd, tiles), Vᵀ (hd, bn, tiles).
        gQ = cute.local_tile(mQ, (bm, hd), (None, 0))
        gK = cute.local_tile(mK, (bn, hd), (None, 0))
        gVt = cute.local_tile(mVt, (hd, bn), (0, None))
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, gQ, 2)
        tKsK, tKgK = tma_partition_tile(tma_k, sK, gK, 2)
        tVsV, tVgV = tma_partition_tile(tma_v, sV, gVt, 2)

        # S side (used by warpgroup 0 only; defined for every thread so that all
        # names exist before the warpgroup branches).
        thr_qk = qk_mma.get_slice(tid_wg)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, hd/16, 1)
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, hd/16, stages)
        s_shape = thr_qk.partition_shape_C((bm, bn))
        tScS_rc = acc_rows_cols(thr_qk.partition_C(cute.make_identity_tensor((bm, bn))))  # (row, key)
        # P: registers (accumulator layout) → shared memory (P·V A-operand layout), stmatrix.
        p_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), mO.element_type), qk_mma
        )
        thr_p_store = p_store.get_slice(tid_wg)
        tPsP = thr_p_store.partition_D(sP)
        expose(self, p_store=(p_store, qk_mma, (bm, bn), (bm, bn)))  # dsv4-lab inspect; no code

        # O side: this thread's part of its warpgroup's hd/2 columns.
        thr_pv = pv_mma.get_slice(tidx)
        tOrP = pv_mma.make_fragment_A(thr_pv.partition_A(sP))  # (MMA, 1, bn/16)
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, 1, bn/16, stages)
        gO = cute.local_tile(mO, (bm, hd), (row_block, 0))
        tOgO = thr_pv.partition_C(gO)
        tOcO_rc = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((bm, hd))))  # (row, col)
        acc_o = cute.make_rmem_tensor(tOgO.shape, cutlass.Float32)
        acc_o.fill(0.0)
        acc_o_rc = acc_rows_cols(acc_o)

        # Softmax state of warpgroup 0, per row of this thread: running max (raw
        # score units) and this thread's partial sum of 2^(S·c − max·c).
        num_rows = cute.size(tScS_rc, mode=[0])
        row_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        row_max.fill(-cutlass.Float32.inf)
        row_sum.fill(0.0)
        c = self.scale_log2

        # Producer prologue (warp 0): Q, then the first `stages` K and V tiles.
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        v_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if warp_idx == 0:
            q_pipe.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ[(None, row_block)], tQsQ[(None, 0)], tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
            for _ in cutlass.range_constexpr(self.stages):
                tma_produce(k_pipe, k_prod, (tma_k, tKgK, tKsK))
                k_prod.advance()
            for _ in cutlass.range_constexpr(self.stages):
                tma_produce(v_pipe, v_prod, (tma_v, tVgV, tVsV))
                v_prod.advance()

        k_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        v_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if wg == 0:
            q_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))

        for kv_tile in cutlass.range(self.num_kv_tiles, unroll=1):
            if wg == 0:
                # S = Q · K_tileᵀ (raw scores, fp32)
                k_pipe.consumer_wait(k_cons)
                acc_s = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                wgmma_sync(qk_mma, acc_s, tSrQ, tSrK, a_slot=0, b_slot=k_cons.index, zero_init=True)
                k_pipe.consumer_release(k_cons)
                if warp_idx == 0 and kv_tile + self.stages < self.num_kv_tiles:
                    tma_produce(k_pipe, k_prod, (tma_k, tKgK, tKsK))
                    k_prod.advance()

                # Online softmax, row by row: S ← P, α for the row.
                acc_s_rc = acc_rows_cols(acc_s)
                alpha = cute.make_rmem_tensor(num_rows, cutlass.Float32)
                for r in cutlass.range_constexpr(num_rows):
                    alpha[r] = online_softmax_row(acc_s_rc, r, row_max, row_sum, c)
                r_p = cute.make_rmem_tensor(s_shape, mO.element_type)
                r_p.store(acc_s.load().to(mO.element_type))

                # Publish P and α once warpgroup 1 has finished with the previous ones.
                if kv_tile > 0:
                    cute.arch.barrier(barrier_id=_BAR_P_EMPTY, number_of_threads=self.threads)
                cute.copy(p_store, thr_p_store.retile(r_p), tPsP)
                for r in cutlass.range_constexpr(num_rows):
                    if tScS_rc[r, 0][1] == 0:  # one lane of the quad
                        s_row[tScS_rc[r, 0][0]] = alpha[r]
                cute.arch.fence_proxy("async.shared", space="cta")  # P: generic writes → wgmma reads
            k_cons.advance()

            # Both warpgroups: rescale the own O half by α, then O_half += P · V_half.
            cute.arch.barrier(barrier_id=_BAR_P_FULL, number_of_threads=self.threads)
            for r in cutlass.range_constexpr(num_rows):
                a = s_row[tOcO_rc[r, 0][0]]
                for j in cutlass.range_constexpr(cute.size(acc_o_rc, mode=[1])):
                    acc_o_rc[r, j] = acc_o_rc[r, j] * a
            v_pipe.consumer_wait(v_cons)
            wgmma_sync(pv_mma, acc_o, tOrP, tOrV, b_slot=v_cons.index)
            v_pipe.consumer_release(v_cons)
            v_cons.advance()
            if wg == 1:
                cute.arch.barrier_arrive(barrier_id=_BAR_P_EMPTY, number_of_threads=self.threads)
            if warp_idx == 0 and kv_tile + self.stages < self.num_kv_tiles:
                tma_produce(v_pipe, v_prod, (tma_v, tVgV, tVsV))
                v_prod.advance()

        # Finalize. Warpgroup 0: ℓ over the quad, LSE = (m·c + log2 ℓ)·ln 2, publish 1/ℓ.
        if wg == 0:
            cute.arch.barrier(barrier_id=_BAR_P_EMPTY, number_of_threads=self.threads)
            for r in cutlass.range_constexpr(num_rows):
                total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
                row = tScS_rc[r, 0][0]
                if tScS_rc[r, 0][1] == 0:
                    s_row[row] = cute.arch.rcp_approx(total)
                    mLSE[row_block * bm + row] = (row_max[r] * c + cute.math.log2(total, fastmath=True)) * math.log(2.0)
        cute.arch.barrier(barrier_id=_BAR_P_FULL, number_of_threads=self.threads)

        # Both warpgroups: O_half /= ℓ, bf16, straight to global memory.
        for r in cutlass.range_constexpr(num_rows):
            inv_total = s_row[tOcO_rc[r, 0][0]]
            for j in cutlass.range_constexpr(cute.size(acc_o_rc, mode=[1])):
                acc_o_rc[r, j] = acc_o_rc[r, j] * inv_total
        out = cute.make_rmem_tensor(tOgO.shape, mO.element_type)
        out.store(acc_o.load().to(mO.element_type))
        cute.autovec_copy(out, tOgO)
