"""Persistent decode schedule: a few long-lived CTAs ("parts"), each walking a contiguous run of
the flattened (sequence, KV tile) work — FlashMLA's way of scheduling a decode.

S = s_q · b sequences (each walked alike by its `head_blocks` row blocks), T KV tiles each,
flattened f = s · T + t and cut into parts of L tiles:

    part p owns f ∈ [p · L, min((p + 1) · L, S · T)),   P = ceil(S · T / L) parts

One CTA per (head block, part): grid (head_blocks, P, 1), x fastest (a (2, 1, 1) cluster pairs
the head blocks).  Segment k of part p is sequence s = ⌊p·L / T⌋ + k, tiles [t₀, t₁):

    t₀ = max(p · L, s · T) − s · T,     t₁ = min(T, end − s · T),     end = min((p + 1) · L, S · T)

A CTA runs its segments without ending (its key pipeline goes on).  A whole sequence (t₀ = 0,
t₁ = T) writes O and LSE (sink included); otherwise a PARTIAL, slot

    j = p − ⌊s · T / L⌋            (the sequence's first part writes slot 0)

of the scratch [capacity, rows, d]; a sequence is cut into n(s) = ⌊((s + 1) · T − 1) / L⌋ −
⌊s · T / L⌋ + 1 pieces, capacity = max_s n(s) ≤ T.  n(s) = 2 with the grid resident at once:
the attention kernel merges them (part_merge.py); other cut sequences: `PartCombine`.  With L a
multiple of T nothing is cut.  `segment` is the kernel's mapping (ints or traced Int32s).

Part length: `choose_part_tiles` minimises, in tiles,
    waves · (L + SEGMENT_COST · most segments of a part)
        + (COMBINE_COST + SPLIT_COST · cut sequences · head_blocks
           + PIECE_COST · the most pieces of a sequence               if any sequence is cut)
    waves = ceil(P · head_blocks / sm_count)
(a segment's fixed cost about a tile; the piece term: docs/STAGE_E.md).  Ties go to the longer
part.  `resolve_part_tiles`: an int n gives L = ceil(T / n), "auto" the chooser, "many" L = 1."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from stages.common.scheduler import MAX_SPLITS, MANY_EXTRA, SM_COUNT, DecodeWork, _max, _min, ceil_div

SEGMENT_COST = 1.0
SPLIT_COST = 0.04
COMBINE_COST = 0.5
PIECE_COST = 0.15


@dataclass(frozen=True)
class PartGrid:
    """The persistent launch of a decode kernel (all compile-time ints; see the module doc)."""

    head_blocks: int
    tokens: int  # s_q
    batches: int  # b
    num_tiles: int  # T, KV tiles of one sequence
    part_tiles: int  # L

    def __post_init__(self) -> None:
        for name in ("head_blocks", "tokens", "batches", "num_tiles", "part_tiles"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PartGrid.{name} must be a positive int, got {v!r}")

    @property
    def sequences(self) -> int:
        return self.tokens * self.batches

    @property
    def total(self) -> int:
        """Tiles of all sequences (S · T)."""
        return self.sequences * self.num_tiles

    @property
    def parts(self) -> int:
        return ceil_div(self.total, self.part_tiles)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.head_blocks, self.parts, 1)

    @property
    def row_blocks(self) -> int:
        """Row blocks of the output: head_blocks · S."""
        return self.head_blocks * self.sequences

    @property
    def chunk(self) -> int:
        """The most tiles one segment holds."""
        return min(self.part_tiles, self.num_tiles)

    def pieces(self, s: int) -> int:
        """n(s): how many parts sequence s is cut into (1: it is never a partial)."""
        T, L = self.num_tiles, self.part_tiles
        return ((s + 1) * T - 1) // L - (s * T) // L + 1

    @property
    def capacity(self) -> int:
        """Partial slots a sequence may need (the scratch's first extent)."""
        return max(self.pieces(s) for s in range(self.sequences))

    @property
    def cut(self) -> int:
        """Sequences cut into partials."""
        return sum(self.pieces(s) > 1 for s in range(self.sequences))

    def cut_at(self, boundary):
        """(sequence, whether this boundary combines it) for part boundary `boundary` (1 … parts − 1):
                the sequence s it falls in, cut iff the boundary is not at its start, combined by the
                first boundary inside it (exactly one names each cut sequence).  Ints or traced."""
        at = boundary * self.part_tiles
        s = at // self.num_tiles
        return s, (at % self.num_tiles != 0) & ((boundary - 1) * self.part_tiles <= s * self.num_tiles)

    def segments(self, p):
        """Segments of part p: the sequences its tiles touch.  Ints or traced."""
        begin = p * self.part_tiles
        end = _min(begin + self.part_tiles, self.total)
        return (end - 1) // self.num_tiles - begin // self.num_tiles + 1

    def segment(self, head_block, p, k):
        """(work, tiles of the part before it) of segment k of part p for head block
        `head_block`; work.split is the partial slot j.  Ints or traced."""
        T = self.num_tiles
        begin = p * self.part_tiles
        end = _min(begin + self.part_tiles, self.total)
        s = begin // T + k
        start = _max(begin, s * T)
        t1 = _min(end - s * T, T)
        work = DecodeWork(head_block, s % self.tokens, s // self.tokens, p - (s * T) // self.part_tiles, start - s * T, t1)
        return work, start - begin

    def complete(self, w: DecodeWork):
        """Whether segment w is its whole sequence (it writes O and LSE itself).  Ints or traced."""
        if isinstance(w.tile_begin, int) and isinstance(w.tile_end, int):
            return w.tile_begin == 0 and w.tile_end == self.num_tiles
        return (w.tile_begin == 0) & (w.tile_end == self.num_tiles)

    def row_block(self, w: DecodeWork):
        """Index of w's 64-row block in O and Q viewed as [b · s_q · h_q / 64] row blocks."""
        return (w.batch * self.tokens + w.token) * self.head_blocks + w.head_block

    def partial_row_block(self, w: DecodeWork):
        """Index of w's row block in the partials, [capacity · b · s_q · h_q / 64] (slot-major)."""
        return w.split * self.row_blocks + self.row_block(w)


def part_cost(grid: PartGrid, sm_count: int = SM_COUNT) -> float:
    """The chooser's estimate of a launch's time, in KV-tile units (see the module doc)."""
    waves = ceil_div(grid.parts * grid.head_blocks, sm_count)
    most = max(grid.segments(p) for p in range(grid.parts))
    cut = grid.cut
    extra = COMBINE_COST + SPLIT_COST * cut * grid.head_blocks + PIECE_COST * grid.capacity if cut else 0.0
    return waves * (grid.part_tiles + SEGMENT_COST * most) + extra


@lru_cache(maxsize=256)
def choose_part_tiles(head_blocks: int, tokens: int, batches: int, num_tiles: int, sm_count: int = SM_COUNT) -> int:
    """The part length L for the launch (the module doc's estimate, over L = 1 … the length at
    which every part is whole sequences filling the GPU once)."""
    if min(head_blocks, tokens, batches, num_tiles, sm_count) < 1:
        raise ValueError("choose_part_tiles: every argument must be positive")
    seqs = tokens * batches
    longest = num_tiles * ceil_div(seqs * head_blocks, sm_count)
    best, best_cost = longest, part_cost(PartGrid(head_blocks, tokens, batches, num_tiles, longest), sm_count)
    for L in range(longest - 1, 0, -1):
        cost = part_cost(PartGrid(head_blocks, tokens, batches, num_tiles, L), sm_count)
        if cost < best_cost:
            best, best_cost = L, cost
    return best


def resolve_part_tiles(value: Any, *, head_blocks: int, tokens: int, batches: int, num_tiles: int,
                       sm_count: int = SM_COUNT) -> int:
    """The part length for the matrix's `splits` value (see the module doc)."""
    if value == "auto":
        return choose_part_tiles(head_blocks, tokens, batches, num_tiles, sm_count)
    if value == "many":
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value > MAX_SPLITS + MANY_EXTRA:
        raise ValueError(f"splits must be a positive int ≤ {MAX_SPLITS + MANY_EXTRA}, 'auto' or 'many', got {value!r}")
    return ceil_div(num_tiles, min(value, num_tiles))
