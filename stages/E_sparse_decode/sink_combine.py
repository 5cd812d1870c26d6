"""Split-KV combine with DSV4's attention sink, for stage E.

The merge is stages/common/combine.py's (see its doc for the math and the empty-split rule):
    lse = M + log Σ_i exp(lse_i − M),   O = Σ_i exp(lse_i − lse) · O_i
then, once, after the merge, the sink of the row's head h (rows are (batch, token, head)
row-major, so h = row mod h_q):
    O ← O · 1 / (1 + exp(sink[h] − lse))           sink = −∞ → ×1, sink = +∞ → ×0
The returned LSE does not include the sink.  A row whose every split is empty has no key: O = 0
and LSE = +∞ whatever the sink (the factor is not even computed there, so −∞ − (−∞) never
happens).  `sink_factor` is the same rule for the one-split epilogue.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


@cute.jit
def sink_factor(sink: Float32, lse: Float32) -> Float32:
    """1 / (1 + exp(sink − lse)) for a row with keys (lse finite); 1 where lse = −∞ (a lonely
    row: its O is 0 anyway, and −∞ − (−∞) must not be formed)."""
    f = Float32(1.0)
    if lse != -Float32.inf:
        f = cute.arch.rcp_approx(1.0 + cute.math.exp2((sink - lse) * LOG2_E, fastmath=True))
    return f


class SinkCombine:
    """GPU combine of `splits` fp32 partials of `rows` rows × `d` columns into O and LSE, with
    the sink of `h_q` heads applied after the merge.  One warp per row, 4 rows per CTA; lane l
    owns columns l, l + 32, … (stages/common/combine.py's SplitCombine plus the sink).

        o_part (splits · rows, d) fp32, lse_part (splits · rows,) fp32, o (rows, d),
        lse: `rows` elements in row order (DSV4's [b, h_q, s_q] through a layout), sink (h_q,)"""

    ROWS_PER_CTA = 4
    THREADS = 32 * ROWS_PER_CTA

    def __init__(self, rows: int, splits: int, d: int, h_q: int):
        if rows % self.ROWS_PER_CTA or d % 32 or rows % h_q:
            raise ValueError(f"SinkCombine: rows must be a multiple of {self.ROWS_PER_CTA} and of h_q, d of 32; "
                             f"got rows {rows}, d {d}, h_q {h_q}")
        self.rows, self.splits, self.d, self.h_q = rows, splits, d, h_q

    def launch(self, o_part, lse_part, o, lse, sink, stream):
        """Call from a @cute.jit host function (after the split kernel, same stream)."""
        self.kernel(o_part, lse_part, o, lse, sink).launch(
            grid=(self.rows // self.ROWS_PER_CTA, 1, 1), block=(self.THREADS, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, sink: cute.Tensor):
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
        merged = -Float32.inf if lonely else m + cute.math.log2(total, fastmath=True) * LN2
        inv = 0.0 if lonely else cute.arch.rcp_approx(total) * sink_factor(sink[row % self.h_q], merged)
        for k in cutlass.range_constexpr(cols):
            o[row, lane + 32 * k] = (acc[k] * inv).to(o.element_type)
        if lane == 0:
            lse[row] = Float32.inf if lonely else merged
