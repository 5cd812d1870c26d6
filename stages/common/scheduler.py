"""Decode tile scheduler: which (head block, token, batch, KV split) a CTA works on, and how
many KV splits a launch uses.

The work of one decode launch (DSV4 MQA: every query head of a sequence shares one latent KV
head) is a set of row blocks — `block_m` query heads of one token of one sequence, the heads
folded into the MMA's M dimension — times the KV tiles of `block_n` keys each of those rows
attends.  With `splits` KV splits, split `s` owns the tiles

    [s · c, min((s + 1) · c, T))          c = ceil(T / splits),  T = ceil(n / block_n)

so the first ceil(T / c) splits hold tiles and the rest are EMPTY (any `splits`, not only
`splits > T`: T = 18, splits = 7 gives c = 3 and one empty split).  An empty split still runs:
it writes partial LSE = −inf and a zero partial O, which the combine ignores.

Grid (x, y, z) = (head_blocks · tokens, splits, batches): x runs fastest, so the CTAs that run
together are the head blocks and tokens of one (split, batch) — they read the same KV tiles,
which then come from L2.

    x = token · head_blocks + head_block,   y = split,   z = batch

`DecodeGrid.work` is that mapping.  The kernel calls the very same function on its traced
block indices (only `//`, `%`, `*`, `+` and a min that works on ints and on traced Int32),
and the CPU tests call it on Python ints: the test checks the code the kernel runs.

Split count.  A launch of `ctas` CTAs (row blocks) on a GPU of `sm_count` SMs:
    ctas ≥ sm_count          → 1 split (the GPU is already full)
    otherwise                → the s in 1 … min(T, MAX_SPLITS) with no empty split that
                               minimises  waves(s) · (ceil(T / s) + 1) + (½ if s > 1)
      waves(s) = ceil(ctas · s / sm_count); the +1 is a CTA's fixed cost (Q load, partial
      write) in tile units, the ½ the combine launch; ties go to fewer splits.
`resolve_splits` turns the test matrix's axis value (an int, "auto" or "many" = T + 3, i.e.
three empty splits) into a count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

SM_COUNT = 132  # H100 SXM and H200 (sm_90a); a kernel parameter where it matters
MAX_SPLITS = 128
MANY_EXTRA = 3  # "many" = T + MANY_EXTRA splits: the last MANY_EXTRA are empty


_SHAPE_WORD = re.compile(r"b(\d+)s(\d+)h(\d+)n(\d+)d(\d+)(?:p(\d+))?")


@dataclass(frozen=True)
class DecodeShape:
    """A decode problem: b sequences, s_q query tokens each, h_q query heads of width d, one
    KV head of n attended keys stored in n_alloc ≥ n rows.  Named in a test matrix by a word
    b{b}s{s_q}h{h_q}n{n}d{d}[p{pad}] (n_alloc = n + pad), e.g. b4s2h64n1152d512p100."""

    b: int
    s_q: int
    h_q: int
    n: int
    d: int
    n_alloc: int

    @staticmethod
    def parse(word: str) -> "DecodeShape":
        m = _SHAPE_WORD.fullmatch(str(word))
        if not m:
            raise ValueError(f"shape {word!r} is not b<B>s<S>h<H>n<N>d<D>[p<PAD>], e.g. b4s2h64n1152d512p100")
        b, s_q, h_q, n, d = (int(x) for x in m.groups()[:5])
        if min(b, s_q, h_q, n, d) < 1:
            raise ValueError(f"shape {word!r}: every size must be positive")
        return DecodeShape(b, s_q, h_q, n, d, n + int(m.group(6) or 0))


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def tiles_per_split(num_tiles: int, splits: int) -> int:
    return ceil_div(num_tiles, splits)


def nonempty_splits(num_tiles: int, splits: int) -> int:
    """How many of `splits` splits hold at least one of `num_tiles` tiles."""
    return ceil_div(num_tiles, tiles_per_split(num_tiles, splits))


def split_cost(ctas: int, num_tiles: int, splits: int, sm_count: int = SM_COUNT) -> float:
    """The chooser's estimate of a launch's time, in KV-tile units (see the module doc)."""
    waves = ceil_div(ctas * splits, sm_count)
    return waves * (tiles_per_split(num_tiles, splits) + 1) + (0.5 if splits > 1 else 0.0)


def choose_splits(ctas: int, num_tiles: int, sm_count: int = SM_COUNT) -> int:
    """The number of KV splits for `ctas` row blocks over `num_tiles` KV tiles each."""
    if ctas <= 0 or num_tiles <= 0 or sm_count <= 0:
        raise ValueError(f"choose_splits: ctas, num_tiles and sm_count must be positive, got {ctas}, {num_tiles}, {sm_count}")
    if ctas >= sm_count:
        return 1
    best, best_cost = 1, split_cost(ctas, num_tiles, 1, sm_count)
    for s in range(2, min(num_tiles, MAX_SPLITS) + 1):
        if nonempty_splits(num_tiles, s) != s:
            continue
        cost = split_cost(ctas, num_tiles, s, sm_count)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def resolve_splits(value: Any, *, ctas: int, num_tiles: int, sm_count: int = SM_COUNT) -> int:
    """The split count for the matrix value `value`: a positive int, "auto" (choose_splits)
    or "many" (num_tiles + MANY_EXTRA: more splits than tiles, the last ones empty)."""
    if value == "auto":
        return choose_splits(ctas, num_tiles, sm_count)
    if value == "many":
        return num_tiles + MANY_EXTRA
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value > MAX_SPLITS + MANY_EXTRA:
        raise ValueError(f"splits must be a positive int ≤ {MAX_SPLITS + MANY_EXTRA}, 'auto' or 'many', got {value!r}")
    return value


def _min(a, b):
    """min on Python ints, or on traced integers inside a kernel (cutlass.min)."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    import cutlass

    return cutlass.min(a, b)


