"""Key masks of the decode rungs (D3 fill level, D4 causal SWA, D5's two branches).

Every mask of stages D3–D5 is a KEY LIMIT per (batch, token, branch): keys j < limit are
valid, the rest are not (stages/common/scheduler.py `key_limit`: the fill level
swa_lens[b] or main_lens[b], and D4's causal limit swa_lens[b] − s_q + t + 1, which is one
number per CTA because a CTA's 64 rows are the heads of ONE token).  Tiles past the limit are
never visited (`visit_tiles`); only the BOUNDARY tile — the one holding the limit, with
rem = limit − first key of the tile ∈ [1, block_n) valid keys — needs the two steps below.

    mask_scores      S[r, j] ← −∞ for every column j ≥ rem, BEFORE the online softmax:
                     their P is 2^(−∞) = 0 and they never move the row max.  A select, not an
                     add: a key past the fill level may hold NaN, and its score with it.
    zero_kv_rows     KV rows ≥ rem of the tile's shared-memory slot ← 0, before P·V reads
                     them: P = 0 there, but 0 · NaN = NaN inside the MMA, so the bytes must be
                     finite.  (The rows were loaded by TMA with the rest of the box.)

Both run on the boundary tile only (a runtime `if` in the caller), so a fill level on a tile
edge — and a full window — costs nothing.  A row with NO valid key at all never reaches them:
its CTA visits no tile and writes the lonely row's output directly (O = 0, LSE = +∞).
"""

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
