"""Stage A on Hopper (sm_90a): S = Q · Kᵀ with WGMMA and TMA.

Math
    S[i, j] = Σ_d Q[i, d] · K[j, d]        i < m = 128, j < n, d < hd
    bf16 inputs, fp32 accumulation, fp32 output, no scale.

Tiling
    One CTA computes a 128 × 128 block of S; the grid runs over the n / 128
    key blocks (n ∈ {128, 256}, so 1 or 2 CTAs).  The head dimension is cut
    into K-blocks of 64 bf16 (128 bytes = one 128-byte swizzle row), so there
    are hd / 64 ∈ {1, 2, 4, 8} K-blocks.

    Per K-block one elected thread TMA-loads Q and K blocks (128 × 64, K-major) into one of
    `stages` slots (an mbarrier with a transaction count); two warpgroups each own 64 rows and
    run wgmma.m64n128k16 four times a K-block into 64 fp32 registers; the slot is then
    released.  Epilogue: each thread stores its fragment straight to global memory.
"""

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils

from stages.common import hang_guard
from stages.common.inspection import expose
from stages.common.sm90_idioms import qk_tiled_mma, wgmma_sync
from stages.common.sm90_setup import TileLoader, TmaPipe, smem_struct, smem_tensors, tma_pipelines, tma_tiles
from stages.common.tma import prefetch_descriptors, sm90_tma_load


class Kernel:
    """S[m, n] (fp32) = Q[m, hd] · K[n, hd]ᵀ (bf16) with WGMMA and TMA.
        Limits: m == 128, n ∈ {128, 256}, hd ∈ {64, 128, 256, 512}; row-major, 16-byte aligned."""

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
        dtype = Q.element_type
        # S = Q·Kᵀ: SS wgmma m64n128k16, both operands K-major, two warpgroups along M.
        tiled_mma = qk_tiled_mma(dtype, (self.num_warpgroups, 1, 1), 64, self.BLOCK_N)
        q_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, self.cta_tile, dtype, self.stages)
        k_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.cta_tile, dtype, self.stages)
        expose(self, qk_mma=(tiled_mma, self.cta_tile), smem={"Q": q_smem, "K": k_smem})  # dsv4-lab inspect
        tma_q, tma_Q, q_bytes = sm90_tma_load(Q, q_smem, (self.BLOCK_M, self.BLOCK_K))
        tma_k, tma_K, k_bytes = sm90_tma_load(K, k_smem, (self.BLOCK_N, self.BLOCK_K))

        # One pipeline: a slot holds one K-block of Q and of K; every warp consumes it.
        self.pipes = (TmaPipe("qk", self.stages, q_bytes + k_bytes, self.threads // 32),)
        self.smem_struct = smem_struct(self.pipes, {"sQ": (dtype, q_smem), "sK": (dtype, k_smem)})

        self.kernel(tiled_mma, tma_q, tma_Q, tma_k, tma_K, S, q_smem, k_smem).launch(
            grid=(self.n // self.BLOCK_N, 1, 1),
            block=(self.threads, 1, 1),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom,
               mK: cute.Tensor, mS: cute.Tensor, q_smem: cute.ComposedLayout, k_smem: cute.ComposedLayout):
        """Set-up, then every warp multiplies (warp 0 also loads) and stores its S fragment."""
        tidx, _, _ = cute.arch.thread_idx()
        n_blk, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            prefetch_descriptors(tma_q, tma_k)

        storage = cutlass.utils.SmemAllocator().allocate(self.smem_struct)
        sQ, sK = smem_tensors(storage, sQ=q_smem, sK=k_smem)  # (128, 64, stages) each
        (pipe,) = tma_pipelines(storage, self.pipes)

        # Load role (warp 0): K-block kb of Q's rows and of this CTA's keys into one slot.
        loader = TileLoader.create(
            pipe,
            self.stages,
            tma_tiles(tma_q, sQ, mQ, (self.BLOCK_M, self.BLOCK_K), (0, None)),
            tma_tiles(tma_k, sK, mK, (self.BLOCK_N, self.BLOCK_K), (n_blk, None)),
        )
        if warp_idx == 0:
            loader.fill(self.stages)

        tCgS = tiled_mma.get_slice(tidx).partition_C(cute.local_tile(mS, (self.BLOCK_M, self.BLOCK_N), (0, n_blk)))
        acc = self.mma(tidx, warp_idx, tiled_mma, pipe, loader, sQ, sK, tCgS.shape)
        cute.autovec_copy(acc, tCgS)  # epilogue: each thread stores its own fragment (fp32)

    @cute.jit
    def mma(self, tidx, warp_idx, tiled_mma, pipe, loader, sQ, sK, acc_shape):
        """S = Σ over K-blocks of Q_kb · K_kbᵀ (fully unrolled: at most 8 K-blocks): wait for a
        slot, multiply, release it, and (warp 0) refill it with K-block kb + stages."""
        hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
        # Operands per warpgroup (shared-memory descriptors); the accumulator per thread.
        thr_mma_wg = tiled_mma.get_slice(cute.arch.make_warp_uniform(tidx // 128) * 128)
        tCrQ = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sQ))  # (MMA, MMA_M, MMA_K, stages)
        tCrK = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sK))  # (MMA, MMA_N, MMA_K, stages)
        acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for kb in cutlass.range_constexpr(self.num_k_blocks):
            pipe.consumer_wait(cons)
            wgmma_sync(tiled_mma, acc, tCrQ, tCrK, a_slot=cons.index, b_slot=cons.index, zero_init=kb == 0)
            pipe.consumer_release(cons)
            cons.advance()
            if kb + self.stages < self.num_k_blocks:
                if warp_idx == 0:
                    loader.produce()
        return acc
