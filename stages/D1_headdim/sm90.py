"""Stage D1 on Hopper (sm_90a): online-softmax attention for head dims 64 … 512.

Math (stage C's; the online softmax is stages/common/softmax.py)
    s = Q · Kᵀ · scale,  scale = 1 / sqrt(hd);  O = softmax(s) · V;  LSE[i] = ln Σ_j exp(s[i, j])
    Q [m, hd], K [n, hd], V [n, hd], O [m, hd] bf16 row-major; LSE [m] fp32.

The split: O across two warpgroups by head-dim column, P through shared memory
    At hd = 512 a 64 × 512 fp32 O tile is 256 registers a thread.  So a CTA owns 64 query rows
    (grid = m / 64) and two warpgroups; warpgroup w owns O columns [w·hd/2, (w+1)·hd/2) (≤ 128
    registers): the P·V tiled MMA's atom layout is (1, 2, 1), two m64n(hd/2)k16 atoms reading
    the same A = P and each its half of Vᵀ.  Warpgroup 0 alone computes S = Q·K_tileᵀ
    (m64n{BLOCK_N}) and the softmax, stores P (bf16, the SS P·V wgmma's K-major A operand) and
    α to shared memory (`SmemP`, stages/common/sm90_smem_p.py); each warpgroup rescales its O
    half and runs its P·V; at the end 1/ℓ goes through the same row buffer.  Q·Kᵀ is computed
    once per row block (DSV4's decode shape: one P shared by the warpgroups that split d_v);
    the cost: warpgroup 1 idles during S and the softmax.

Tiles and shared memory (K and V each a TMA pipeline of their own; warp 0 produces)
      hd   BLOCK_N  K/V slots   dynamic shared memory (n ≥ 2 tiles)
      64     128        2        8 + 2·(16+16) + 16 KiB + barriers  =  89 KiB
      128    128        2       16 + 2·(32+32) + 16 KiB + barriers  = 161 KiB
      256     64        2       32 + 2·(32+32) +  8 KiB + barriers  = 169 KiB
      512     64        1       64 + 64 + 64   +  8 KiB + barriers  = 201 KiB
    At hd = 512 the separate K and V pipelines still overlap K_{j+1}'s load with tile j's
    softmax and P·V, and V_{j+1}'s with S_{j+1}.

Limits: m a multiple of 64, hd ∈ {64, 128, 256, 512}, n a multiple of BLOCK_N; row-major,
16-byte aligned, static shapes."""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils

