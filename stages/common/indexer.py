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


@cute.jit
def key_tile_range(mKs: cute.Tensor, mKe: cute.Tensor, first_row, rows: cutlass.Constexpr[int],
                   s_kv: cutlass.Constexpr[int], tile: cutlass.Constexpr[int]):
    """(tile_begin, tile_end): the `tile`-key tiles covering the union of the non-empty ranges
    [max(ks, 0), min(ke, s_kv)) of rows first_row … first_row + rows − 1; an empty union gives
    tile_begin == tile_end (= s_kv / tile)."""
    lo = cutlass.Int32(s_kv)
    hi = cutlass.Int32(0)
    for t in cutlass.range_constexpr(rows):
        b = cutlass.max(mKs[first_row + t], cutlass.Int32(0))
        e = cutlass.min(mKe[first_row + t], cutlass.Int32(s_kv))
        if e > b:
            lo = cutlass.min(lo, b)
            hi = cutlass.max(hi, e)
    tile_begin = lo // tile
    tile_end = cutlass.max((hi + tile - 1) // tile, tile_begin)
    return tile_begin, tile_end


def check_row_per_thread(t2r, coords, rows: int, chunk: int) -> None:
    """Trace-time proof for a Blackwell epilogue that owns whole accumulator rows: for sampled
    threads t < rows, register j of t's tcgen05.ld fragment of column chunk c (`coords`: the
    identity partition ((rows, chunk), chunks) the copy acts on) holds (t, c · chunk + j)."""
    from stages.common.sm100_idioms import fragment_coords

    for t in (0, 1, 31, 32, 77, rows - 1):
        thr = t2r.get_slice(t)
        for c in (0, cute.size(coords, mode=[1]) - 1):
            got = fragment_coords(thr.partition_D(coords[(None, c)]), t == 0)
            want = [(t, c * chunk + j) for j in range(chunk)]
            if list(got) != want:
                raise ValueError(f"indexer sm100: thread {t}'s TMEM load of column chunk {c} holds {got[:4]}…, "
                                 f"not row {t}, columns {c * chunk}…{c * chunk + chunk - 1}")


TMEM_COLUMNS = 512  # 32-bit columns of tensor memory per SM (128 lanes each)


def tmem_budget(buffers: int, cols: int, who: str) -> int:
    """The TMEM columns to allocate for `buffers` accumulators of `cols` fp32 columns each (a
    power of two ≥ 32); raises at trace time when they do not fit the 512 columns."""
    from stages.common.sm100_idioms import tmem_alloc_cols

    used = buffers * cols
    if used > TMEM_COLUMNS:
        raise ValueError(f"{who}: TMEM budget: {buffers} accumulator buffers × {cols} columns = {used} > {TMEM_COLUMNS}")
    return tmem_alloc_cols(used)
