"""Wide global stores of a wgmma accumulator (an epilogue's O in bf16, or a partial in fp32).

The m64nNk16 accumulator gives thread t of a warpgroup (warp w = t // 32, lane l = t % 32,
q = l % 4 its place in the row's quad) the values

    rows  16·w + l // 4  and  + 8          (h = 0, 1)
    cols  8·g + 2·q + e                     (g = 0 … N/8 − 1 the 8-column group, e = 0, 1)

in register order i = e + 2·h + 4·g (`check_accumulator_layout` proves it).  As bf16 a (row,
group)'s two columns are word w(h, g) = 2·g + h, and a quad's four threads hold its 16
contiguous bytes: stored as they are, a warp instruction writes 4 bytes a thread.

Transposed across the quad, 4 groups at a time, thread q holds group 4·b + q's four words (16
bytes): a quarter of the instructions (fp32: each of the two words transposed on its own).
`quad_transpose` (word i of thread s ↦ word s of thread i) takes two butterfly steps: step
`bit` swaps 2 × 2 blocks (threads s, s ⊕ bit; words i, i ⊕ bit), after which word i of thread
s is word (i & ~bit) | (s & bit) of thread (s & ~bit) | (i & bit); a shuffle and two selects
per pair of words."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import cutlass
import cutlass.cute as cute


def quad_transpose(words: Sequence[Any], q: Any, shfl: Callable[[Any, int], Any],
                   sel: Callable[[Any, Any, Any], Any]) -> list:
    """Word i of quad thread s → word s of thread i (module doc).  `q`: the place in the quad;
        `shfl(v, bit)`: v of place q ⊕ bit; `sel(c, a, b)`.  Numpy lanes (CPU test) or traced."""
    a = list(words)
    if len(a) != 4:
        raise ValueError(f"quad_transpose takes 4 words, got {len(a)}")
    for bit in (1, 2):
        low = (q & bit) == 0
        for i in (0, 1, 2, 3):
            if i & bit:
                continue
            send = sel(low, a[i + bit], a[i])
            got = shfl(send, bit)
            a[i], a[i + bit] = sel(low, a[i], got), sel(low, got, a[i + bit])
    return a


def accumulator_coordinate(t: int, i: int, col0: int = 0) -> tuple[int, int]:
    """(row, column) of register i of warpgroup thread t in an m64nN accumulator (the module
    doc's formula); `col0` the first column of the tiled MMA's slice the thread's warpgroup owns."""
    w, lane = (t % 128) // 32, t % 32
    e, h, g = i % 2, (i // 2) % 2, i // 4
    return 16 * w + lane // 4 + 8 * h, col0 + 8 * g + 2 * (lane % 4) + e


def check_accumulator_layout(tiled_mma, tile_mn: tuple[int, int], threads: Sequence[int], cols_per_warpgroup: int) -> None:
    """Trace time: every register of each of `threads` in `tiled_mma`'s C fragment over `tile_mn`
    sits at `accumulator_coordinate` (warpgroup k's columns start at k · cols_per_warpgroup), or
    ValueError."""
    ident = cute.make_identity_tensor(tile_mn)
    for t in threads:
        coords = tiled_mma.get_slice(t).partition_C(ident)
        for i in range(cute.size(coords)):
            want = accumulator_coordinate(t, i, (t // 128) * cols_per_warpgroup)
            if tuple(coords[i]) != want:
                raise ValueError(f"accumulator register {i} of thread {t} is at {tuple(coords[i])}, "
                                 f"the wide store assumes {want}")


def _shfl(v, bit: int):
    return cute.arch.shuffle_sync_bfly(v, offset=bit)


@cute.jit
def store_accumulator_wide(acc: cute.Tensor, tidx, row_base_addr, row_bytes: cutlass.Constexpr[int], col0,
                           dtype: cutlass.Constexpr[type]) -> None:
    """Store this thread's fp32 accumulator as `dtype` rows (bf16 O or fp32 partials), row r at
        row_base_addr + r · row_bytes, its warpgroup's columns from `col0`, by 16-byte stores after
        `quad_transpose` (the whole warp takes part); fp32 transposes each of a group's two words."""
    lane = tidx % 32
    q = lane % 4
    row0 = (tidx % 128) // 32 * 16 + lane // 4
    size = 2 if cutlass.const_expr(dtype == cutlass.BFloat16) else 4  # bytes a value
    vals = cute.make_rmem_tensor(acc.shape, dtype)
    vals.store(acc.load().to(dtype))
    words = cute.recast_tensor(vals, cutlass.Int32)
    groups = cute.size(acc) // 4
    per = 1 if cutlass.const_expr(size == 2) else 2  # bf16: one word (2 values); fp32: one word a column e
    out = cute.make_rmem_tensor(4 * per, cutlass.Int32)
    for h in cutlass.range_constexpr(2):
        for blk in cutlass.range_constexpr(groups // 4):
            for e in cutlass.range_constexpr(per):
                # word of (row h, group g, column e): bf16 2·g + h; fp32 4·g + 2·h + e
                got = quad_transpose([words[per * (2 * (4 * blk + i) + h) + e] for i in range(4)], q, _shfl,
                                     cutlass.select_)
                for s in cutlass.range_constexpr(4):
                    out[per * s + e] = got[s]  # thread s's columns of group 4·blk + q
            addr = row_base_addr + cutlass.Int64((row0 + 8 * h) * row_bytes + (col0 + 8 * (4 * blk + q)) * size)
            for piece in cutlass.range_constexpr(per):
                dst = cute.make_tensor(cute.make_ptr(cutlass.Int32, addr + 16 * piece, cute.AddressSpace.gmem,
                                                     assumed_align=16), cute.make_layout(4))
                cute.autovec_copy(cute.make_tensor(out.iterator + 4 * piece, cute.make_layout(4)), dst)


@cute.jit
def store_accumulator_pairs(acc: cute.Tensor, tidx, row_base_addr, row_bytes: cutlass.Constexpr[int], col0) -> None:
    """Store this thread's fp32 accumulator as fp32 rows, no transpose: each (row, group)'s two columns
        one 8-byte store (twice store_accumulator_wide's instructions, no shuffles)."""
    lane = tidx % 32
    q = lane % 4
    row0 = (tidx % 128) // 32 * 16 + lane // 4
    for h in cutlass.range_constexpr(2):
        for g in cutlass.range_constexpr(cute.size(acc) // 4):
            addr = row_base_addr + cutlass.Int64((row0 + 8 * h) * row_bytes + (col0 + 8 * g + 2 * q) * 4)
            dst = cute.make_tensor(cute.make_ptr(cutlass.Float32, addr, cute.AddressSpace.gmem, assumed_align=8),
                                   cute.make_layout(2))
            cute.autovec_copy(cute.make_tensor(acc.iterator + 4 * g + 2 * h, cute.make_layout(2)), dst)
