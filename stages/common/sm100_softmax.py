"""Online softmax when one thread owns a whole query row (Blackwell: TMEM lane t = row t).

softmax.py's math (base 2, raw-score units, c = scale · log2 e) and LONELY-ROW RULE; the row max
and sum are thread-local (a 32x32b tcgen05.ld gives thread r all of row r), the state two
Float32 scalars.  Per KV tile (masked keys already −∞):

    m_new  = max(m, max_k s_k)
    m_safe = m_new, or 0 when m_new = −∞          (a row that has seen no valid key yet)
    α      = 2^(m·c − m_safe·c)                  0 on the first tile (m = −∞), never NaN
    p_k    = 2^(s_k·c − m_safe·c)                s_k = −∞ gives 0
    ℓ      = α·ℓ + Σ_k p_k

At the end (`row_inv_sum`, `row_lse`):

    ℓ > 0:  1/ℓ,  LSE = (m·c + log2 ℓ) · ln 2
    ℓ = 0:  1/ℓ := 0 (O = 0 · 0 = 0, never 0 · ∞),  LSE = −∞   (a partial: the combine skips it)

`final_row_lse` turns a final row's −∞ into DSV4's +∞.  The sink: combine.py's `sink_factor`."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from stages.common.softmax import LN2

__all__ = ["row_softmax_update", "row_inv_sum", "row_lse", "final_row_lse", "LN2"]


@cute.jit
def row_softmax_update(s, row_max, row_sum, c):
    """One KV tile for a row this thread owns whole: s the raw scores (fp32 TensorSSA), row_max,
        row_sum m and ℓ before it, c = scale · log2 e.  Returns (p, new_max, alpha, row_sum); the
        caller moves row_max after comparing it with new_max (the O-rescale decision)."""
    new_max = cute.arch.fmax(row_max, s.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
    max_c = new_max * c
    if new_max == -Float32.inf:  # the lonely-row rule: exponentiate against 0, not −∞
        max_c = Float32(0.0)
    alpha = cute.math.exp2(row_max * c - max_c, fastmath=True)
    p = cute.math.exp2(s * c - max_c, fastmath=True)
    row_sum = row_sum * alpha + p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
    return p, new_max, alpha, row_sum


@cute.jit
def row_inv_sum(row_sum):
    """1/ℓ of a row at the end of its keys, 0 when ℓ = 0 (no valid key: O = 0 · 0)."""
    inv_sum = Float32(0.0)
    if row_sum > Float32(0.0):
        inv_sum = Float32(1.0) / row_sum
    return inv_sum


@cute.jit
def row_lse(row_max, row_sum, c):
    """LSE = (m·c + log2 ℓ) · ln 2, −∞ when ℓ = 0 (a partial's; final_row_lse makes it +∞), apart
        from row_inv_sum so a caller forms it where it stores it."""
    lse = Float32(-Float32.inf)
    if row_sum > Float32(0.0):
        lse = (row_max * c + cute.math.log2(row_sum, fastmath=True)) * Float32(LN2)
    return lse


@cute.jit
def final_row_lse(lse):
    """DSV4's output convention (softmax.final_lse): a row with no key (LSE = −∞) reports +∞."""
    out = lse
    if lse == -Float32.inf:
        out = Float32(Float32.inf)
    return out
