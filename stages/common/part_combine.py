"""The combine of a persistent decode launch (stages/common/part_scheduler.py): merge the
partials of every sequence a part boundary cut, and leave every other row alone.

Row r (rows = (batch, token, head) row-major, `heads` = h_q a sequence) belongs to sequence
s = r // heads, cut into n(s) = ⌊((s + 1)·T − 1) / L⌋ − ⌊s·T / L⌋ + 1 partials in slots 0 … n − 1
of the scratch.  n = 1: the kernel wrote the row's O and LSE itself; the combine does not touch
them.  n > 1: SplitCombine's math (stages/common/combine.py) over those n slots only — the
LSE-weighted sum, an empty partial (LSE −∞) skipped and never read, a row with no key O = 0 and
LSE = +∞, the sink applied once to the merged row.  One warp a row, 4 rows a CTA, lane l the
d/32 contiguous columns from l·d/32 (16-byte loads and stores); every slot's LSE is loaded at
once, then the slots' rows (the loop unrolled over the capacity).

A launch whose attention kernel merged its two-piece sequences itself (stages/common/
part_merge.py; `skip_two`) leaves those alone too.  Only the cut sequences get CTAs: CTA (b, c)
of the grid ((P − 1) · heads / 4) takes part boundary b + 1 and rows 4c … 4c + 3 of the sequence
it cuts (PartGrid.cut_at: each cut sequence is named by
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

    def __init__(self, grid: PartGrid, heads: int, d: int, skip_two: bool = False):
        rows = grid.sequences * heads
        if heads % self.ROWS_PER_CTA or d % 32:
            raise ValueError(f"PartCombine: heads ({heads}) must be a multiple of {self.ROWS_PER_CTA}, d ({d}) of 32")
        self.grid = grid
        self.rows, self.heads, self.d = rows, heads, d
        self.chunks = heads // self.ROWS_PER_CTA  # CTAs a sequence
        self.skip_two = skip_two  # the attention kernel merged every two-piece sequence itself

    def launch(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, sink: cute.Tensor,
               stream):
        """Call from a @cute.jit host function, after the attention kernel on the same stream."""
        self.kernel(o_part, lse_part, o, lse, sink).launch(
            grid=(max(self.grid.parts - 1, 1) * self.chunks, 1, 1), block=(self.THREADS, 1, 1), stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, sink: cute.Tensor):
        rows, cols, cap = self.rows, self.d // 32, self.grid.capacity
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        s, mine = self.grid.cut_at(bidx // self.chunks + 1)
        row = s * self.heads + (bidx % self.chunks) * self.ROWS_PER_CTA + tidx // 32
        n = self.grid.pieces(s)  # > 1 where `mine`: the boundary cuts s
        if cutlass.const_expr(self.skip_two):
            mine = mine & (n > 2)
        cute.arch.griddepcontrol_wait()  # the attention grid is complete, its partials visible
        if mine:
            # every slot's LSE at once (n ≤ capacity; slots past n are never read)
            lses = cute.make_rmem_tensor(cap, Float32)
            m = -Float32.inf
            for j in cutlass.range_constexpr(cap):
                lses[j] = -Float32.inf
                if j < n:
                    lses[j] = lse_part[j * rows + row]
                m = cute.arch.fmax(m, lses[j])
            acc = cute.make_rmem_tensor(cols, Float32)
            acc.fill(0.0)
            total = Float32(0.0)
            for j in cutlass.range_constexpr(cap):
                if lses[j] != -Float32.inf:  # an empty partial (or a slot past n) is skipped, never read
                    w = cute.math.exp2((lses[j] - m) * LOG2_E, fastmath=True)
                    total = total + w
                    vals = cute.make_rmem_tensor(cols, Float32)
                    at = o_part.iterator.toint() + cutlass.Int64(j * rows + row) * (self.d * 4) + lane * (cols * 4)
                    cute.autovec_copy(cute.make_tensor(cute.make_ptr(Float32, at, cute.AddressSpace.gmem, assumed_align=16),
                                                       cute.make_layout(cols)), vals)
                    for k in cutlass.range_constexpr(cols):
                        acc[k] = acc[k] + w * vals[k]
            lonely = total == 0.0
            inv = 0.0 if lonely else cute.arch.rcp_approx(total)
            row_lse = -Float32.inf if lonely else m + cute.math.log2(total, fastmath=True) * LN2
            inv = inv * sink_factor(sink[row % self.heads], row_lse)
            out = cute.make_rmem_tensor(cols, o.element_type)
            for k in cutlass.range_constexpr(cols):
                out[k] = (acc[k] * inv).to(o.element_type)
            size = o.element_type.width // 8
            at = o.iterator.toint() + cutlass.Int64(row) * (self.d * size) + lane * (cols * size)
            cute.autovec_copy(out, cute.make_tensor(cute.make_ptr(o.element_type, at, cute.AddressSpace.gmem,
                                                                  assumed_align=16), cute.make_layout(cols)))
            if lane == 0:
                lse[row] = Float32.inf if lonely else row_lse
