"""Stage C on Hopper (sm_90a): attention with an online softmax between two WGMMAs.

Math (one CTA, all m = 128 query rows, all n keys)
    s = Q · Kᵀ · scale,  scale = 1 / sqrt(hd)
    O = softmax(s) · V                      (row-wise softmax over the n keys)
    LSE[i] = ln Σ_j exp(s[i, j])            natural log, fp32
    Q [m, hd], K [n, hd], V [n, hd], O [m, hd] bf16 row-major; LSE [m] fp32.
The online softmax over KV tiles of 128 keys is stages/common/softmax.py's (base 2).

A row of S spans a quad (2 adjacent columns of every 8-wide block a lane): the row max is the
thread's max and two butterfly shuffles (xor 2, xor 1); ℓ stays a per-thread partial until the
end.  New in this rung: `between` (the online softmax) and `finish` (O / ℓ, the LSE by one lane
of each quad); the rest is stage B's house (stages/common/sm90_register_p.py)."""

import math

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute

from stages.common.sm90_idioms import acc_rows_cols, store_accumulator
from stages.common.sm90_register_p import AttentionOperands, RegisterPAttention
from stages.common.softmax import OnlineSoftmax, scale_rows


class Kernel(RegisterPAttention):
    """O = softmax(Q·Kᵀ/sqrt(hd))·V and its LSE on Hopper, P in registers between the WGMMAs.
        Limits: m == 128, hd == 64, n a multiple of 128; row-major, 16-byte aligned.  One CTA."""

    RUNG = "stage C"

    def __init__(self, *, m: int, n: int, hd: int):
        super().__init__(m=m, n=n, hd=hd)
        self.scale_log2 = math.log2(math.e) / math.sqrt(hd)  # c above

    @cute.jit
    def __call__(self, Q: cute.Tensor, K: cute.Tensor, V: cute.Tensor, O: cute.Tensor, LSE: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(self.operands(Q, K, V), O, LSE).launch(grid=(1, 1, 1), block=(self.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, ops: AttentionOperands, mO: cute.Tensor, mLSE: cute.Tensor):
        """Set-up and loads (warp 0), the MMAs with the softmax between them (all warps),
        then O / ℓ and the LSE."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        sQ, sK, sV, q_pipe, kv_loader = self.setup_and_load(warp_idx, ops)
        thr_pv = ops.pv_mma.get_slice(tidx)
        tOgO = thr_pv.partition_C(mO)  # this thread's O elements in global memory
        tOcO_rc = acc_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.BLOCK_M, self.hd))))  # (row, col)
        # This thread's rows; no row of this rung is keyless (lonely_rows=False: no select).
        softmax = OnlineSoftmax.create(cute.size(tOcO_rc, mode=[0]), self.scale_log2, lonely_rows=False)
        acc_o = self.mma(tidx, warp_idx, ops, sQ, sK, sV, q_pipe, kv_loader, tOgO.shape, softmax)
        self.finish(softmax, acc_o, tOcO_rc, mLSE)
        store_accumulator(acc_o, tOgO)

    @cute.jit
    def between(self, acc_s: cute.Tensor, acc_o: cute.Tensor, softmax: OnlineSoftmax) -> None:
        """Online softmax, row by row: S ← P = 2^(S·c − m_new·c), ℓ and O rescaled by α."""
        acc_s_rc = acc_rows_cols(acc_s)
        acc_o_rc = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(softmax.num_rows):
            scale_rows(acc_o_rc, r, softmax.update_row(acc_s_rc, r))

    @cute.jit
    def finish(self, softmax: OnlineSoftmax, acc_o: cute.Tensor, tOcO_rc: cute.Tensor, mLSE: cute.Tensor) -> None:
        """ℓ over the quad, O /= ℓ, LSE = (m·c + log2 ℓ)·ln 2 (one lane of the quad writes it)."""
        inv_sum = cute.make_rmem_tensor(softmax.num_rows, cutlass.Float32)
        lse = cute.make_rmem_tensor(softmax.num_rows, cutlass.Float32)
        softmax.finalize(inv_sum, lse)
        acc_o_rc = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(softmax.num_rows):
            scale_rows(acc_o_rc, r, inv_sum[r])
            if tOcO_rc[r, 0][1] == 0:
                mLSE[tOcO_rc[r, 0][0]] = lse[r]
