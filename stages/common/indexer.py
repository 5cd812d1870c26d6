"""The lightning indexer's shared pieces (stages I1, I2): what their four kernels (flat and
paged, Hopper and Blackwell) have in common, so each stage module reads as what is new in it.

The indexer's MMA puts keys along M and the query heads along N (`Sᵀ = K · Qᵀ`, N = tokens ·
heads, K = d = 128).  Per key j and token t the logit is

    logit[t, j] = k_scale[j] · Σ_h w[t, h] · relu(S[j, t·H + h])     inside token t's key range
                = −inf                                               outside it

(relu(x · s) = s · relu(x) for a positive scale, so the scale is applied once, after the sum).
A token's key range is [lo[t], hi[t]): I1's [ks, ke), I2's causal [0, context − next_n + t + 1).

Pieces, in file order: both archs (shapes and refusals, the persistent schedules, the paged
views, the −inf fills); Hopper (wgmma, the accumulator in registers: a row is one key, its
columns spread over a quad); Blackwell (tcgen05, TMEM lane t = key t, thread t owns its row).
"""

from typing import Any, Callable, NamedTuple, Sequence

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import tcgen05, warpgroup
from cutlass.utils.tmem_allocator import TmemAllocator

from stages.common import hang_guard
from stages.common.sm100_idioms import (
    tcgen05_fence_after_sync,
    tcgen05_fence_before_sync,
    tma_umma_pipeline,
    tmem_allocate,
    tmem_copy,
    umma_to_threads_pipeline,
)
from stages.common.sm90_idioms import acc_rows_cols
from stages.common.tma import prefetch_descriptors, tma_partition_tile

HEADS = 64
DIM = 128
HEAD_COUNTS = (32, 64)
HEAD_DIMS = (32, 64, 128)
F32 = cutlass.Float32
LOGITS_DTYPES = {"fp32": cutlass.Float32, "bf16": cutlass.BFloat16}

# ---------------------------------------------------------------------------------------
# Both archs: the kernel's operands and start, key ranges, the paged cache, the −inf fill


class LogitsOperands(NamedTuple):
    """What a kernel's `__call__` builds at trace time for its kernel, as one argument: the tiled
    MMA of Sᵀ = K_tile · Q_blockᵀ, the TMA atoms and coordinate tensors of Q and of the keys, and
    the staged shared-memory layouts of Q and K."""

    mma: cute.TiledMma
    tma_q: cute.CopyAtom
    mQ: cute.Tensor
    tma_k: cute.CopyAtom
    mK: cute.Tensor
    q_smem: cute.ComposedLayout
    k_smem: cute.ComposedLayout


@cute.jit
def start_cta(ops: LogitsOperands, load_warp: cutlass.Constexpr[int], smem_struct):
    """(tidx, warp_idx, storage): the thread's index, its warp's (uniform), the load warp
    prefetches the two TMA descriptors, and the shared storage `smem_struct` allocated."""
    tidx, _, _ = cute.arch.thread_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == load_warp:
        prefetch_descriptors(ops.tma_q, ops.tma_k)
    return tidx, warp_idx, utils.SmemAllocator().allocate(smem_struct)


def check_flat_shape(who: str, s: int, s_kv: int, block_q: int, block_k: int) -> None:
    """I1's refusals: s a multiple of the CTA's tokens, s_kv a positive multiple of its tile."""
    if s % block_q:
        raise ValueError(f"{who}: s must be a multiple of {block_q}, got {s}")
    if s_kv % block_k or s_kv <= 0:
        raise ValueError(f"{who}: s_kv must be a positive multiple of {block_k}, got {s_kv}")


def check_heads(who: str, heads: int, head_dim: int) -> None:
    """heads ∈ HEAD_COUNTS (whole accumulator columns a token), head_dim ∈ HEAD_DIMS (whole k32 steps,
        a 32-, 64- or 128-byte TMA row with its own swizzle); else refused."""
    if heads not in HEAD_COUNTS:
        raise ValueError(f"{who}: heads must be one of {', '.join(map(str, HEAD_COUNTS))}, got {heads}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{who}: head_dim must be one of {', '.join(map(str, HEAD_DIMS))}, got {head_dim}")


def check_logits(who: str, logits_dtype: str):
    """The element type of the kernel's logits (LOGITS_DTYPES); refuses another name."""
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"{who}: logits_dtype must be one of {', '.join(LOGITS_DTYPES)}, got {logits_dtype!r}")
    return LOGITS_DTYPES[logits_dtype]


def check_output(who: str, logits: cute.Tensor, dtype) -> None:
    """Trace time: the logits tensor has the element type the kernel was built for."""
    if logits.element_type is not dtype:
        raise ValueError(f"{who}: logits are {logits.element_type.__name__}, the kernel writes {dtype.__name__}")


def to_output(value, out: cute.Tensor):
    """The fp32 `value` as `out`'s element type: as is for fp32, rounded to nearest for bf16 (only the
        store narrows)."""
    if out.element_type is F32:
        return value
    return F32(value).to(out.element_type)


def check_paged_shape(who: str, block_kv: int, next_n: int, want_block_kv: int) -> None:
    """I2's refusals: the cache block the kernel is built for, and next_n ≤ 4 (N = next_n · 64 ≤ 256)."""
    if block_kv != want_block_kv:
        raise ValueError(f"{who}: block_kv must be {want_block_kv}, got {block_kv}")
    if next_n not in (1, 2, 3, 4):
        raise ValueError(f"{who}: next_n must be 1 … 4 (N = next_n · 64 ≤ 256), got {next_n}")


