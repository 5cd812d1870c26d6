"""Key masks of the decode rungs (D3 fill level, D4 causal SWA, D5's two branches).

Every mask is a KEY LIMIT per (batch, token, branch): keys j < limit are valid (scheduler's
`key_limit`: the fill level, or D4's swa_lens[b] − s_q + t + 1, one number per CTA since a CTA's
64 rows are one token's heads).  Tiles past it are never visited; only the BOUNDARY tile (rem =
limit − its first key ∈ [1, block_n)) needs the two steps:

    mask_scores      S[r, j] ← −∞ for j ≥ rem, before the online softmax — a select, not an add
                     (a key past the fill level may hold NaN)
    zero_kv_rows     KV rows ≥ rem of the slot ← 0 before P·V (0 · NaN = NaN in the MMA)

Both only on the boundary tile (a runtime `if`); a keyless CTA visits no tile and writes the
lonely row directly."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def mask_scores(s_rc: cute.Tensor, cols_rc: cute.Tensor, rem) -> None:
    """S[r, j] ← −∞ where the key column of `cols_rc[r, j]` (coordinates (row, key) of the
    accumulator, e.g. `acc_rows_cols` of an identity tensor partitioned like S) is ≥ rem."""
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        for j in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            if cols_rc[r, j][1] >= rem:
                s_rc[r, j] = -Float32.inf


@cute.jit
def zero_kv_rows(s_kv: cute.Tensor, rem, tid, threads: cutlass.Constexpr[int]) -> None:
    """Rows rem … rows−1 of KV slot `s_kv` (keys × d, 16-bit, K-major swizzled: 8 columns are 16
        contiguous bytes) ← 0 by `threads` threads, one 16-byte store per 8 columns.  The caller
        fences (fence.proxy.async) before the barrier that hands the slot to P·V."""
    VEC = 8
    rows, cols = cute.size(s_kv, mode=[0]), cute.size(s_kv, mode=[1])
    chunks = cols // VEC
    zero = cute.make_rmem_tensor(cute.make_layout((1, VEC)), s_kv.element_type)
    zero.fill(0.0)
    for e in cutlass.range(rem * chunks + tid, rows * chunks, threads, unroll=1):
        dst = cute.local_tile(s_kv, (1, VEC), (e // chunks, e % chunks))
        cute.autovec_copy(zero, dst)
