"""Stage A on Hopper (sm_90a): S = Q · Kᵀ with WGMMA and TMA.

Math
    S[i, j] = Σ_d Q[i, d] · K[j, d]        i < m = 128, j < n, d < hd
    bf16 inputs, fp32 accumulation, fp32 output, no scale.

Tiling
    One CTA computes a 128 × 128 block of S; the grid runs over the n / 128
    key blocks (n ∈ {128, 256}, so 1 or 2 CTAs).  The head dimension is cut
    into K-blocks of 64 bf16 (128 bytes = one 128-byte swizzle row), so there
    are hd / 64 ∈ {1, 2, 4, 8} K-blocks.

    Per K-block, one elected thread issues two TMA loads (Q block 128 × 64 and
    K block 128 × 64, both K-major) into one of `stages` shared-memory slots;
    an mbarrier with a transaction count tells the consumers when the bytes
    have landed.  Two warpgroups (256 threads) each own 64 rows of the tile
    and run wgmma.m64n128k16 four times per K-block (64 / 16), accumulating in
    registers (64 fp32 per thread).  After each K-block the slot is released
    so the producer can refill it with K-block + stages.

    Epilogue: each thread stores its accumulator fragment straight to global
    memory (pairs of adjacent fp32 columns), which covers the whole tile.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup


class Kernel:
    """S[m, n] (fp32) = Q[m, hd] (bf16) · K[n, hd]ᵀ (bf16) on Hopper tensor cores.

    WGMMA (SMEM × SMEM → registers) fed by TMA through an mbarrier pipeline.
    Limits: m == 128, n ∈ {128, 256}, hd ∈ {64, 128, 256, 512}; all tensors
    row-major, 16-byte aligned, static shapes.
    """

    BLOCK_M = 128  # query rows per CTA (two warpgroups × 64)
    BLOCK_N = 128  # keys per CTA
    BLOCK_K = 64  # head-dim elements per K-block (128 bytes of bf16)
    MAX_STAGES = 4  # shared-memory slots (32 KiB each)

    def __init__(self, *, m: int, n: int, hd: int):
        if m != 128:
            raise ValueError(f"stage A sm90: m must be 128, got {m}")
        if n not in (128, 256):
            raise ValueError(f"stage A sm90: n must be 128 or 256, got {n}")
        if hd not in (64, 128, 256, 512):
            raise ValueError(f"stage A sm90: hd must be 64, 128, 256 or 512, got {hd}")
        self.m, self.n, self.hd = m, n, hd
        self.num_k_blocks = hd // self.BLOCK_K
        self.stages = min(self.num_k_blocks, self.MAX_STAGES)
        self.cta_tile = (self.BLOCK_M, self.BLOCK_N, self.BLOCK_K)
        self.num_warpgroups = 2
        self.threads = 128 * self.num_warpgroups

    @cute.jit
    def __call__(self, Q: cute.Tensor, K: cute.Tensor, S: cute.Tensor, stream: cuda.CUstream):
        ab_dtype = Q.element_type
        # Row-major Q [m, hd] and K [n, hd]: both operands are K-major.
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            ab_dtype,
            ab_dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            cutlass.Float32,
            (self.num_warpgroups, 1, 1),  # warpgroups stacked along M
            tiler_mn=(64, self.BLOCK_N),
        )
        q_smem = sm90_utils.make_smem_layout_a(
            utils.LayoutEnum.ROW_MAJOR, self.cta_tile, ab_dtype, self.stages
        )
        k_smem = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.ROW_MAJOR, self.cta_tile, ab_dtype, self.stages
        )
        q_smem_one = cute.slice_(q_smem, (None, None, 0))
        k_smem_one = cute.slice_(k_smem, (None, None, 0))

        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_op, Q, q_smem_one, (self.BLOCK_M, self.BLOCK_K)
        )
        tma_k, tma_K = cpasync.make_tiled_tma_atom(
            tma_op, K, k_smem_one, (self.BLOCK_N, self.BLOCK_K)
        )

        @cute.struct
        class Smem:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(q_smem)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(k_smem)], 1024]

        self.smem_struct = Smem
        # Bytes one stage's two TMA loads deposit on its full barrier.
        self.tx_bytes = cute.size_in_bytes(ab_dtype, q_smem_one) + cute.size_in_bytes(ab_dtype, k_smem_one)

        self.kernel(tiled_mma, tma_q, tma_Q, tma_k, tma_K, S, q_smem, k_smem).launch(
            grid=(self.n // self.BLOCK_N, 1, 1),
            block=(self.threads, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK: cute.Tensor,
        mS: cute.Tensor,
        q_smem: cute.ComposedLayout,
        k_smem: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n_blk, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.smem_struct)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (128, 64, stages)
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (128, 64, stages)

        # Full barrier: 1 producer arrival + TMA bytes.  Empty barrier: one
        # arrival per consumer warp (consumer_release signals from lane 0).
        pipe = pipeline.PipelineTmaAsync.create(
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=self.tx_bytes,
            barrier_storage=storage.mbar.data_ptr(),
        )

        # Global tiles: (128, 64, num_k_blocks) for Q and K, (128, 128) for S.
        gQ = cute.local_tile(mQ, (self.BLOCK_M, self.BLOCK_K), (0, None))
        gK = cute.local_tile(mK, (self.BLOCK_N, self.BLOCK_K), (n_blk, None))
        gS = cute.local_tile(mS, (self.BLOCK_M, self.BLOCK_N), (0, n_blk))

        # TMA partitions: one copy moves a whole (128, 64) block.
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )

        # MMA operands are per warpgroup (shared-memory descriptors); the
        # accumulator and its global image are per thread.
        thr_mma_wg = tiled_mma.get_slice(wg_idx * 128)
        tCrQ = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sQ))  # (MMA, MMA_M, MMA_K, stages)
        tCrK = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sK))  # (MMA, MMA_N, MMA_K, stages)
        tCgS = tiled_mma.get_slice(tidx).partition_C(gS)  # (MMA, MMA_M, MMA_N)
        acc = cute.make_rmem_tensor(tCgS.shape, cutlass.Float32)

        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

        # Prologue: fill every slot.
        if warp_idx == 0:
            for _ in cutlass.range_constexpr(self.stages):
                pipe.producer_acquire(prod)
                bar = pipe.producer_get_barrier(prod)
                cute.copy(tma_q, tQgQ[(None, prod.count)], tQsQ[(None, prod.index)], tma_bar_ptr=bar)
                cute.copy(tma_k, tKgK[(None, prod.count)], tKsK[(None, prod.index)], tma_bar_ptr=bar)
                pipe.producer_commit(prod)
                prod.advance()

        # Main loop over K-blocks (fully unrolled: at most 8).
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        mma_k_steps = cute.size(tCrQ, mode=[2])
        for kb in cutlass.range_constexpr(self.num_k_blocks):
            pipe.consumer_wait(cons)
            warpgroup.fence()
            for kk in cutlass.range_constexpr(mma_k_steps):
                crd = (None, None, kk, cons.index)
                cute.gemm(tiled_mma, acc, tCrQ[crd], tCrK[crd], acc)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            pipe.consumer_release(cons)
            cons.advance()
            # Refill the slot just released with K-block kb + stages.
            if kb + self.stages < self.num_k_blocks:
                if warp_idx == 0:
                    pipe.producer_acquire(prod)
                    bar = pipe.producer_get_barrier(prod)
                    cute.copy(tma_q, tQgQ[(None, prod.count)], tQsQ[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_k, tKgK[(None, prod.count)], tKsK[(None, prod.index)], tma_bar_ptr=bar)
                    pipe.producer_commit(prod)
                    prod.advance()

        # Epilogue: registers → global, each thread its own fragment.
        cute.autovec_copy(acc, tCgS)