class DecodeWork(NamedTuple):
    """One CTA's work: its row block and its KV tile range [tile_begin, tile_end)."""

    head_block: Any
    token: Any
    batch: Any
    split: Any
    tile_begin: Any
    tile_end: Any


@dataclass(frozen=True)
class DecodeGrid:
    """The launch of a decode kernel (all compile-time ints)."""

    head_blocks: int  # h_q / block_m
    tokens: int  # s_q
    batches: int  # b
    splits: int
    num_tiles: int  # KV tiles of one sequence

    def __post_init__(self) -> None:
        for name in ("head_blocks", "tokens", "batches", "splits", "num_tiles"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DecodeGrid.{name} must be a positive int, got {v!r}")

    @property
    def chunk(self) -> int:
        """KV tiles per split (the last non-empty split may hold fewer)."""
        return tiles_per_split(self.num_tiles, self.splits)

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.head_blocks * self.tokens, self.splits, self.batches)

    @property
    def row_blocks(self) -> int:
        """Row blocks of the output (= CTAs of one split)."""
        return self.head_blocks * self.tokens * self.batches

    def work(self, bx, by, bz) -> DecodeWork:
        """The work of CTA (bx, by, bz); ints or traced Int32s."""
        head_block = bx % self.head_blocks
        token = bx // self.head_blocks
        begin = by * self.chunk
        end = _min(begin + self.chunk, self.num_tiles)
        return DecodeWork(head_block, token, bz, by, begin, end)

    def row_block(self, w: DecodeWork):
        """Index of w's 64-row block in O and Q viewed as [b · s_q · h_q / block_m] blocks of
        rows (rows = (batch, token, head) row-major)."""
        return (w.batch * self.tokens + w.token) * self.head_blocks + w.head_block

    def partial_row_block(self, w: DecodeWork):
        """Index of w's row block in the split partials, [splits · b · s_q · h_q / block_m]
        blocks (split-major)."""
        return w.split * self.row_blocks + self.row_block(w)
