"""The Hopper (sm_90a) house of stages B and C: attention with P kept in registers between two
chained WGMMAs, one CTA; a rung supplies `between` (its step on S) and its end.

Shape (256 threads = two warpgroups; warpgroup w owns query rows 64w … 64w + 63)
    load (warp 0)  Q [128, hd] once, then K and Vᵀ tiles of BLOCK_N = 128 keys into `stages` ≤ 2
                   slots of one pipeline (a slot: one K + one Vᵀ tile), refilled on release
    mma (all 8 warps), per KV tile:
        S = Q · K_tileᵀ          SS wgmma m64n128k16, hd/16 K steps, 64 fp32 / thread
        the rung's step on S     `between(acc_s, acc_o, state)` (C: online softmax, O rescale)
        P = bf16(S)              the accumulator re-indexed as the RS wgmma's A fragment
                                 (`p_from_scores`; proven by sm90_idioms)
        O += P · V_tile          RS wgmma m64n{hd}k16, V an MN-major B operand
        release the slot (8 consumer warps arrive)
    epilogue       the rung's end, then O → bf16 → global
Limits: m == 128, hd == 64, n a multiple of 128; row-major, 16-byte aligned, static shapes."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils

from stages.common import hang_guard
from stages.common.inspection import expose
from stages.common.sm90_idioms import accumulator_to_a_operand, register_p_mmas, wgmma_sync
from stages.common.sm90_setup import AttentionOperands, TileLoader, TmaPipe, load_once, smem_struct
from stages.common.sm90_setup import smem_tensors, tma_pipelines, tma_tiles, wait_once
from stages.common.tma import prefetch_descriptors, sm90_tma_load, transpose_view


class RegisterPAttention:
    """Base of a register-P rung: checks, trace-time set-up, the load and MMA roles."""

    RUNG = "stage ?"  # the rung's name in error messages
    BLOCK_M = 128  # query rows (two warpgroups × 64)
    BLOCK_N = 128  # keys per KV tile
    MAX_STAGES = 2  # KV tiles in flight (32 KiB each: K tile + V tile)
    NUM_WARPGROUPS = 2
    THREADS = 128 * NUM_WARPGROUPS

    def __init__(self, *, m: int, n: int, hd: int):
        if m != self.BLOCK_M:
            raise ValueError(f"{self.RUNG} sm90: m must be 128, got {m}")
        if hd != 64:
            raise ValueError(f"{self.RUNG} sm90: hd must be 64 (O and S in registers), got {hd}")
        if n < self.BLOCK_N or n % self.BLOCK_N != 0:
            raise ValueError(f"{self.RUNG} sm90: n must be a positive multiple of 128, got {n}")
        self.m, self.n, self.hd = m, n, hd
        self.num_kv_tiles = n // self.BLOCK_N
        self.stages = min(self.num_kv_tiles, self.MAX_STAGES)

    # -- trace time (host side of __call__) -------------------------------------------------

    def operands(self, Q: cute.Tensor, K: cute.Tensor, V: cute.Tensor) -> AttentionOperands:
        """The two tiled MMAs (S → P retile checked), the staged layouts, the TMA loads of Q, K, Vᵀ, and
                the pipelines and shared storage (`self.pipes`, `self.smem_struct`)."""
        dtype = Q.element_type
        qk_tile = (self.BLOCK_M, self.BLOCK_N, self.hd)  # (M, N, K) of S = Q·Kᵀ
        pv_tile = (self.BLOCK_M, self.hd, self.BLOCK_N)  # (M, N, K) of O = P·V
        qk_mma, pv_mma = register_p_mmas(dtype, self.NUM_WARPGROUPS, self.BLOCK_N, self.hd)

        q_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tile, dtype, 1)
        k_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, qk_tile, dtype, self.stages)
        v_smem = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, pv_tile, dtype, self.stages)
        expose(self, p_path="registers", qk_mma=(qk_mma, qk_tile), pv_mma=(pv_mma, pv_tile),
               smem={"Q": q_smem, "K": k_smem, "V": v_smem})  # dsv4-lab inspect; no code

        Vt = transpose_view(V)  # V [n, hd] as Vᵀ (hd, n): the B operand of P·V, N = hd leading
        tma_q, tma_Q, q_bytes = sm90_tma_load(Q, q_smem, (self.BLOCK_M, self.hd))
        tma_k, tma_K, k_bytes = sm90_tma_load(K, k_smem, (self.BLOCK_N, self.hd))
        tma_v, tma_Vt, v_bytes = sm90_tma_load(Vt, v_smem, (self.hd, self.BLOCK_N))

        warps = self.THREADS // 32  # every warp consumes both pipelines
        self.pipes = (TmaPipe("q", 1, q_bytes, warps), TmaPipe("kv", self.stages, k_bytes + v_bytes, warps))
        self.smem_struct = smem_struct(self.pipes, {"sQ": (dtype, q_smem), "sK": (dtype, k_smem), "sV": (dtype, v_smem)})
        return AttentionOperands(qk_mma, pv_mma, tma_q, tma_Q, tma_k, tma_K, tma_v, tma_Vt, q_smem, k_smem, v_smem)

    # -- in the kernel ----------------------------------------------------------------------

    @cute.jit
    def setup_and_load(self, warp_idx, ops: AttentionOperands):
        """Shared memory and pipelines, then the load role's prologue (warp 0): Q and the first `stages`
                KV tiles.  Returns (sQ, sK, sV, q_pipe, kv_loader); `mma` issues the refills."""
        bm, bn, hd = self.BLOCK_M, self.BLOCK_N, self.hd
        _, _, tma_q, mQ, tma_k, mK, tma_v, mVt, q_smem, k_smem, v_smem = ops
        if warp_idx == 0:
            prefetch_descriptors(tma_q, tma_k, tma_v)
        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ, sK, sV = smem_tensors(storage, sQ=q_smem, sK=k_smem, sV=v_smem)  # (128, hd, 1), (128, hd, st), (hd, 128, st)
        q_pipe, kv_pipe = tma_pipelines(storage, self.pipes)

        q_load = tma_tiles(tma_q, sQ, mQ, (bm, hd), (None, 0))  # Q (128, hd, 1)
        kv_loader = TileLoader.create(
            kv_pipe,
            self.stages,
            tma_tiles(tma_k, sK, mK, (bn, hd), (None, 0)),  # K (128, hd, tiles)
            tma_tiles(tma_v, sV, mVt, (hd, bn), (0, None)),  # Vᵀ (hd, 128, tiles)
        )
        if warp_idx == 0:
            load_once(q_pipe, q_load, 0)
            kv_loader.fill(self.stages)
        return sQ, sK, sV, q_pipe, kv_loader

    @cute.jit
    def mma(self, tidx, warp_idx, ops: AttentionOperands, sQ, sK, sV, q_pipe, kv_loader, o_shape, state):
        """The MMA role (all warps): S, the rung's `between`, P, O += P·V per KV tile; warp 0
        refills each released slot.  Returns the fp32 O accumulator (`o_shape`)."""
        hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
        qk_mma, pv_mma = ops.qk_mma, ops.pv_mma
        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, hd/16, 1)
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, hd/16, stages)
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, 1, 128/16, stages)
        s_shape = thr_qk.partition_shape_C((self.BLOCK_M, self.BLOCK_N))
        acc_o = cute.make_rmem_tensor(o_shape, cutlass.Float32)
        acc_o.fill(0.0)

        wait_once(q_pipe)
        kv_pipe = kv_loader.pipe
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for kv_tile in cutlass.range(self.num_kv_tiles, unroll=1):
            kv_pipe.consumer_wait(cons)
            acc_s = cute.make_rmem_tensor(s_shape, cutlass.Float32)
            wgmma_sync(qk_mma, acc_s, tSrQ, tSrK, a_slot=0, b_slot=cons.index, zero_init=True)
            self.between(acc_s, acc_o, state)
            tOrP = self.p_from_scores(acc_s, thr_pv, (self.BLOCK_M, self.BLOCK_N), sV.element_type)
            wgmma_sync(pv_mma, acc_o, tOrP, tOrV, b_slot=cons.index)
            kv_pipe.consumer_release(cons)
            cons.advance()
            if warp_idx == 0 and kv_tile + self.stages < self.num_kv_tiles:
                kv_loader.produce()  # the released slot ← KV tile kv_tile + stages
        return acc_o

    @cute.jit
    def between(self, acc_s: cute.Tensor, acc_o: cute.Tensor, state) -> None:
        """The rung's step on the fp32 scores `acc_s` (in place) before P = bf16(S), with O's
        accumulator `acc_o` and the rung's `state` at hand.  Here: nothing (S is P)."""
        pass

    def p_from_scores(self, acc_s: cute.Tensor, thr_pv: cute.ThrMma, tile_mk: tuple, dtype) -> cute.Tensor:
        """P = dtype(S) as this thread's register A fragment of the P·V wgmma over (rows, keys)
                `tile_mk`: the same registers re-indexed.  A method so that the wrong-on-purpose fixture
                (tests/fixtures/wrong_b) can replace it."""
        return accumulator_to_a_operand(acc_s, thr_pv, tile_mk, dtype)
