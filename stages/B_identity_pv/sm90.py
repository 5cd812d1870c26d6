"""Stage B on Hopper (sm_90a): two chained WGMMAs with identity softmax.

Math
    S = Q · Kᵀ                      fp32 accumulation, no scale, no exp
    P = bf16(S)                     rounded in registers
    O = P · V                       fp32 accumulation over the KV tiles
    O is written as bf16.   Q [m, hd], K [n, hd], V [n, hd], O [m, hd], bf16,
    row-major.  V is read from its own tensor even when it aliases K.

What is new in this rung: the second MMA, fed from the first one's registers
    Per KV tile of 128 keys, S_tile = Q · K_tileᵀ (SS wgmma m64n128k16) in registers;
    P_tile = bf16(S_tile), the accumulator re-indexed as the A fragment of an RS wgmma
    m64n64k16 with V an MN-major B operand: O += P_tile · V_tile (sm90_idioms.py proves that
    no data moves).

The house: stages/common/sm90_register_p.py (shared with stage C).
"""

import cuda.bindings.driver as cuda

import cutlass.cute as cute

from stages.common.sm90_idioms import store_accumulator
from stages.common.sm90_register_p import AttentionOperands, RegisterPAttention


class Kernel(RegisterPAttention):
    """O[m, hd] (bf16) = bf16(Q · Kᵀ) · V on Hopper, P kept in registers.
        Limits: m == 128, hd == 64, n a multiple of 128; row-major, 16-byte aligned.  One CTA."""

    RUNG = "stage B"

    @cute.jit
    def __call__(self, Q: cute.Tensor, K: cute.Tensor, V: cute.Tensor, O: cute.Tensor, stream: cuda.CUstream):
        self.kernel(self.operands(Q, K, V), O).launch(grid=(1, 1, 1), block=(self.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, ops: AttentionOperands, mO: cute.Tensor):
        """Set-up and loads (warp 0), the two MMAs per KV tile (all warps), O out."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        sQ, sK, sV, q_pipe, kv_loader = self.setup_and_load(warp_idx, ops)
        tOgO = ops.pv_mma.get_slice(tidx).partition_C(mO)  # this thread's O elements in global memory
        acc_o = self.mma(tidx, warp_idx, ops, sQ, sK, sV, q_pipe, kv_loader, tOgO.shape, None)
        store_accumulator(acc_o, tOgO)
