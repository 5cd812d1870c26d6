"""Online softmax over KV tiles: the per-row state of one thread, its update, and its end.

Math (base 2).  Raw scores S = Q·K_tileᵀ, c = scale · log2(e).  Per query row the state is
the running max m (raw-score units, starts at −∞) and the running sum ℓ (starts at 0):

    m_new  = max(m, max_j S_j)
    m_safe = m_new, or 0 when m_new = −∞        (the LONELY-ROW RULE, below)
    α      = 2^((m − m_safe) · c)                the factor that rescales ℓ and O
    P_j    = 2^(S_j · c − m_safe · c)            ∈ [0, 1]; S_j = −∞ gives 0
    ℓ      = α · ℓ + Σ_j P_j
    O      = α · O + P · V_tile                  (the caller's MMA)

and at the end

    O   = O / ℓ
    LSE = (m · c + log2 ℓ) · ln 2                natural log of Σ_j exp(scale · S_j)

Lonely rows.  A row with no key yet still has m_new = −∞, and the textbook α = 2^((−∞) − (−∞))
is NaN.  Subtracting m_safe = 0 keeps every term finite: α = 0, P_j = 0, O and ℓ stay 0.  At the
end ℓ = 0: 1/ℓ := 0 (O = 0) and LSE = −∞, the right LSE of a partial (the combine gives it weight
0); a final row with no key takes DSV4's LSE = +∞ (`final_lse`).

With a wgmma accumulator a row's columns span a quad: the max is reduced over the quad at every
update, the sum stays a per-lane partial until `finalize`.  `OnlineSoftmax` is a traced value
(its two register tensors); c is a Python float or a Float32 from a runtime scale
(`runtime_scale_log2`).  `lonely_rows=False` drops the select where rows always see a key
(stages C, D1).  `update_row`: one row of `update`."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)


class OnlineSoftmax:
    """Per-thread online-softmax state for `num_rows` rows (see the module doc)."""

    def __init__(self, num_rows: int, scale_log2: float, row_max: cute.Tensor, row_sum: cute.Tensor,
                 lonely_rows: bool = True):
        self.num_rows = num_rows
        self.scale_log2 = scale_log2
        self.row_max = row_max
        self.row_sum = row_sum
        self.lonely_rows = lonely_rows

    @staticmethod
    def create(num_rows: int, scale_log2: float, lonely_rows: bool = True) -> "OnlineSoftmax":
        """Fresh state (m = −∞, ℓ = 0) in registers; call inside a kernel.  `lonely_rows`:
        apply the lonely-row rule (see the module doc; False only where every row sees a key)."""
        row_max = cute.make_rmem_tensor(num_rows, Float32)
        row_sum = cute.make_rmem_tensor(num_rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return OnlineSoftmax(num_rows, scale_log2, row_max, row_sum, lonely_rows)

    # A traced value: the register tensors travel through scf.for / scf.if.
    def __extract_mlir_values__(self):
        a = cutlass.extract_mlir_values(self.row_max)
        b = cutlass.extract_mlir_values(self.row_sum)
        self._split = len(a)
        return a + b

    def __new_from_mlir_values__(self, values):
        k = self._split
        return OnlineSoftmax(
            self.num_rows,
            self.scale_log2,
            cutlass.new_from_mlir_values(self.row_max, values[:k]),
            cutlass.new_from_mlir_values(self.row_sum, values[k:]),
            self.lonely_rows,
        )

    @cute.jit
    def update(self, s_rc: cute.Tensor) -> cute.Tensor:
        """One KV tile: `s_rc` (rows, columns) of raw scores (`acc_rows_cols` of the S
        accumulator) becomes P in place; returns α per row (a register tensor)."""
        alpha = cute.make_rmem_tensor(self.num_rows, Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            alpha[r] = self.update_row(s_rc, r)
        return alpha

    @cute.jit
    def update_row(self, s_rc: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
        """Row `r` of `update`: its scores become P in place, its state moves on; returns
        its α."""
        c = self.scale_log2
        m_prev = self.row_max[r]
        m_new = m_prev
        for j in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            m_new = cute.arch.fmax(m_new, s_rc[r, j])
        m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=4)  # the row's quad
        m_safe = m_new
        if cutlass.const_expr(self.lonely_rows):
            m_safe = 0.0 if m_new == -Float32.inf else m_new  # lonely-row rule
        a = cute.math.exp2((m_prev - m_safe) * c, fastmath=True)
        m_scaled = m_safe * c
        tile_sum = Float32(0.0)
        for j in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            p = cute.math.exp2(s_rc[r, j] * c - m_scaled, fastmath=True)
            s_rc[r, j] = p
            tile_sum += p
        self.row_sum[r] = self.row_sum[r] * a + tile_sum
        self.row_max[r] = m_new
        return a

    @cute.jit
    def finalize(self, inv_sum: cute.Tensor, lse: cute.Tensor) -> None:
        """End of the KV loop: fill `inv_sum` with 1/ℓ (0 for a row with ℓ = 0) and `lse`
        with the natural-log LSE (−∞ for ℓ = 0), per row; reduces ℓ over the quad."""
        c = self.scale_log2
        for r in cutlass.range_constexpr(self.num_rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            empty = total == 0.0
            inv_sum[r] = 0.0 if empty else cute.arch.rcp_approx(total)
            lse[r] = -Float32.inf if empty else (self.row_max[r] * c + cute.math.log2(total, fastmath=True)) * LN2


@cute.jit
def scale_rows(acc_rc: cute.Tensor, row: cutlass.Constexpr[int], factor: Float32) -> None:
    """acc[row, :] *= factor on a (rows, columns) accumulator view (the O rescale)."""
    for j in cutlass.range_constexpr(cute.size(acc_rc, mode=[1])):
        acc_rc[row, j] = acc_rc[row, j] * factor


@cute.jit
def final_lse(lse: Float32) -> Float32:
    """DSV4's output convention: a row with no key at all (LSE = −∞ = log 0) reports +∞."""
    return Float32.inf if lse == -Float32.inf else lse


@cute.jit
def runtime_scale_log2(softmax_scale: cute.Tensor) -> Float32:
    """c = softmax_scale[0] · log2 e for a scale passed at run time (a one-element fp32 tensor, as
        FlashMLA's per-call `softmax_scale`); call once, before the KV loops."""
    return softmax_scale[0] * Float32(LOG2E)
