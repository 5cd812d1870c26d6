"""Split-KV combine: merge the partial results of KV splits by their LSE.

Math.  Split i attended keys K_i (the splits partition the keys) and wrote, per query row,
its normalised partial output O_i = softmax(S_i) · V_i and its partial LSE
lse_i = log Σ_{j ∈ K_i} exp(s_j).  With M = max_i lse_i,

    lse = M + log Σ_i exp(lse_i − M)              = log Σ_j exp(s_j) over all keys
    O   = Σ_i exp(lse_i − lse) · O_i              = softmax(S) · V over all keys

(exp(lse_i − lse) = ℓ_i / ℓ, so each partial is re-weighted by its share of the row sum).

Empty splits.  A split with no key has lse_i = log 0 = −∞ and O_i = 0; its weight
exp(−∞ − lse) is 0, but it is IGNORED outright (skipped, never multiplied), so nothing it
holds — not even a NaN — can reach O.  A row where every split is empty has no key at all:
O = 0 and lse = +∞ (DSV4's lonely-row convention), never NaN.

`combine_reference` is this math in float64 on torch tensors (the CPU tests use it);
`SplitCombine` is the GPU kernel (one warp per row, fp32, lanes over the columns).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


def combine_reference(o_parts, lse_parts):
    """(O [rows, d], lse [rows]) in float64 from o_parts [splits, rows, d] and
    lse_parts [splits, rows] (torch tensors), ignoring empty splits (lse_i = −∞)."""
    import torch

    o_parts = o_parts.double()
    lse_parts = lse_parts.double()
    live = lse_parts > -math.inf  # [splits, rows]
    m = torch.where(live, lse_parts, torch.full_like(lse_parts, -math.inf)).amax(dim=0)  # [rows]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.where(live, torch.exp(lse_parts - m_safe), torch.zeros_like(lse_parts))
    total = w.sum(dim=0)
    lonely = total == 0
    lse = torch.where(lonely, torch.full_like(m, math.inf), m_safe + torch.log(torch.where(lonely, torch.ones_like(total), total)))
    contrib = torch.where(live[..., None], o_parts, torch.zeros_like(o_parts)) * w[..., None]
    o = contrib.sum(dim=0) / torch.where(lonely, torch.ones_like(total), total)[:, None]
    return o, lse


class SplitCombine:
    """GPU combine of `splits` partials of `rows` rows × `d` columns (fp32) into O (any float
    dtype) and LSE.  One warp per row, 4 rows per CTA; lane l owns columns l, l + 32, …

    Tensors (all indexed by a flat row r, CuTe's column-major linear index):
        o_part  (splits · rows, d) fp32     row s · rows + r is split s of row r
        lse_part (splits · rows,) fp32
        o       (rows, d)
        lse     any layout of `rows` elements (e.g. DSV4's [b, h_q, s_q] seen in row order)"""

    ROWS_PER_CTA = 4
    THREADS = 32 * ROWS_PER_CTA

    def __init__(self, rows: int, splits: int, d: int):
        if rows % self.ROWS_PER_CTA or d % 32:
            raise ValueError(f"SplitCombine: rows must be a multiple of {self.ROWS_PER_CTA} and d of 32, got {rows}, {d}")
        self.rows, self.splits, self.d = rows, splits, d

    def launch(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, stream):
        """Call from a @cute.jit host function (e.g. after the split kernel, same stream)."""
        self.kernel(o_part, lse_part, o, lse).launch(
            grid=(self.rows // self.ROWS_PER_CTA, 1, 1), block=(self.THREADS, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor):
        rows, d = self.rows, self.d
        cols = d // 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * self.ROWS_PER_CTA + tidx // 32

        m = -Float32.inf
        for s in cutlass.range(self.splits, unroll=1):
            m = cute.arch.fmax(m, lse_part[s * rows + row])

        acc = cute.make_rmem_tensor(cols, Float32)
        acc.fill(0.0)
        total = Float32(0.0)
        for s in cutlass.range(self.splits, unroll=1):
            l_s = lse_part[s * rows + row]
            if l_s != -Float32.inf:  # an empty split is skipped, never read
                w = cute.math.exp2((l_s - m) * LOG2_E, fastmath=True)
                total = total + w
                for k in cutlass.range_constexpr(cols):
                    acc[k] = acc[k] + w * o_part[s * rows + row, lane + 32 * k]

        lonely = total == 0.0
        inv = 0.0 if lonely else cute.arch.rcp_approx(total)
        for k in cutlass.range_constexpr(cols):
            o[row, lane + 32 * k] = (acc[k] * inv).to(o.element_type)
        if lane == 0:
            lse[row] = Float32.inf if lonely else m + cute.math.log2(total, fastmath=True) * LN2