def launch(kernel_call, grid, threads: int, smem_struct, stream, min_blocks: int = 0) -> None:
    """Launch `kernel_call`: `grid` CTAs of `threads` threads with `smem_struct`'s dynamic shared
        memory; `min_blocks` > 0: the CTAs an SM must hold at once (the launch bound)."""
    if min_blocks:
        kernel_call.launch(grid=grid, block=(threads, 1, 1), smem=smem_struct.size_in_bytes(), stream=stream,
                           min_blocks_per_mp=min_blocks, preferred_smem_carveout=100)
        return
    kernel_call.launch(grid=grid, block=(threads, 1, 1), smem=smem_struct.size_in_bytes(), stream=stream)


def q_rows(q: cute.Tensor, rows: int, dim: int = DIM) -> cute.Tensor:
    """Q [tokens, heads, dim] (I1) or [b, next_n, heads, dim] (I2), contiguous, as the (rows, dim)
    row-major matrix the MMA's B operand is cut from: row = token · heads + head."""
    return cute.make_tensor(q.iterator, cute.make_layout((rows, dim), stride=(dim, 1)))


@cute.jit
def key_tile_range(mKs: cute.Tensor, mKe: cute.Tensor, first_row, rows: cutlass.Constexpr[int],
                   s_kv: cutlass.Constexpr[int], tile: cutlass.Constexpr[int]):
    """(tile_begin, tile_end): the `tile`-key tiles covering the union of the rows' non-empty ranges
        [max(ks, 0), min(ke, s_kv)); an empty union gives tile_begin == tile_end."""
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


