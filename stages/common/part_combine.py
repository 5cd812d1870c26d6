"""The combine of a persistent decode launch (stages/common/part_scheduler.py): merge the
partials of every sequence a part boundary cut, and leave every other row alone.

Row r (rows = (batch, token, head) row-major, `heads` = h_q a sequence) belongs to sequence
s = r // heads, cut into n(s) = ⌊((s + 1)·T − 1) / L⌋ − ⌊s·T / L⌋ + 1 partials in slots 0 … n − 1
of the scratch.  n = 1: the kernel wrote the row's O and LSE itself; the combine does not touch
them.  n > 1: SplitCombine's math (stages/common/combine.py) over those n slots only — the
LSE-weighted sum, an empty partial (LSE −∞) skipped and never read, a row with no key O = 0 and
LSE = +∞, the sink applied once to the merged row.  One warp a row, 4 rows a CTA, lane l the
columns l, l + 32, …

Only the cut sequences get CTAs: CTA (b, c) of the grid ((P − 1) · heads / 4) takes part boundary
b + 1 and rows 4c … 4c + 3 of the sequence it cuts (PartGrid.cut_at: each cut sequence is named by
one boundary; a boundary at a sequence's start, or a later one inside an already named sequence,
leaves its CTAs idle).  It is launched with programmatic dependent launch: its CTAs wait
(griddepcontrol.wait) for the attention grid to complete and its memory to be visible, so its
launch overlaps the attention kernel's tail instead of following it.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from stages.common.combine import LN2, LOG2_E, sink_factor
from stages.common.part_scheduler import PartGrid


class PartCombine:
    """GPU combine for a part schedule of `num_tiles` (T) tiles a sequence cut into parts of
    `part_tiles` (L): o_part (capacity · rows, d) fp32 slot-major, lse_part (capacity · rows,),
    o (rows, d), lse (rows,) in row order, sink [heads] fp32 (−∞: no sink)."""

    ROWS_PER_CTA = 4
    THREADS = 32 * ROWS_PER_CTA

    def __init__(self, grid: PartGrid, heads: int, d: int):
        rows = grid.sequences * heads
        if heads % self.ROWS_PER_CTA or d % 32:
            raise ValueError(f"PartCombine: heads ({heads}) must be a multiple of {self.ROWS_PER_CTA}, d ({d}) of 32")
        self.grid = grid
        self.rows, self.heads, self.T, self.L, self.d = rows, heads, grid.num_tiles, grid.part_tiles, d
        self.chunks = heads // self.ROWS_PER_CTA  # CTAs a sequence

    def launch(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, sink: cute.Tensor,
               stream):
        """Call from a @cute.jit host function, after the attention kernel on the same stream."""
        self.kernel(o_part, lse_part, o, lse, sink).launch(
            grid=(max(self.grid.parts - 1, 1) * self.chunks, 1, 1), block=(self.THREADS, 1, 1), stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, sink: cute.Tensor):
        rows, cols = self.rows, self.d // 32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        s, mine = self.grid.cut_at(bidx // self.chunks + 1)
        row = s * self.heads + (bidx % self.chunks) * self.ROWS_PER_CTA + tidx // 32
        n = ((s + 1) * self.T - 1) // self.L - (s * self.T) // self.L + 1
        cute.arch.griddepcontrol_wait()  # the attention grid is complete, its partials visible
        if mine & (n > 1):
            m = -Float32.inf
            for j in cutlass.range(n, unroll=1):
                m = cute.arch.fmax(m, lse_part[j * rows + row])
            acc = cute.make_rmem_tensor(cols, Float32)
            acc.fill(0.0)
            total = Float32(0.0)
            for j in cutlass.range(n, unroll=1):
                l_j = lse_part[j * rows + row]
                if l_j != -Float32.inf:  # an empty partial is skipped, never read
                    w = cute.math.exp2((l_j - m) * LOG2_E, fastmath=True)
                    total = total + w
                    for k in cutlass.range_constexpr(cols):
                        acc[k] = acc[k] + w * o_part[j * rows + row, lane + 32 * k]
            lonely = total == 0.0
            inv = 0.0 if lonely else cute.arch.rcp_approx(total)
            row_lse = -Float32.inf if lonely else m + cute.math.log2(total, fastmath=True) * LN2
            inv = inv * sink_factor(sink[row % self.heads], row_lse)
            for k in cutlass.range_constexpr(cols):
                o[row, lane + 32 * k] = (acc[k] * inv).to(o.element_type)
            if lane == 0:
                lse[row] = Float32.inf if lonely else row_lse
