"""Online softmax that rescales only when the running max has grown a lot (FlashAttention-4's
conditional rescale), so that most KV tiles skip the O rescale.

The state and its end are stages/common/softmax.py's; one update differs.  With the tile's row
max m_t and the running max m (raw-score units, c = scale · log2 e):

    m_new = max(m, m_t)
    keep  = (m_new − m) · c ≤ τ            (τ = RESCALE_LOG2 = 8; false while m = −∞)
    m'    = m if keep else m_new            the max the row's P and ℓ are taken against
    α     = 1 exactly if keep, else 2^((m − m'_safe) · c)
    P_j   = 2^(S_j · c − m'_safe · c)  ≤ 2^τ

ℓ, O and the LSE (m' · c + log2 ℓ) are the same sums relative to m': exact in exact arithmetic;
P ≤ 256 keeps bf16 P precise and ℓ, O far from overflow.  The lonely-row rule holds as in
softmax.py (keep is false while both maxima are −∞).  A caller skips the O rescale where
`needs_rescale` is false (every row of the warp kept its max: a warp-uniform branch)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from stages.common.softmax import OnlineSoftmax

RESCALE_LOG2 = 8.0  # τ: a row rescales once its max has grown by more than 2^τ


class LazyOnlineSoftmax(OnlineSoftmax):
    """OnlineSoftmax whose update keeps the running max unless it grew by more than 2^τ (see the
    module doc)."""

    @staticmethod
    def create(num_rows: int, scale_log2: float, lonely_rows: bool = True) -> "LazyOnlineSoftmax":
        base = OnlineSoftmax.create(num_rows, scale_log2, lonely_rows)
        return LazyOnlineSoftmax(num_rows, scale_log2, base.row_max, base.row_sum, lonely_rows)

    def __new_from_mlir_values__(self, values):
        s = OnlineSoftmax.__new_from_mlir_values__(self, values)
        return LazyOnlineSoftmax(s.num_rows, s.scale_log2, s.row_max, s.row_sum, s.lonely_rows)

    @cute.jit
    def update_row(self, s_rc: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
        """Row `r`: its scores become P in place (against m'), its state moves on; returns α
        (1.0 exactly where the max is kept)."""
        c = self.scale_log2
        m_prev = self.row_max[r]
        m_new = m_prev
        for j in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            m_new = cute.arch.fmax(m_new, s_rc[r, j])
        m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=4)  # the row's quad
        keep = (m_new - m_prev) * c <= RESCALE_LOG2
        m_use = cutlass.select_(keep, m_prev, m_new)
        m_safe = m_use
        if cutlass.const_expr(self.lonely_rows):
            m_safe = 0.0 if m_use == -Float32.inf else m_use  # lonely-row rule
        a = cutlass.select_(keep, Float32(1.0), cute.math.exp2((m_prev - m_safe) * c, fastmath=True))
        m_scaled = m_safe * c
        tile_sum = Float32(0.0)
        for j in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            p = cute.math.exp2(s_rc[r, j] * c - m_scaled, fastmath=True)
            s_rc[r, j] = p
            tile_sum += p
        self.row_sum[r] = self.row_sum[r] * a + tile_sum
        self.row_max[r] = m_use
        return a


@cute.jit
def needs_rescale(alpha: cute.Tensor, num_rows: cutlass.Constexpr[int]) -> cutlass.Boolean:
    """Whether any row this warp holds has α ≠ 1 (a warp vote: the same answer in every lane)."""
    mine = alpha[0] != 1.0
    for r in cutlass.range_constexpr(1, num_rows):
        mine = mine | (alpha[r] != 1.0)
    return cute.arch.vote_any_sync(mine)