def paged_views(kv_cache: cute.Tensor, dtype, block_kv: int, dim: int = DIM):
    """(values, scales): the fused cache [num_blocks, block_kv, 1, dim + 4] (per block block_kv · dim
        e4m3 values token-major, then block_kv fp32 scales) as values (block_kv, dim, num_blocks) of
        `dtype` and scales (block_kv, num_blocks) fp32 over the same bytes.  The block stride
        block_kv · (dim + 4) is a multiple of 16: one TMA box per block."""
    num_blocks = kv_cache.shape[0]
    block_bytes = block_kv * (dim + 4)
    values = cute.make_tensor(
        cute.recast_ptr(kv_cache.iterator, dtype=dtype),
        cute.make_layout((block_kv, dim, num_blocks), stride=(dim, 1, block_bytes)),
    )
    scales = cute.make_tensor(
        cute.recast_ptr(kv_cache.iterator + block_kv * dim, dtype=F32),
        cute.make_layout((block_kv, num_blocks), stride=(1, block_bytes // 4)),
    )
    return values, scales


@cute.jit
def paged_tiles(mLens: cute.Tensor, seq, chunk, max_len: cutlass.Constexpr[int], block_kv: cutlass.Constexpr[int],
                tile_keys: cutlass.Constexpr[int], chunk_tiles: cutlass.Constexpr[int],
                tokens_2d: cutlass.Constexpr[int] = 0):
    """(ctx, last_block, tile_begin, tile_end, chunk_end) of sequence `seq`, key chunk `chunk`
        (chunk_tiles tiles of tile_keys keys):
            ctx         context_lens[seq] clamped to [0, max_len]; 2-D lengths: the largest token's
            last_block  (ctx − 1) // block_kv (0 when ctx = 0): no table entry past it is followed
            tiles       [tile_begin, tile_end): the chunk's tiles holding a key below ctx
            chunk_end   min(the chunk's last key + 1, max_len): the fill writes −inf over
                        [tile_end · tile_keys, chunk_end)"""
    if cutlass.const_expr(tokens_2d > 0):
        raw = mLens[seq, 0]
        for t in cutlass.range_constexpr(1, tokens_2d):
            raw = cutlass.max(raw, mLens[seq, t])
        ctx = cutlass.min(cutlass.max(raw, cutlass.Int32(0)), cutlass.Int32(max_len))
    else:
        ctx = cutlass.min(cutlass.max(mLens[seq], cutlass.Int32(0)), cutlass.Int32(max_len))
    last_block = cutlass.max((ctx + block_kv - 1) // block_kv - 1, cutlass.Int32(0))
    tile_begin = chunk * chunk_tiles
    tile_end = cutlass.max(cutlass.min(tile_begin + chunk_tiles, (ctx + tile_keys - 1) // tile_keys), tile_begin)
    chunk_end = cutlass.min((chunk + 1) * chunk_tiles * tile_keys, cutlass.Int32(max_len))
    return ctx, last_block, tile_begin, tile_end, chunk_end


@cute.jit
def seq_blocks(mLens: cute.Tensor, i, max_len: cutlass.Constexpr[int], block_kv: cutlass.Constexpr[int],
               tokens_2d: cutlass.Constexpr[int] = 0):
    """The cache blocks of sequence i that hold a key some token sees: ⌈ctx / block_kv⌉ with ctx
    as `paged_tiles` clamps it (0 … max_len; with 2-D lengths the largest of the tokens')."""
    if cutlass.const_expr(tokens_2d > 0):
        raw = mLens[i, 0]
        for t in cutlass.range_constexpr(1, tokens_2d):
            raw = cutlass.max(raw, mLens[i, t])
    else:
        raw = mLens[i]
    ctx = cutlass.min(cutlass.max(raw, cutlass.Int32(0)), cutlass.Int32(max_len))
    return (ctx + block_kv - 1) // block_kv


def share_segments(blocks: Sequence[int], cta: int, ctas: int) -> list[tuple[int, int, int]]:
    """Plain Python: CTA `cta`'s segments (sequence, first block, blocks) under `block_share`, in
        order, empty sequences skipped (the simulator and the tests: every pair in exactly one
        CTA's segments; shares differ by at most one pair)."""
    total = sum(blocks)
    begin, left = cta * total // ctas, (cta + 1) * total // ctas - cta * total // ctas
    out, excl = [], 0
    for i, n in enumerate(blocks):
        if left <= 0:
            break
        if excl + n > begin:
            lo = max(begin - excl, 0)
            take = min(n - lo, left)
            if take > 0:
                out.append((i, lo, take))
                left -= take
        excl += n
    return out


def block_tiles(ks: Sequence[int], ke: Sequence[int], rows: int, s_kv: int, tile: int) -> list[int]:
    """Plain Python, the tile counts `block_tile_table` tabulates: token block i's tiles
    (`key_tile_range` of its `rows` rows), for the protocol simulator and the tests."""
    out = []
    for i in range(len(ks) // rows):
        spans = [(max(b, 0), min(e, s_kv)) for b, e in zip(ks[i * rows:(i + 1) * rows], ke[i * rows:(i + 1) * rows])]
        spans = [(b, e) for b, e in spans if e > b]
        out.append(-(-max(e for _, e in spans) // tile) - min(b for b, _ in spans) // tile if spans else 0)
    return out


def _warp_sum(x):
    for off in (16, 8, 4, 2, 1):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=off)
    return x


def _warp_min(x):
    for off in (16, 8, 4, 2, 1):
        x = cutlass.min(x, cute.arch.shuffle_sync_bfly(x, offset=off))
    return x


def _warp_inclusive_sum(x, lane):
    for off in (1, 2, 4, 8, 16):
        x = x + cutlass.select_(lane >= off, cute.arch.shuffle_sync_up(x, offset=off), cutlass.Int32(0))
    return x


@cute.jit
def block_share(mLens: cute.Tensor, b: cutlass.Constexpr[int], cta, ctas: cutlass.Constexpr[int],
                max_len: cutlass.Constexpr[int], block_kv: cutlass.Constexpr[int],
                tokens_2d: cutlass.Constexpr[int] = 0):
    """(seq, excl, begin, count): CTA `cta`'s equal share of the (sequence, block) pairs, in every
        lane of the calling warp (no shared memory).  The T pairs in order (sequence 0's
        `seq_blocks`, then 1's, …) are cut into `ctas` shares [⌊c·T/ctas⌋, ⌊(c+1)·T/ctas⌋):
        `begin`, `count` its first pair and length, `seq` the sequence of pair `begin`, `excl` the
        pairs before that sequence (its first block is begin − excl); count = 0: nothing (seq = b).
        Two warp passes of ⌈b / 32⌉ steps: T, then the least lane whose prefix sum passes `begin`."""
    lane = cute.arch.lane_idx()
    total = cutlass.Int32(0)
    for c in cutlass.range(0, b, 32, unroll=1):
        i = c + lane
        v = seq_blocks(mLens, cutlass.min(i, cutlass.Int32(b - 1)), max_len, block_kv, tokens_2d)
        total = total + _warp_sum(cutlass.select_(i < b, v, cutlass.Int32(0)))
    begin = cta * total // ctas
    end = (cta + 1) * total // ctas
    seq = cutlass.Int32(b)
    excl = cutlass.Int32(0)
    base = cutlass.Int32(0)
    for c in cutlass.range(0, b, 32, unroll=1):
        i = c + lane
        v = seq_blocks(mLens, cutlass.min(i, cutlass.Int32(b - 1)), max_len, block_kv, tokens_2d)
        v = cutlass.select_(i < b, v, cutlass.Int32(0))
        incl = _warp_inclusive_sum(v, lane)
        first = _warp_min(cutlass.select_(i < b, cutlass.select_(base + incl > begin, i, cutlass.Int32(b)),
                                          cutlass.Int32(b)))
        before = cute.arch.shuffle_sync(base + incl - v, first - c)  # pairs before `first` (when c ≤ first < c + 32)
        open_ = seq == b
        excl = cutlass.select_(open_, before, excl)
        seq = cutlass.select_(open_, first, seq)
        base = base + cute.arch.shuffle_sync(incl, 31)
    return seq, excl, begin, end - begin


@cute.jit
def block_tile_table(table: cute.Tensor, mKs: cute.Tensor, mKe: cute.Tensor, blocks: cutlass.Constexpr[int],
                     rows: cutlass.Constexpr[int], s_kv: cutlass.Constexpr[int], tile: cutlass.Constexpr[int], tid,
                     threads: cutlass.Constexpr[int], warp_idx):
    """I1's persistent schedule in shared memory, built by the whole CTA (two CTA barriers):
        table[i] = token block i's tile_begin (`key_tile_range`), table[blocks + i] = P(i), the
        (block, key tile) pairs before block i (P(0) = 0, P(blocks) = T).  Thread t takes blocks
        t, t + threads, …; warp 0 turns the counts into prefix sums, 32 a step."""
    for i in cutlass.range(tid, blocks, threads, unroll=1):
        tb, te = key_tile_range(mKs, mKe, i * rows, rows, s_kv, tile)
        table[i] = tb
        table[blocks + 1 + i] = te - tb
    cute.arch.sync_threads()
    if warp_idx == 0:
        lane = cute.arch.lane_idx()
        base = cutlass.Int32(0)
        for c in cutlass.range(0, blocks, 32, unroll=1):
            at = blocks + 1 + cutlass.min(c + lane, cutlass.Int32(blocks - 1))
            incl = base + _warp_inclusive_sum(cutlass.select_(c + lane < blocks, table[at], cutlass.Int32(0)), lane)
            if c + lane < blocks:
                table[at] = incl
            base = cute.arch.shuffle_sync(incl, 31)
        if lane == 0:
            table[blocks] = cutlass.Int32(0)
    cute.arch.sync_threads()


@cute.jit
def table_share(table: cute.Tensor, blocks: cutlass.Constexpr[int], cta, ctas: cutlass.Constexpr[int]):
    """(block, first, left): CTA `cta`'s share [⌊c·T/ctas⌋, ⌊(c+1)·T/ctas⌋) of `block_tile_table`'s
        pairs: its first token block (least i with P(i + 1) > the share's first pair, binary search),
        the first tile counted from that block's tile_begin, and the pairs it holds (0: none)."""
    total = cutlass.Int64(table[2 * blocks])
    begin = cutlass.Int32(cutlass.Int64(cta) * total // ctas)
    end = cutlass.Int32(cutlass.Int64(cta + 1) * total // ctas)
    lo = cutlass.Int32(0)
    hi = cutlass.Int32(blocks)
    while lo < hi:
        mid = (lo + hi) // 2
        above = table[blocks + 1 + mid] > begin
        hi = cutlass.select_(above, mid, hi)
        lo = cutlass.select_(above, lo, mid + 1)
    return lo, begin - table[blocks + lo], end - begin


@cute.jit
def table_tiles(table: cute.Tensor, blocks: cutlass.Constexpr[int], block):
    """(tile_begin, tiles) of token block `block` from `block_tile_table`'s table."""
    return table[block], table[blocks + 1 + block] - table[blocks + block]


@cute.jit
def token_ranges(mKs: cute.Tensor, mKe: cute.Tensor, first_row, tokens: cutlass.Constexpr[int]):
    """(lo, hi) in registers: lo[t] = ks[first_row + t], hi[t] = ke[first_row + t] (I1)."""
    lo = cute.make_rmem_tensor(tokens, cutlass.Int32)
    hi = cute.make_rmem_tensor(tokens, cutlass.Int32)
    for t in cutlass.range_constexpr(tokens):
        lo[t] = mKs[first_row + t]
        hi[t] = mKe[first_row + t]
    return lo, hi


@cute.jit
def causal_limits(first_pos, tokens: cutlass.Constexpr[int]):
    """hi in registers: token t sees keys ≤ first_pos + t, i.e. hi[t] = first_pos + t + 1 (I2;
    first_pos = context − next_n, and no lower bound)."""
    hi = cute.make_rmem_tensor(tokens, cutlass.Int32)
    for t in cutlass.range_constexpr(tokens):
        hi[t] = first_pos + t + 1
    return hi


@cute.jit
def token_limits(mLens: cute.Tensor, seq, tokens: cutlass.Constexpr[int]):
    """hi in registers from 2-D context lengths [b, tokens]: token t of sequence `seq` sees the
    keys < context_lens[seq, t] (DeepGEMM's per-token form; no lower bound)."""
    hi = cute.make_rmem_tensor(tokens, cutlass.Int32)
    for t in cutlass.range_constexpr(tokens):
        hi[t] = mLens[seq, t]
    return hi


@cute.jit
def masked_logit(total, key, lo, hi, t: cutlass.Constexpr[int]) -> cutlass.Float32:
    """`total` where lo[t] ≤ key < hi[t] (no lower bound when lo is None), else −inf — by
    selection, so a NaN from a cache slot outside the range never reaches the logit."""
    if cutlass.const_expr(lo is None):
        inside = key < hi[t]
    else:
        inside = (key >= lo[t]) & (key < hi[t])
    return F32(cutlass.select_(inside, total, -F32.inf))


@cute.jit
def fill_neg_inf(out: cute.Tensor, row, begin, end, tid, threads: cutlass.Constexpr[int]):
    """out[row, j] = −inf for begin ≤ j < end, by `threads` threads (this one is `tid`)."""
    neg_inf = to_output(-cutlass.Float32.inf, out)
    for j in cutlass.range(begin + tid, end, threads, unroll=4):
        out[row, j] = neg_inf


@cute.jit
def fill_rows(out: cute.Tensor, first_row, rows: cutlass.Constexpr[int], begin, end, tid,
              threads: cutlass.Constexpr[int]):
    """out[first_row + t, j] = −inf for t < rows, begin ≤ j < end (`fill_neg_inf` per row)."""
    for t in cutlass.range_constexpr(rows):
        fill_neg_inf(out, first_row + t, begin, end, tid, threads)


@cute.jit
def fill_compressed(out: cute.Tensor, mKs: cute.Tensor, first_row, rows: cutlass.Constexpr[int], begin, end,
                    width: cutlass.Constexpr[int], tid, threads: cutlass.Constexpr[int]):
    """I1's compressed logits (row r's column c is key ks[r] + c, c < width): the epilogue writes
        [a, b), a = clamp(begin − ks[r], 0, width), b = clamp(end − ks[r], 0, width); this writes
        −inf over [0, a) and [b, width) of rows first_row … first_row + rows − 1."""
    zero = cutlass.Int32(0)
    for t in cutlass.range_constexpr(rows):
        ks = mKs[first_row + t]
        a = cutlass.min(cutlass.max(begin - ks, zero), cutlass.Int32(width))
        b = cutlass.min(cutlass.max(end - ks, zero), cutlass.Int32(width))
        fill_neg_inf(out, first_row + t, zero, a, tid, threads)
        fill_neg_inf(out, first_row + t, b, cutlass.Int32(width), tid, threads)


@cute.jit
def fill_outside(out: cute.Tensor, mKs: cute.Tensor, block, rows: cutlass.Constexpr[int], tile_begin, tile_end,
                 block_k: cutlass.Constexpr[int], s_kv: cutlass.Constexpr[int], width: cutlass.Constexpr[int],
                 compressed: cutlass.Constexpr[bool], tid, threads: cutlass.Constexpr[int]):
    """I1's fill warps: −inf in token block `block`'s rows wherever its key tiles [tile_begin,
        tile_end) leave a column unwritten, so epilogue (keys [tile_begin · block_k, tile_end ·
        block_k)) and fill write every column exactly once: full form −inf over [0, begin) and
        [end, s_kv) (`fill_rows`); compressed form `fill_compressed`."""
    if cutlass.const_expr(compressed):
        fill_compressed(out, mKs, block * rows, rows, tile_begin * block_k, tile_end * block_k, width, tid, threads)
    else:
        fill_rows(out, block * rows, rows, 0, tile_begin * block_k, tid, threads)
        fill_rows(out, block * rows, rows, tile_end * block_k, s_kv, tid, threads)


# ---------------------------------------------------------------------------------------
# Hopper

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


def sm90_logits_mma(dtype, keys: int, tokens: int, k_slots: int, q_slots: int, heads: int = HEADS,
                    dim: int = DIM):
    """(mma, tile, k_smem, q_smem) of Sᵀ = K_tile · Q_blockᵀ on one warpgroup: FP8 wgmma, M = `keys`,
        N = tokens · heads, K = dim, fp32 accumulator; both operands K-major (as FP8 wgmma needs),
        128-byte swizzle, K in `k_slots` slots, Q in `q_slots`.  Raises at trace time unless each
        token's heads are a static slice of a thread's columns."""
    n = heads * tokens
    mma = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.K,  # K tile [keys, d]: d contiguous (A, M = keys)
        warpgroup.OperandMajorMode.K,  # Q block [tokens · heads, d]: d contiguous (B, N = heads)
        cutlass.Float32,
        (1, 1, 1),
        tiler_mn=(keys, n),
    )
    check_token_columns(mma, (keys, n), heads, tokens)
    tile = (keys, n, dim)
    k_smem = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, dtype, k_slots)
    q_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, dtype, q_slots)
    return mma, tile, k_smem, q_smem


@cute.jit
def load_key_tile(pipe, state, load, tile):
    """Load warp: wait until slot `state.index` is empty, then global tile `tile` of `load` (a key
    tile, or a cache block found through the table) into it.  The caller advances `state`."""
    pipe.producer_acquire(state)
    cute.copy(load.atom, load.gmem[(None, tile)], load.smem[(None, state.index)],
              tma_bar_ptr=pipe.producer_get_barrier(state))


def sm90_fragments(mma, tid_wg, sK, sQ, keys: int, n: int):
    """(tCrK, tCrQ, acc_shape, coords) of warpgroup thread `tid_wg`: its operand fragments, its
        accumulator's shape over the (keys, n) tile, and the (key in tile, token · 64 + head)
        coordinates of its accumulator."""
    thr = mma.get_slice(tid_wg)
    tCrK = mma.make_fragment_A(thr.partition_A(sK))
    tCrQ = mma.make_fragment_B(thr.partition_B(sQ))
    acc_shape = thr.partition_shape_C((keys, n))
    coords = acc_rows_cols(thr.partition_C(cute.make_identity_tensor((keys, n))))
    return tCrK, tCrQ, acc_shape, coords


@cute.jit
def head_weights(mW: cute.Tensor, coords: cute.Tensor, first_row, heads: cutlass.Constexpr[int] = HEADS):
    """w in registers indexed like the thread's accumulator columns: column j is global c =
        coords[0, j][1], w[j] = weights[first_row + c // heads, c % heads]."""
    cols = cute.size(coords, mode=[1])
    w = cute.make_rmem_tensor(cols, cutlass.Float32)
    for j in cutlass.range_constexpr(cols):
        col = coords[0, j][1]
        w[j] = mW[first_row + col // heads, col % heads]
    return w


@cute.jit
def head_partial(acc_rc: cute.Tensor, w: cute.Tensor, r: cutlass.Constexpr[int], first: cutlass.Constexpr[int],
                 count: cutlass.Constexpr[int]) -> cutlass.Float32:
    """Σ w[h] · relu(S[r, h]) over this thread's `count` columns of row `r` from `first`: its share
        of one token's heads (the other 3 lanes of its quad hold the rest)."""
    part = cutlass.Float32(0.0)
    for j in cutlass.range_constexpr(first, first + count):
        part += cute.arch.fmax(acc_rc[r, j], cutlass.Float32(0.0)) * w[j]
    return part


def quad_reduce_scatter(v: Sequence[Any], q: Any, shfl: Callable[[Any, int], Any],
                        sel: Callable[[Any, Any, Any], Any]) -> Any:
    """Lane q of a quad gets Σ over the quad's 4 lanes of their v[q] (4 values a lane): 3 shuffles,
        3 adds, 6 selects (a butterfly of each value: 8 shuffles, 8 adds).
            step 2   lane q keeps the half {i : i & 2 = q & 2} of its values and sends the other;
                     the partner q ⊕ 2 sends its values of q's half: a[i] = v[i] + v'[i] (2 values)
            step 1   the same over bit 1 on those two: lane q keeps a[(q & 2) | (q & 1)] = its sum
        `shfl(x, bit)`: x of lane q ⊕ bit; `sel(c, a, b)`: a where c, else b.  Plain values (the CPU
        test, numpy lanes) or traced ones (shuffle_sync_bfly, select_)."""
    if len(v) != 4:
        raise ValueError(f"quad_reduce_scatter takes 4 values a lane, got {len(v)}")
    upper = (q & 2) != 0  # lane keeps v[2], v[3]
    a = [sel(upper, v[i + 2], v[i]) + shfl(sel(upper, v[i], v[i + 2]), 2) for i in (0, 1)]
    odd = (q & 1) != 0  # lane keeps a[1]
    return sel(odd, a[1], a[0]) + shfl(sel(odd, a[0], a[1]), 1)


def quad_pick(q: Any, values: Sequence[Any], index: Sequence[int], sel: Callable[[Any, Any, Any], Any]) -> Any:
    """values[index[q]] for the quad lane q (0 … 3) by selects, `index` static: none when
    every lane takes the same value, one when the choice follows one bit of q, else three."""
    i = list(index)
    if i[0] == i[1] == i[2] == i[3]:
        return values[i[0]]
    if i[0] == i[1] and i[2] == i[3]:
        return sel((q & 2) != 0, values[i[2]], values[i[0]])
    if i[0] == i[2] and i[1] == i[3]:
        return sel((q & 1) != 0, values[i[1]], values[i[0]])
    low = sel((q & 1) != 0, values[i[1]], values[i[0]])
    high = sel((q & 1) != 0, values[i[3]], values[i[2]])
    return sel((q & 2) != 0, high, low)


def _bfly(x, bit: int):
    return cute.arch.shuffle_sync_bfly(x, offset=bit)


def row_scale_regs(coords: cute.Tensor) -> cute.Tensor:
    """A register tensor for the key scales of this thread's accumulator rows (one per row)."""
    return cute.make_rmem_tensor(cute.size(coords, mode=[0]), F32)


@cute.jit
def load_row_scales(sc: cute.Tensor, scales: cute.Tensor, coords: cute.Tensor):
    """sc[r] = scales[slot of row r] (slot = coords[r, 0][0]; `scales` the tile's (keys,) fp32) for
        this thread's accumulator rows, issued before the tile's MMA so the latency hides under it."""
    for r in cutlass.range_constexpr(cute.size(coords, mode=[0])):
        sc[r] = scales[coords[r, 0][0]]


@cute.jit
def sm90_store_logits(out: cute.Tensor, first_row, acc: cute.Tensor, coords: cute.Tensor, w: cute.Tensor, key0,
                      sc: cute.Tensor, lo, hi, tid, partial_heads, tokens: cutlass.Constexpr[int],
                      width: cutlass.Constexpr = None, compressed: cutlass.Constexpr = None):
    """The fused epilogue of one key tile: for each accumulator row r of this thread (key = key0 +
        slot, slot = coords[r, 0][0], sc[r] its key scale) and each token t < tokens,

            out[first_row + t, key] = masked_logit(sc[r] · Σ_quad partial_heads(row r, token t), key, lo, hi, t)

        `partial_heads`: `head_partial` or the kernel's hook wrapping it.  The pairs p = r · tokens
        + t go four at a time through `quad_reduce_scatter`, lane q storing pair 4k + q (key, scale,
        range and row by `quad_pick`: no branch); pairs not a multiple of 4 (I2 next_n = 1): a
        butterfly per pair, lane p mod 4 stores.  `width`: no store at key ≥ width (None: all
        inside).  `compressed` (I1, quad path): the output's width W; column key − lo[t], stored
        where 0 ≤ column < W."""
    acc_rc = acc_rows_cols(acc)
    rows = cute.size(coords, mode=[0])
    per_token = cute.size(coords, mode=[1]) // tokens
    q = tid % 4
    if cutlass.const_expr((rows * tokens) % 4 == 0):
        keys = [key0 + coords[r, 0][0] for r in range(rows)]
        scales = [sc[r] for r in range(rows)]
        out_rows = [first_row + t for t in range(tokens)]
        his = [hi[t] for t in range(tokens)]
        los = None if cutlass.const_expr(lo is None) else [lo[t] for t in range(tokens)]
        for k in cutlass.range_constexpr(rows * tokens // 4):
            rs = [(4 * k + j) // tokens for j in range(4)]
            ts = [(4 * k + j) % tokens for j in range(4)]
            parts = [partial_heads(acc_rc, w, rs[j], ts[j] * per_token, per_token) for j in range(4)]
            total = quad_reduce_scatter(parts, q, _bfly, cutlass.select_)
            key = quad_pick(q, keys, rs, cutlass.select_)
            inside = key < quad_pick(q, his, ts, cutlass.select_)
            if cutlass.const_expr(los is not None):
                inside = inside & (key >= quad_pick(q, los, ts, cutlass.select_))
            value = F32(cutlass.select_(inside, total * quad_pick(q, scales, rs, cutlass.select_), -F32.inf))
            row = quad_pick(q, out_rows, ts, cutlass.select_)
            value = to_output(value, out)
            if cutlass.const_expr(compressed is not None):
                col = key - quad_pick(q, los, ts, cutlass.select_)
                if (col >= 0) & (col < compressed):
                    out[row, col] = value
            elif cutlass.const_expr(width is None):
                out[row, key] = value
            else:
                if key < width:
                    out[row, key] = value
    else:
        if cutlass.const_expr(compressed is not None):
            raise ValueError("sm90_store_logits: compressed logits take the quad path (rows · tokens a multiple of 4)")
        for r in cutlass.range_constexpr(rows):
            key = key0 + coords[r, 0][0]
            for t in cutlass.range_constexpr(tokens):
                total = cute.arch.warp_reduction_sum(partial_heads(acc_rc, w, r, t * per_token, per_token),
                                                     threads_in_group=4)
                value = to_output(masked_logit(total * sc[r], key, lo, hi, t), out)
                if (r * tokens + t) % 4 == q:
                    if cutlass.const_expr(width is None):
                        out[first_row + t, key] = value
                    else:
                        if key < width:
                            out[first_row + t, key] = value


# ---------------------------------------------------------------------------------------
# Blackwell


def check_row_per_thread(t2r, coords, rows: int, chunk: int) -> None:
    """Trace-time proof that, for sampled threads t < rows, register j of t's tcgen05.ld fragment of
        column chunk c (`coords`: identity partition ((rows, chunk), chunks)) holds (t, c·chunk + j)."""
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
        raise ValueError(
            f"{who}: TMEM budget: {buffers} accumulator buffers × {cols} columns = {used} > {TMEM_COLUMNS}"
        )
    return tmem_alloc_cols(used)


class Sm100Setup(NamedTuple):
    """What every thread of the sm100 CTA holds once `Sm100LogitsCta.setup` ran."""

    sK: cute.Tensor  # the MMA's view of the K slots
    sQ: cute.Tensor
    sW: cute.Tensor  # the tokens' weights (n fp32)
    k_prod: object
    k_cons: object
    q_prod: object
    q_cons: object
    acc_prod: object
    acc_cons: object
    tmem_alloc: TmemAllocator
    epi_sync: pipeline.NamedBarrier
    tCrK: cute.Tensor
    tCrQ: cute.Tensor
    tQsQ: cute.Tensor
    tQgQ: cute.Tensor
    tmem_ptr: object
    acc_layout: object  # one accumulator buffer's TMEM layout


class Sm100LogitsCta:
    """The CTA both Blackwell indexer kernels run (256 threads), inherited by a kernel class:

            warps 0-3   epilogue: thread t ↔ TMEM lane t ↔ key t; warp 0 allocates / frees TMEM
            warp 4      MMA: per key tile, one accumulator buffer, four tcgen05.mma, commit
            warp 5      load: Q once, then the key tiles (TMA, STAGES slots)
            warps 6-7   fill: −inf outside the computed tiles

        Sᵀ = K_tile · Q_blockᵀ, tcgen05 kind::f8f6f4, M = BLOCK_K keys, N = n = tokens · 64 heads,
        K = DIM in four k32 steps, both K-major from shared memory; ACC_STAGES accumulators of n
        TMEM columns, so tile k + 1's MMAs overlap tile k's epilogue.  A kernel sets `mma_tiler` =
        (BLOCK_K, n, DIM) and `STAGES`."""

    MMA_K = 32  # K of one kind::f8f6f4 MMA
    EPI_COLS = 32  # accumulator columns per tcgen05.ld (32x32b.x32)
    ACC_STAGES = 2
    EPI_WARPS = (0, 1, 2, 3)
    EPI_THREADS = 128
    MMA_WARP = 4
    LOAD_WARP = 5
    FILL_WARPS = (6, 7)
    FILL_THREADS = 64
    THREADS = 256
    _TMEM_ALLOC_BAR = 1
    _EPI_BAR = 2

    def logits_mma(self, dtype) -> cute.TiledMma:
        """The tiled tcgen05 MMA over `mma_tiler`, fp32 accumulator, one CTA."""
        return cute.make_tiled_mma(tcgen05.MmaF8F6F4Op(
            dtype, dtype, F32, (self.mma_tiler[0], self.mma_tiler[1], self.MMA_K), tcgen05.CtaGroup.ONE,
            tcgen05.OperandSource.SMEM,
            tcgen05.OperandMajorMode.K,  # K tile [keys, d]: d contiguous (A, M = keys)
            tcgen05.OperandMajorMode.K,  # Q block [tokens · heads, d]: d contiguous (B, N = heads)
        ))

    def plan(self, mma: cute.TiledMma, dtype, k_smem, q_smem, who: str) -> None:
        """Trace time: the TMEM budget from the accumulator's layout (`acc_cols` a buffer, `tmem_cols`
                allocated) and `smem_struct`: k, q, acc mbarriers, the TMEM address, the weights (n
                fp32), the K and Q buffers (1024-byte aligned)."""
        acc = mma.make_fragment_C(mma.partition_shape_C(self.mma_tiler[:2]))
        self.acc_cols = tcgen05.find_tmem_tensor_col_offset(acc)
        self.tmem_cols = tmem_budget(self.ACC_STAGES, self.acc_cols, who)
        n = self.mma_tiler[1]

        @cute.struct
        class Smem:
            k_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.STAGES]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.ACC_STAGES]
            tmem_addr: cutlass.Int32
            w: cute.struct.Align[cute.struct.MemRange[F32, n], 16]
            sK: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(k_smem.outer)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(q_smem.outer)], 1024]

        self.smem_struct = Smem

    def setup(self, storage, ops: LogitsOperands) -> Sm100Setup:
        """Device side, every thread, before the roles split: shared-memory tensors, the k, q (TMA →
                MMA) and acc (MMA → epilogue) pipelines, TMEM allocator and named barrier, MMA fragments,
                Q's TMA partition (tile i = rows i · n … (i + 1) · n − 1), the TMEM allocation."""
        mma, k_smem, q_smem = ops.mma, ops.k_smem, ops.q_smem
        sK = storage.sK.get_tensor(k_smem.outer, swizzle=k_smem.inner)  # (MMA, 1, d/32, stages)
        sQ = storage.sQ.get_tensor(q_smem.outer, swizzle=q_smem.inner)  # (MMA, 1, d/32, 1)
        sW = storage.w.get_tensor(cute.make_layout(self.mma_tiler[1]))
        k_prod, k_cons = tma_umma_pipeline(storage.k_mbar, self.STAGES, self.k_bytes, name="k")
        q_prod, q_cons = tma_umma_pipeline(storage.q_mbar, 1, self.q_bytes, name="q")
        acc_prod, acc_cons = umma_to_threads_pipeline(storage.acc_mbar, self.EPI_THREADS, self.ACC_STAGES, name="acc")
        tmem_alloc = TmemAllocator(
            storage.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=self._TMEM_ALLOC_BAR, num_threads=self.THREADS),
            allocator_warp_id=self.EPI_WARPS[0],
        )
        epi_sync = pipeline.NamedBarrier(barrier_id=self._EPI_BAR, num_threads=self.EPI_THREADS)
        tCrK = mma.make_fragment_A(sK)
        tCrQ = mma.make_fragment_B(sQ)
        gQ = cute.local_tile(ops.mQ, self.mma_tiler, (0, None, 0), proj=(None, 1, 1))  # (n, d, query tiles)
        tQsQ, tQgQ = tma_partition_tile(ops.tma_q, sQ, mma.get_slice(0).partition_B(gQ), 3)
        tmem_ptr = tmem_allocate(tmem_alloc, self.tmem_cols)
        acc_layout = mma.make_fragment_C(mma.partition_shape_C(self.mma_tiler[:2])).layout
        return Sm100Setup(sK, sQ, sW, k_prod, k_cons, q_prod, q_cons, acc_prod, acc_cons, tmem_alloc, epi_sync,
                          tCrK, tCrQ, tQsQ, tQgQ, tmem_ptr, acc_layout)


@cute.jit
def mma_key_tiles(tile_begin, tile_end, q_cons, k_cons, acc_prod, mma, tCrK, tCrQ, tmem_ptr, acc_layout,
                  acc_cols: cutlass.Constexpr[int]):
    """The MMA warp: once Q has landed, per key tile an empty accumulator buffer and the tile's K
        slot, acc = K_tile · Q_blockᵀ in four k32 MMAs, then release the K slot and commit the buffer
        (tcgen05.commit)."""
    hang_guard.role("mma")  # names this role's waits in a --debug-hangs build
    if tile_end > tile_begin:
        q_cons.wait_and_advance()
    for tile in cutlass.range(tile_begin, tile_end, unroll=1):
        slot = acc_prod.acquire_and_advance()
        acc = cute.make_tensor(tmem_ptr + slot.index * acc_cols, acc_layout)
        full = k_cons.wait_and_advance()
        tcgen05_fence_after_sync()
        for kk in cutlass.range_constexpr(cute.size(tCrK, mode=[2])):
            mma.set(tcgen05.Field.ACCUMULATE, kk != 0)
            cute.gemm(mma, acc, tCrK[None, None, kk, full.index], tCrQ[None, None, kk, 0], acc)
        full.release()
        slot.commit()


@cute.jit
def weights_to_smem(sW: cute.Tensor, mW: cute.Tensor, first_row, n: cutlass.Constexpr[int], tid,
                    threads: cutlass.Constexpr[int], heads: cutlass.Constexpr[int] = HEADS):
    """sW[c] = weights[first_row + c // heads, c % heads] for the n = tokens · heads columns of
    the MMA's N, by `threads` threads (this one is `tid`)."""
    for c in cutlass.range_constexpr((n + threads - 1) // threads):
        col = c * threads + tid
        if cutlass.const_expr(n % threads == 0):
            sW[col] = mW[first_row + col // heads, col % heads]
        else:
            if col < n:
                sW[col] = mW[first_row + col // heads, col % heads]


class TmemRows(NamedTuple):
    """An epilogue thread's reader of its accumulator row (see `tmem_row_reader`)."""

    t2r: object  # the tiled tcgen05.ld
    thr: object  # this thread's slice of it
    r: cute.Tensor  # its register fragment (one chunk of columns)
    tmem_ptr: object  # buffer 0; buffer i starts `cols` columns further per i
    acc_layout: object
    buffer_cols: int


def tmem_row_reader(mma: cute.TiledMma, tmem_ptr, acc_layout, buffer_cols: int, keys: int, n: int, cols: int,
                    tid) -> TmemRows:
    """The tcgen05.ld 32x32b.x`cols` copy of an accumulator buffer in `cols`-column chunks, thread
        `tid`'s slice and fragment: chunk c is row t, columns c·cols … c·cols + cols − 1 (proved)."""
    tiler = ((keys, cols),)
    acc0 = cute.zipped_divide(cute.make_tensor(tmem_ptr, acc_layout), tiler)  # ((keys, cols), n / cols)
    t2r = tmem_copy(tcgen05.Ld32x32bOp, tcgen05.Repetition.x32, F32, acc0[(None, 0)])
    ident = cute.zipped_divide(mma.get_slice(0).partition_C(cute.make_identity_tensor((keys, n))), tiler)
    check_row_per_thread(t2r, ident, keys, cols)
    thr = t2r.get_slice(tid)
    r = cute.make_rmem_tensor(thr.partition_D(ident[(None, 0)]).shape, F32)
    return TmemRows(t2r, thr, r, tmem_ptr, acc_layout, buffer_cols)


@cute.jit
def tmem_head_sums(sums: cute.Tensor, rows: TmemRows, buffer, sW: cute.Tensor, keys: cutlass.Constexpr[int],
                   cols: cutlass.Constexpr[int]):
    """sums[t] = Σ_h sW[t · heads + h] · relu(acc[key, t · HEADS + h]) for this thread's key (its
        TMEM lane) and each token t, from buffer `buffer`, `cols` columns a tcgen05.ld, thread-local;
        tcgen05.fence::after_thread_sync before the first load, ::before_thread_sync after the last."""
    tcgen05_fence_after_sync()
    acc = cute.make_tensor(rows.tmem_ptr + buffer * rows.buffer_cols, rows.acc_layout)
    acc_epi = cute.zipped_divide(acc, ((keys, cols),))
    chunks = cute.size(acc_epi, mode=[1])
    per_token = chunks // cute.size(sums)
    sums.fill(0.0)
    for c in cutlass.range_constexpr(chunks):
        cute.copy(rows.t2r, rows.thr.partition_S(acc_epi[(None, c)]), rows.r)
        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
        part = F32(0.0)
        for j in cutlass.range_constexpr(cols):
            part += cute.arch.fmax(rows.r[j], F32(0.0)) * sW[c * cols + j]
        sums[c // per_token] = sums[c // per_token] + part
    tcgen05_fence_before_sync()
