"""Split-KV combine: merge the partial results of KV splits by their LSE.

Math.  Split i wrote, per query row, its normalised O_i = softmax(S_i) · V_i and lse_i =
log Σ_{j ∈ K_i} exp(s_j).  With M = max_i lse_i,

    lse = M + log Σ_i exp(lse_i − M)              = log Σ_j exp(s_j) over all keys
    O   = Σ_i exp(lse_i − lse) · O_i              = softmax(S) · V over all keys

Empty splits (lse_i = −∞, O_i = 0) are skipped, never multiplied (a NaN in them cannot reach O);
all empty: O = 0, lse = +∞ (DSV4's lonely row).

Attention sink (D5): one logit sink[h] per head, in the denominator only:

    O_sink = O · e^lse / (e^lse + e^sink) = O / (1 + e^(sink − lse)),    lse unchanged

applied ONCE, to the merged row.  `sink_factor`: sink = −∞ → 1, sink = +∞ → 0, lse = −∞ → 0,
never NaN.  `combine_reference`: float64 torch; `SplitCombine`: the GPU kernel."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from stages.common.fp8_epilogue import Fp8Out, store_strided_row_fp8

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


@cute.jit
def sink_factor(sink: Float32, lse: Float32) -> Float32:
    """1 / (1 + e^(sink − lse)), the factor a sink puts on a row's O (see the module doc);
    `lse` is the row's natural-log LSE over its keys, −∞ for a row with no key (→ 0)."""
    e = cute.math.exp2((sink - lse) * LOG2_E, fastmath=True)  # sink = +∞ → ∞ → factor 0
    return Float32(0.0) if lse == -Float32.inf else Float32(1.0) / (Float32(1.0) + e)


def combine_reference(o_parts, lse_parts, sink=None):
    """(O [rows, d], lse [rows]) in float64 from o_parts [splits, rows, d], lse_parts [splits, rows],
        empty splits ignored; `sink` [rows] scales O by 1 / (1 + e^(sink − lse))."""
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
    if sink is not None:
        sink = sink.double()
        factor = torch.where(lonely, torch.zeros_like(lse), 1.0 / (1.0 + torch.exp(sink - torch.where(lonely, torch.zeros_like(lse), lse))))
        o = o * factor[:, None]
    return o, lse


class SplitCombine:
    """GPU combine of `splits` fp32 partials of `rows` × `d` into O and LSE: one warp a row, 4 rows a
        CTA, lane l columns l, l + 32, …  Tensors (flat row r):
            o_part  (splits · rows, d) fp32     row s · rows + r is split s of row r
            lse_part (splits · rows,) fp32
            o       (rows, d)
            lse     any layout of `rows` elements (e.g. [b, h_q, s_q] in row order)
            sink    optional [h_q] fp32: row r is head r mod h_q; applied once, after the merge"""

    ROWS_PER_CTA = 4
    THREADS = 32 * ROWS_PER_CTA

    def __init__(self, rows: int, splits: int, d: int, sink_heads: int = 0, fp8: bool = False):
        if rows % self.ROWS_PER_CTA or d % 32:
            raise ValueError(f"SplitCombine: rows must be a multiple of {self.ROWS_PER_CTA} and d of 32, got {rows}, {d}")
        self.rows, self.splits, self.d, self.sink_heads = rows, splits, d, sink_heads
        # fp8: a merged row leaves through stage E's fused FP8 epilogue (stages/common/
        # fp8_epilogue.py store_strided_row_fp8), not as `o`; rows are (token, head), sink_heads heads
        self.fp8 = fp8
        if fp8 and (d != 512 or not sink_heads or sink_heads % 8):
            raise ValueError(f"SplitCombine: the FP8 epilogue takes d 512 and a multiple of 8 sink heads, got {d}, {sink_heads}")

    def launch(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, stream, sink=None,
               fp8_args=None):
        """From a @cute.jit host function (after the split kernel, same stream).  `sink`: the [h_q] sinks
                (sink_heads > 0); `fp8_args`: (O_fp8, O_scale, cos_sin_cache, positions, sin_sign)."""
        if (sink is None) != (self.sink_heads == 0):
            raise ValueError("SplitCombine: pass a sink tensor exactly when sink_heads > 0")
        o8, osc, cs, pos, self.sin_sign = fp8_args if self.fp8 else (None, None, None, None, 1.0)  # bf16: no parameters
        self.kernel(o_part, lse_part, o, lse, sink if sink is not None else lse, o8, osc, cs, pos).launch(
            grid=(self.rows // self.ROWS_PER_CTA, 1, 1), block=(self.THREADS, 1, 1), stream=stream
        )

    @cute.kernel
    def kernel(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, sink: cute.Tensor,
               o8: cute.Tensor | None, osc: cute.Tensor | None, cos_sin: cute.Tensor | None,
               positions: cute.Tensor | None):
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
        row_lse = -Float32.inf if lonely else m + cute.math.log2(total, fastmath=True) * LN2
        if cutlass.const_expr(self.sink_heads > 0):
            inv = inv * sink_factor(sink[row % self.sink_heads], row_lse)
        if cutlass.const_expr(self.fp8):
            for k in cutlass.range_constexpr(cols):
                acc[k] = acc[k] * inv
            cs = cute.make_tensor(cos_sin.iterator, cute.make_layout(cute.size(cos_sin)))
            out = Fp8Out(o8, osc, cs, positions, self.sink_heads, rows // self.sink_heads, self.sin_sign)
            a8, asc, pos = out.row_addresses(row)
            store_strided_row_fp8(acc, lane, a8, asc, cs, pos, self.sin_sign)
        else:
            for k in cutlass.range_constexpr(cols):
                o[row, lane + 32 * k] = (acc[k] * inv).to(o.element_type)
        if lane == 0:
            lse[row] = Float32.inf if lonely else row_lse
