"""Stage B on Hopper (sm_90a): two chained WGMMAs with identity softmax.

Math
    S = Q · Kᵀ                      fp32 accumulation, no scale, no exp
    P = bf16(S)                     rounded in registers
    O = P · V                       fp32 accumulation over the KV tiles
    O is written as bf16.   Q [m, hd], K [n, hd], V [n, hd], O [m, hd], bf16,
    row-major.  V is read from its own tensor even when it aliases K.

Tiling (one CTA, 256 threads = two warpgroups, warpgroup w owns rows 64w..64w+63)
    The keys are cut into KV tiles of 128.  Warp 0 issues TMA loads: Q once,
    then K and V tiles into `stages` shared-memory slots guarded by mbarriers
    (PipelineTmaAsync: the full barrier counts the TMA bytes, the empty
    barrier one arrival per consumer warp).  Per KV tile:

      1. S_tile = Q · K_tileᵀ: wgmma m64n128k16 (both operands from SMEM,
         K-major), hd / 16 steps, 64 fp32 registers per thread.
      2. P_tile = bf16(S_tile), kept in the same thread: the accumulator
         fragment is re-indexed as the register A fragment of the second MMA
         (stages/common/sm90_idioms.py explains why no data moves, and proves
         it at trace time).
      3. O += P_tile · V_tile: wgmma m64n64k16 with A from registers ("RS")
         and V from SMEM as an MN-major B operand (V's rows are keys = the K
         dimension; hd is contiguous), 128 / 16 steps.

    Epilogue: O (32 fp32 per thread) → bf16 → straight to global memory.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

from stages.common.sm90_idioms import (
    accumulator_to_a_operand,
    register_p_mmas,
    register_p_smem_struct,
    tma_pipeline,
    wgmma_sync,
)
from stages.common.inspection import expose
from stages.common.tma import prefetch_descriptors, sm90_tma_load, tma_partition_tile, tma_produce, transpose_view


class Kernel:
    """O[m, hd] (bf16) = bf16(Q · Kᵀ) · V on Hopper tensor cores, P kept in registers.

    Limits: m == 128, hd == 64, n a multiple of 128 (tested: 128, 256);
    row-major, 16-byte aligned, static shapes.  One CTA.
    """

    BLOCK_M = 128  # query rows (two warpgroups × 64)
    BLOCK_N = 128  # keys per KV tile
    MAX_STAGES = 2  # KV tiles in flight (32 KiB each: K tile + V tile)

    def __init__(self, *, m: int, n: int, hd: int):
        if m != self.BLOCK_M:
            raise ValueError(f"stage B sm90: m must be 128, got {m}")
        if hd != 64:
            raise ValueError(f"stage B sm90: hd must be 64 (P in registers), got {hd}")
        if n < self.BLOCK_N or n % self.BLOCK_N != 0:
            raise ValueError(f"stage B sm90: n must be a positive multiple of 128, got {n}")
        self.m, self.n, self.hd = m, n, hd
        self.num_kv_tiles = n // self.BLOCK_N
        self.stages = min(self.num_kv_tiles, self.MAX_STAGES)
        self.num_warpgroups = 2
        self.threads = 128 * self.num_warpgroups

    @cute.jit
    def __call__(
        self,
        Q: cute.Tensor,
        K: cute.Tensor,
        V: cute.Tensor,
        O: cute.Tensor,
        stream: cuda.CUstream,
    ):
        dtype = Q.element_type
        qk_tile = (self.BLOCK_M, self.BLOCK_N, self.hd)  # (M, N, K) of S = Q·Kᵀ
        pv_tile = (self.BLOCK_M, self.hd, self.BLOCK_N)  # (M, N, K) of O = P·V

        # S = Q·Kᵀ (SS wgmma m64n128k16) and O = P·V (RS wgmma m64n64k16, P in
        # registers), two warpgroups along M; the S → P retile checked at trace time.
        qk_mma, pv_mma = register_p_mmas(dtype, self.num_warpgroups, self.BLOCK_N, self.hd)

        q_smem = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, qk_tile, dtype, 1)
        k_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, qk_tile, dtype, self.stages)
        v_smem = sm90_utils.make_smem_layout_b(utils.LayoutEnum.COL_MAJOR, pv_tile, dtype, self.stages)
        expose(self, p_path="registers", qk_mma=(qk_mma, qk_tile), pv_mma=(pv_mma, pv_tile),
               smem={"Q": q_smem, "K": k_smem, "V": v_smem})  # dsv4-lab inspect; no code

        Vt = transpose_view(V)  # V [n, hd] as Vᵀ (hd, n): the B operand of P·V, N = hd leading
        tma_q, tma_Q, q_bytes = sm90_tma_load(Q, q_smem, (self.BLOCK_M, self.hd))
        tma_k, tma_K, k_bytes = sm90_tma_load(K, k_smem, (self.BLOCK_N, self.hd))
        tma_v, tma_Vt, v_bytes = sm90_tma_load(Vt, v_smem, (self.hd, self.BLOCK_N))

        self.smem_struct = register_p_smem_struct(dtype, q_smem, k_smem, v_smem, self.stages)
        self.q_bytes = q_bytes
        self.kv_bytes = k_bytes + v_bytes

        self.kernel(
            qk_mma, pv_mma, tma_q, tma_Q, tma_k, tma_K, tma_v, tma_Vt, O, q_smem, k_smem, v_smem
        ).launch(grid=(1, 1, 1), block=(self.threads, 1, 1), stream=stream)

    def p_from_scores(self, acc_s: cute.Tensor, thr_pv: cute.ThrMma, tile_mk: tuple, dtype) -> cute.Tensor:
        """Step 2: P = dtype(S) as this thread's register A fragment of the P·V
        wgmma (`thr_pv`) over the (M, K) = (rows, keys) tile `tile_mk`, from the
        fp32 S accumulator `acc_s`: the same registers re-indexed, no data moves
        (stages/common/sm90_idioms.py).  A method of its own so that the lab's
        wrong-on-purpose fixture (tests/fixtures/wrong_b) can replace it."""
        return accumulator_to_a_operand(acc_s, thr_pv, tile_mk, dtype)

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
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
        v_smem: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            prefetch_descriptors(tma_q, tma_k, tma_v)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (128, hd, 1)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (128, hd, stages)
        sV = storage.sV.get_tensor(v_smem.outer, swizzle=v_smem.inner)  # (hd, 128, stages)

        consumer_warps = self.threads // 32
        q_pipe = tma_pipeline(storage.q_mbar, 1, self.q_bytes, consumer_warps)
        kv_pipe = tma_pipeline(storage.kv_mbar, self.stages, self.kv_bytes, consumer_warps)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Global tiles: Q (128, hd, 1), K (128, hd, tiles), Vᵀ (hd, 128, tiles).
        gQ = cute.local_tile(mQ, (self.BLOCK_M, self.hd), (None, 0))
        gK = cute.local_tile(mK, (self.BLOCK_N, self.hd), (None, 0))
        gVt = cute.local_tile(mVt, (self.hd, self.BLOCK_N), (0, None))
        tQsQ, tQgQ = tma_partition_tile(tma_q, sQ, gQ, 2)
        tKsK, tKgK = tma_partition_tile(tma_k, sK, gK, 2)
        tVsV, tVgV = tma_partition_tile(tma_v, sV, gVt, 2)

        # MMA fragments. SMEM operands are per warpgroup; accumulators per thread.
        thr_qk = qk_mma.get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        tSrQ = qk_mma.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, hd/16, 1)
        tSrK = qk_mma.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, hd/16, stages)
        tOrV = pv_mma.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, 1, 128/16, stages)
        s_shape = thr_qk.partition_shape_C((self.BLOCK_M, self.BLOCK_N))
        tOgO = thr_pv.partition_C(mO)  # this thread's O elements in global memory
        acc_o = cute.make_rmem_tensor(tOgO.shape, cutlass.Float32)
        acc_o.fill(0.0)

        # Producer prologue (warp 0): Q, then the first `stages` KV tiles.
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if warp_idx == 0:
            q_pipe.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ[(None, 0)], tQsQ[(None, 0)], tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
            for _ in cutlass.range_constexpr(self.stages):
                tma_produce(kv_pipe, prod, (tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV))
                prod.advance()

        q_pipe.consumer_wait(pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1))
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

        for kv_tile in cutlass.range(self.num_kv_tiles, unroll=1):
            kv_pipe.consumer_wait(cons)

            # 1. S = Q · K_tileᵀ
            acc_s = cute.make_rmem_tensor(s_shape, cutlass.Float32)
            wgmma_sync(qk_mma, acc_s, tSrQ, tSrK, a_slot=0, b_slot=cons.index, zero_init=True)

            # 2. P = bf16(S), same registers re-indexed as the A operand.
            tOrP = self.p_from_scores(acc_s, thr_pv, (self.BLOCK_M, self.BLOCK_N), mO.element_type)

            # 3. O += P · V_tile
            wgmma_sync(pv_mma, acc_o, tOrP, tOrV, b_slot=cons.index)

            kv_pipe.consumer_release(cons)
            cons.advance()

            # Refill the released slot with KV tile kv_tile + stages.
            if warp_idx == 0 and kv_tile + self.stages < self.num_kv_tiles:
                tma_produce(kv_pipe, prod, (tma_k, tKgK, tKsK), (tma_v, tVgV, tVsV))
                prod.advance()

        # Epilogue: fp32 → bf16, each thread stores its own fragment.
        out = cute.make_rmem_tensor(tOgO.shape, mO.element_type)
        out.store(acc_o.load().to(mO.element_type))
        cute.autovec_copy(out, tOgO)
