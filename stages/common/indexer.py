"""The lightning indexer's epilogue pieces (stages I1, I2), shared by their kernels.

The indexer's MMA puts keys along M and the query heads along N (`Sᵀ = K · Qᵀ`, N = tokens ·
heads): a wgmma accumulator row is one key, its columns the heads of the CTA's tokens.  Per key
j and token t the logit is

    logit[t, j] = k_scale[j] · Σ_h w[t, h] · relu(S[j, t·H + h])

(relu(x · s) = s · relu(x) for a positive scale, so the scale is applied once, after the sum).

    check_token_columns  trace-time proof that a thread's accumulator column j (in the
                         `acc_rows_cols` view) belongs to token j // (columns per token), so a
                         token's heads are a static slice of the thread's columns
    head_sum             Σ_h w · relu(S) over one token's columns of one row: the thread's own
                         columns, then a butterfly over the row's quad (every lane gets the sum)
    fill_neg_inf         −inf over a column range of one output row, by a group of threads
"""

import cutlass
import cutlass.cute as cute

from stages.common.sm90_idioms import acc_rows_cols

_CHECK_THREADS = (0, 1, 2, 3, 5, 31, 64, 127)


def check_token_columns(tiled_mma, tile_mn, heads: int, tokens: int) -> None:
    """Raise unless, for sampled threads, column j of the (rows, columns) view of the
    accumulator over `tile_mn` is global column c with c // heads == j // (columns per token)."""
    ident = cute.make_identity_tensor(tile_mn)
    for t in _CHECK_THREADS:
        coords = acc_rows_cols(tiled_mma.get_slice(t).partition_C(ident))
        cols = cute.size(coords, mode=[1])
        per_token = cols // tokens
        for j in range(cols):
            col = coords[0, j][1]
            if col // heads != j // per_token:
                raise ValueError(
                    f"indexer: accumulator column {j} of thread {t} is column {col} (token {col // heads}), "
                    f"not token {j // per_token}: the head sum would mix tokens"
                )


@cute.jit
def head_sum(acc_rc: cute.Tensor, w: cute.Tensor, r: cutlass.Constexpr[int], first: cutlass.Constexpr[int],
             count: cutlass.Constexpr[int]) -> cutlass.Float32:
    """Σ_h w[h] · relu(S[r, h]) over one token's heads: this thread's `count` columns of row
    `r` from column `first` (weights `w` indexed like the columns), then the butterfly over the
    row's quad (threads_in_group=4): every lane of the quad returns the row's full sum."""
    part = cutlass.Float32(0.0)
    for j in cutlass.range_constexpr(first, first + count):
        part += cute.arch.fmax(acc_rc[r, j], cutlass.Float32(0.0)) * w[j]
    return cute.arch.warp_reduction_sum(part, threads_in_group=4)


@cute.jit
def fill_neg_inf(out: cute.Tensor, row, begin, end, tid, threads: cutlass.Constexpr[int]):
    """out[row, j] = −inf for begin ≤ j < end, by `threads` threads (this one is `tid`)."""
    neg_inf = -cutlass.Float32.inf
    for j in cutlass.range(begin + tid, end, threads, unroll=4):
        out[row, j] = neg_inf
