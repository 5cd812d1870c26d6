"""Stage D2 on Blackwell (sm_100a): DSV4 MQA decode attention — batches, tokens, query
heads folded into M, one latent KV head read once for both GEMMs, split-KV with an LSE
combine.  tcgen05 MMAs, S and O in tensor memory (TMEM), P through shared memory.

Compiled and inspected (PTX inventory, ptxas) only, never run on a Blackwell GPU: not verified.

Contract (oracles/decode.py's tensors, in this order; the case axes are `shape` and `splits`)
    Q [b, s_q, h_q, d] bf16, KV [b, n_alloc, d] bf16 (K = V; rows n … n_alloc−1 never read),
    O [b, s_q, h_q, d] bf16, LSE [b, h_q, s_q] fp32, O_part / LSE_part (split scratch).

This rung is the sm100 decode house itself (stages/common/sm100_decode.py) over dense keys:
the CTA visits its split's KV tiles [begin, end) of one KV tensor (sm100_keys.DenseKeys), no
mask, no sink.  An empty split writes O_part = 0, LSE_part = −∞ (the combine skips it).
"""

import cuda.bindings.driver as cuda

import cutlass.cute as cute

from stages.common.scheduler import DecodeShape
from stages.common.sm100_decode import (  # noqa: F401  (re-exported: the D2 tests and inspect read them here)
    B200_SMS,
    KV_TILE,
    DecodeSm100,
    check_kv_same_bytes,
    default_o_split,
    ring_plan,
    tmem_budget,
    tmem_budget_error,
)
from stages.common.sm100_keys import DenseKeys


class Kernel(DecodeSm100):
    """DSV4 MQA decode attention over dense keys with split-KV (stages/common/sm100_decode.py).
        Options beyond the stage's axes: o_split, s_stages, sm_count (DecodeSm100)."""

    NAME = "stage D2 sm100"

    def __init__(self, *, shape: str, splits, sm_count: int = B200_SMS,
                 o_split: int | None = None, s_stages: int = 2):
        self.setup_plan(DecodeShape.parse(shape), splits, sm_count, o_split, s_stages)

    @cute.jit
    def __call__(self, Q: cute.Tensor, KV: cute.Tensor, O: cute.Tensor, LSE: cute.Tensor,
                 O_part: cute.Tensor, LSE_part: cute.Tensor, stream: cuda.CUstream):
        self._check_tensors(Q, O, LSE, O_part, LSE_part, KV=(KV, (self.b, self.p.n_alloc, self.d)))
        v, ops, tma_q, tma_Q = self.prepare(Q, O, LSE, O_part, LSE_part)
        qk_mma, pv_mma, q_smem, k_smem, v_smem, p_smem = ops
        tma_k, tma_K = self.kv_atom(qk_mma, k_smem, self.kv_view(KV, self.n, self.p.n_alloc))
        self.start(self.kernel(qk_mma, pv_mma, tma_q, tma_Q, tma_k, tma_K, v.eO, v.mLSE, v.eOp, v.mLp,
                               q_smem, k_smem, v_smem, p_smem), stream)
        self.combine(v, stream)

    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_q: cute.CopyAtom, mQ: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mOp: cute.Tensor,
               mLSEp: cute.Tensor, q_smem: cute.ComposedLayout, k_smem: cute.ComposedLayout,
               v_smem: cute.ComposedLayout, p_smem: cute.ComposedLayout):
        bx, split, batch = cute.arch.block_idx()
        work = self.sched.work(bx // self.o_split, split, batch)  # stages/common/scheduler.py
        keys = DenseKeys(work.tile_begin, work.tile_end, (tma_k, mK))
        self.attend(keys, work.token, split, batch, qk_mma, pv_mma, tma_q, mQ, mO, mLSE, mOp, mLSEp,
                    q_smem, k_smem, v_smem, p_smem, None)