from stages.common import hang_guard
from stages.common.inspection import expose
from stages.common.sm90_idioms import acc_rows_cols, store_accumulator, wgmma_sync
from stages.common.sm90_setup import AttentionOperands, TileLoader, TmaPipe, load_once, smem_struct
from stages.common.sm90_setup import smem_tensors, tma_pipelines, tma_tiles, wait_once
from stages.common.sm90_smem_p import SmemP, smem_p_mmas, vt_slice_layout
from stages.common.softmax import OnlineSoftmax
from stages.common.tma import prefetch_descriptors, sm90_tma_load, transpose_view
from stages.common.device import SMEM_LIMIT  # the largest dynamic shared memory of a CTA



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
        stages = 2 if fixed + 2 * 2 * tile_bytes <= SMEM_LIMIT else 1
        self.stages = min(stages, self.num_kv_tiles)

    @cute.jit
    def __call__(self, Q: cute.Tensor, K: cute.Tensor, V: cute.Tensor, O: cute.Tensor, LSE: cute.Tensor,
                 stream: cuda.CUstream):
        dtype = Q.element_type
        bm, bn, hd = self.BLOCK_M, self.block_n, self.hd
        qk_tile = (bm, bn, hd)  # (M, N, K) of S = Q·Kᵀ
        pv_tile = (bm, hd, bn)  # (M, N, K) of O = P·V
        qk_mma, pv_mma = smem_p_mmas(dtype, bm, bn, hd, self.NUM_WG)

        q_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tile, dtype, 1)
        k_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, qk_tile, dtype, self.stages)
        v_smem = vt_slice_layout(dtype, hd, bn, self.stages, hd // self.NUM_WG)
        p_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, pv_tile, dtype, 1)
        expose(self, p_path="smem", qk_mma=(qk_mma, qk_tile), pv_mma=(pv_mma, pv_tile),  # dsv4-lab inspect
               smem={"Q": q_smem, "K": k_smem, "V": v_smem, "P": p_smem},
               p_write_smem=p_smem, p_read_smem=p_smem, pv_a_tile=(bm, bn))

        Vt = transpose_view(V)  # V [n, hd] as Vᵀ (hd, n): the B operand of P·V, N = hd leading
        tma_q, tma_Q, q_bytes = sm90_tma_load(Q, q_smem, (bm, hd))
        tma_k, tma_K, k_bytes = sm90_tma_load(K, k_smem, (bn, hd))
        tma_v, tma_Vt, v_bytes = sm90_tma_load(Vt, v_smem, (hd, bn))

        # Q and K are consumed by warpgroup 0 (4 warps), V by both (8 warps).
        self.pipes = (TmaPipe("q", 1, q_bytes, 4), TmaPipe("k", self.stages, k_bytes, 4),
                      TmaPipe("v", self.stages, v_bytes, self.threads // 32))
        self.smem_struct = smem_struct(
            self.pipes,
            {"sQ": (dtype, q_smem), "sK": (dtype, k_smem), "sV": (dtype, v_smem), "sP": (dtype, p_smem)},
            row_factor_rows=bm,  # α, then 1/ℓ
        )
        ops = AttentionOperands(qk_mma, pv_mma, tma_q, tma_Q, tma_k, tma_K, tma_v, tma_Vt, q_smem, k_smem, v_smem)
        self.kernel(ops, p_smem, O, LSE).launch(
            grid=(self.m // bm, 1, 1),
            block=(self.threads, 1, 1),
            smem=self.smem_struct.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, ops: AttentionOperands, p_smem: cute.ComposedLayout, mO: cute.Tensor, mLSE: cute.Tensor):
        """Set-up and the load prologue (warp 0), then both warpgroups attend (`attend`)."""
        bm, bn, hd = self.BLOCK_M, self.block_n, self.hd
        qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mVt, q_smem, k_smem, v_smem = ops
        tidx, _, _ = cute.arch.thread_idx()
        row_block, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            prefetch_descriptors(tma_q, tma_k, tma_v)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ, sK, sV, sP = smem_tensors(storage, sQ=q_smem, sK=k_smem, sV=v_smem, sP=p_smem)
        s_row = storage.row_factor.get_tensor(cute.make_layout(bm))  # α per row, then 1/ℓ
        q_pipe, k_pipe, v_pipe = tma_pipelines(storage, self.pipes)

        # Load role (warp 0, from `attend`): Q's row block once, K and V tiles into their
        # slots, each slot refilled as soon as its consumers release it.
        q_load = tma_tiles(tma_q, sQ, mQ, (bm, hd), (None, 0))
        k_loader = TileLoader.create(k_pipe, self.stages, tma_tiles(tma_k, sK, mK, (bn, hd), (None, 0)))
        v_loader = TileLoader.create(v_pipe, self.stages, tma_tiles(tma_v, sV, mVt, (hd, bn), (0, None)))
        self.attend(tidx, warp_idx, row_block, q_pipe, q_load, k_loader, v_loader, qk_mma, pv_mma,
                    sQ, sK, sV, sP[None, None, 0], s_row, mO, mLSE)

    @cute.jit
    def attend(self, tidx, warp_idx, row_block, q_pipe, q_load, k_loader, v_loader, qk_mma, pv_mma,
               sQ, sK, sV, sP, s_row, mO, mLSE):
        """Both warpgroups, per KV tile: warpgroup 0 computes S and the softmax and publishes P and α;
                each rescales its O half and adds its P·V_half.  Warp 0 also loads: the prologue once
                the fragments are built (earlier costs registers), a refill after each release."""
        hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
        bm, bn, hd = self.BLOCK_M, self.block_n, self.hd
        wg = warp_idx // 4  # warpgroup: 0 computes S and the softmax; both own half of O
        tid_wg = tidx % 128

        # S side (warpgroup 0's; built by every thread so all names exist before the branches).
        thr_qk = qk_mma.get_slice(tid_wg)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, hd/16, 1)
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, hd/16, stages)
        s_shape = thr_qk.partition_shape_C((bm, bn))
        smem_p = SmemP.create(self, qk_mma, sP, s_row, tid_wg, self.threads)

        # O side: this thread's part of its warpgroup's hd/2 columns.
        thr_pv = pv_mma.get_slice(tidx)
        tOrP = pv_mma.make_fragment_A(thr_pv.partition_A(sP))  # (MMA, 1, bn/16)
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, 1, bn/16, stages)
        tOgO = thr_pv.partition_C(cute.local_tile(mO, (bm, hd), (row_block, 0)))
        tOcO_rc = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((bm, hd))))  # (row, col)
        acc_o = cute.make_rmem_tensor(tOgO.shape, cutlass.Float32)
        acc_o.fill(0.0)
        acc_o_rc = acc_rows_cols(acc_o)

        if warp_idx == 0:  # the load role's prologue: Q, the first `stages` K and V tiles
            load_once(q_pipe, q_load, row_block)
            k_loader.fill(self.stages)
            v_loader.fill(self.stages)

        num_rows = cute.size(smem_p.tScS_rc, mode=[0])
        softmax = OnlineSoftmax.create(num_rows, self.scale_log2, lonely_rows=False)  # wg 0's rows; none keyless

        k_pipe, v_pipe = k_loader.pipe, v_loader.pipe
        k_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        v_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if wg == 0:
            wait_once(q_pipe)

        for kv_tile in cutlass.range(self.num_kv_tiles, unroll=1):
            if wg == 0:
                # S = Q · K_tileᵀ (raw scores, fp32); the K slot is free again right after.
                k_pipe.consumer_wait(k_cons)
                acc_s = cute.make_rmem_tensor(s_shape, cutlass.Float32)
                wgmma_sync(qk_mma, acc_s, tSrQ, tSrK, a_slot=0, b_slot=k_cons.index, zero_init=True)
                k_pipe.consumer_release(k_cons)
                if warp_idx == 0 and kv_tile + self.stages < self.num_kv_tiles:
                    k_loader.produce()
                # Online softmax, row by row: S ← P, α per row; then P and α out.
                alpha = softmax.update(acc_rows_cols(acc_s))
                smem_p.publish(acc_s, alpha, kv_tile > 0)
            k_cons.advance()

            # Both warpgroups: rescale the own O half by α, then O_half += P · V_half.
            smem_p.wait_full()
            smem_p.rescale(acc_o_rc, tOcO_rc)
            v_pipe.consumer_wait(v_cons)
            wgmma_sync(pv_mma, acc_o, tOrP, tOrV, b_slot=v_cons.index)
            v_pipe.consumer_release(v_cons)
            v_cons.advance()
            if wg == 1:
                smem_p.release()
            if warp_idx == 0 and kv_tile + self.stages < self.num_kv_tiles:
                v_loader.produce()

        # Finalize. Warpgroup 0: LSE = (m·c + log2 ℓ)·ln 2 out, 1/ℓ published; both: O /= ℓ.
        if wg == 0:
            smem_p.wait_empty()
            inv_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            lse = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            softmax.finalize(inv_sum, lse)
            smem_p.publish_rows(inv_sum)
            for r in cutlass.range_constexpr(num_rows):
                if smem_p.tScS_rc[r, 0][1] == 0:
                    mLSE[row_block * bm + smem_p.tScS_rc[r, 0][0]] = lse[r]
        smem_p.wait_epilogue()
        smem_p.rescale(acc_o_rc, tOcO_rc)
        store_accumulator(acc_o, tOgO)
