"""Which KV tiles one CTA of the sm100 decode house visits, where each comes from, and what is
masked on it (D2–D5).  The house asks a keys object, built in the rung's kernel():

    n_local              tiles this CTA visits (0: an empty split → O = 0, LSE −∞ / +∞)
    load(j, cid, …)      TMA of chunk `cid` of visited tile j into a ring slot (load warp)
    masked               compile-time: False for D2 — then nothing below is emitted
    clean_v(j, …)        MMA warp: zero V rows past the fill level of a boundary tile
    mask(j, …)           softmax threads: the row's invalid scores → −∞ (a select every tile)

`DenseKeys` (D2): the split's tiles [begin, end), all keys valid.  `BranchKeys` (D3–D5): one or
two branches with fill levels `lens[b]` and optionally D4's causal rule; the split's static
tiles, visited where they hold a valid key (scheduler.py's key_limit, valid_tiles,
visit_tiles); a block of two tokens visits its LAST token's tiles, each thread masking with its
row's limit.  The house calls a keys object's methods only through its own (the tracer cannot
carry it through a staged `if` or loop)."""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from stages.common.scheduler import key_limit, valid_tiles, visit_tiles
from stages.common.sm100_masks import clean_v_rows, mask_row_scores
from stages.common.tma import tma_partition_tile


def kv_partition(kv, sK, qk_thr, k_tiler, batch):
    """(tKsK, tKgK): TMA partitions of one KV source (atom, TMA tensor (n, d, b)) — a ring
    slot and the batch's (TMA, tiles, chunks) view."""
    tma, mK = kv
    gK = cute.flat_divide(mK, cute.select(k_tiler, mode=[1, 2]))  # (kv, chunk, tiles, chunks, b)
    tKsK, tKgK = tma_partition_tile(tma, sK, qk_thr.partition_B(gK), 3)
    return tKsK, tKgK[None, None, None, batch]


class DenseKeys:
    """D2: tiles [tile_begin, tile_end) of one KV tensor (`kv` = (TMA atom, TMA tensor)),
    every key valid."""

    masked = False

    def __init__(self, tile_begin, tile_end, kv):
        self.tile_begin = tile_begin
        self.n_local = cutlass.max(tile_end - tile_begin, 0)
        self.kv = kv

    def atoms(self):
        return (self.kv[0],)

    def partition(self, sK, qk_thr, k_tiler, batch) -> None:
        """Add the TMA partitions (once the shared-memory ring exists)."""
        self.tKsK, self.tKgK = kv_partition(self.kv, sK, qk_thr, k_tiler, batch)

    @cute.jit
    def load(self, j, cid, slot, bar):
        cute.copy(self.kv[0], self.tKgK[None, self.tile_begin + j, cid], self.tKsK[None, slot], tma_bar_ptr=bar)


@dataclass(frozen=True)
class Branch:
    """A key branch: `n` attended keys (a multiple of 64) of a KV tensor of `n_alloc` rows,
    with a per-batch fill level, and D4's causal rule when `causal`."""

    name: str
    n: int
    n_alloc: int
    causal: bool = False


class BranchKeys:
    """D3–D5: the tiles of one or two masked branches (module doc): static `Branch`es, their (TMA atom,
        tensor), fill levels lens[b], the split's tiles [tile_begin, tile_end), the block's last token
        t_hi, s_q, kv_tile."""

    masked = True

    def __init__(self, branches, kvs, fills, tile_begin, tile_end, t_hi, s_q: int, kv_tile: int):
        self.branches = tuple(branches)
        self.kvs = tuple(kvs)
        self.fills = tuple(fills)
        self.s_q = s_q
        self.kv_tile = kv_tile
        tiles = [br.n // kv_tile for br in self.branches]
        valid = [valid_tiles(self.limit(i, t_hi), kv_tile) for i in range(len(self.branches))]
        plan = visit_tiles(tile_begin, tile_end, tiles[0], valid[0], valid[1] if len(valid) > 1 else 0)
        self.count, self.n_first, self.first_begin, self.second_begin = plan
        self.n_local = self.count

    def limit(self, i: int, token):
        """Branch i's key limit for a row of query token `token`."""
        br = self.branches[i]
        return key_limit(br.n, self.fills[i], br.causal, self.s_q, token)

    def tile(self, j):
        """(is second branch, branch-local tile) of visited tile j."""
        second = j >= self.n_first
        t = cutlass.Int32(cutlass.select_(second, self.second_begin + j - self.n_first, self.first_begin + j))
        return second, t

    def atoms(self):
        return tuple(kv[0] for kv in self.kvs)

    def partition(self, sK, qk_thr, k_tiler, batch) -> None:
        parts = [kv_partition(kv, sK, qk_thr, k_tiler, batch) for kv in self.kvs]
        self.tKsK = parts[0][0]
        self.tKgK = tuple(p[1] for p in parts)

    @cute.jit
    def load(self, j, cid, slot, bar):
        second, t = self.tile(j)
        if cutlass.const_expr(len(self.kvs) == 1):
            cute.copy(self.kvs[0][0], self.tKgK[0][None, t, cid], self.tKsK[None, slot], tma_bar_ptr=bar)
        else:
            if second:
                cute.copy(self.kvs[1][0], self.tKgK[1][None, t, cid], self.tKsK[None, slot], tma_bar_ptr=bar)
            else:
                cute.copy(self.kvs[0][0], self.tKgK[0][None, t, cid], self.tKsK[None, slot], tma_bar_ptr=bar)

    def branch_value(self, second, values):
        """values[1] on a second-branch tile, else values[0] (traced select)."""
        if len(values) == 1:
            return values[0]
        return cutlass.Int32(cutlass.select_(second, values[1], values[0]))

    @cute.jit
    def clean_v(self, j, lines, slot):
        """MMA warp: zero the rows at or past the fill level of visited tile j's ring slot."""
        second, t = self.tile(j)
        rem = self.branch_value(second, self.fills) - t * self.kv_tile
        if rem < self.kv_tile:
            clean_v_rows(lines, slot, rem)

    @cute.jit
    def mask(self, j, rS, key_cols: cutlass.Constexpr, token):
        """Softmax thread of query token `token`: −∞ on the keys of tile j its row may not see."""
        second, t = self.tile(j)
        limits = [self.limit(i, token) for i in range(len(self.branches))]
        rem = self.branch_value(second, limits) - t * self.kv_tile
        # On every visited tile, not only when rem < kv_tile: behind a runtime `if` ptxas kept
        # two copies of the 64 scores (168 registers instead of 126); on a full tile the 64
        # compares against constants select nothing.
        mask_row_scores(rS, key_cols, rem)
