"""Decode tile scheduler: which (head block, token, batch, KV split) a CTA works on, and how many
KV splits a launch uses.

A decode launch's work is row blocks (`block_m` heads of one token of one sequence, folded into
M) times the KV tiles of `block_n` keys they attend.  With `splits` splits, split s owns

    [s · c, min((s + 1) · c, T))          c = ceil(T / splits),  T = ceil(n / block_n)

so the splits past ceil(T / c) are EMPTY (T = 18, splits = 7: c = 3, one empty); an empty split
writes partial LSE = −inf and O = 0, which the combine ignores.

Grid (x, y, z) = (head_blocks · tokens, splits, batches), x fastest (CTAs reading the same KV
tiles run together):  x = token · head_blocks + head_block,  y = split,  z = batch.
`DecodeGrid.work` is that mapping, run by the kernel on traced indices and by the CPU tests on
ints.

Split count for `ctas` CTAs on `sm_count` SMs: 1 when ctas ≥ sm_count, else the s in 1 …
min(T, MAX_SPLITS) with no empty split minimising waves(s) · (ceil(T / s) + 1) + (½ if s > 1),
waves(s) = ceil(ctas · s / sm_count) (+1: a CTA's fixed cost in tiles, ½: the combine); ties to
fewer splits.  `resolve_splits` maps the axis value (an int, "auto", "many" = T + 3).

Masked and two-branch key sets (D3–D5): a split owns static tiles [begin, end) of [0, T₁) ++
[T₁, T₁ + T₂), but visits only tiles holding a valid key; branch i's valid keys fill its first
v_i tiles (`valid_tiles` of `key_limit`):

    first  = [begin, min(end, v₁))                     branch-1 tiles, as they are
    second = [max(begin, T₁), min(end, T₁ + v₂)) − T₁   branch-2 tiles, branch-local

`visit_tiles` gives that plan (`VisitPlan`: visit i < n_first is branch-1 tile first_begin + i,
the rest branch-2 tiles second_begin + (i − n_first)); an empty plan is an empty split."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from stages.common.device import DEFAULT_SM_COUNT

# sm_90a's stated SM count (H100 SXM, H200): the default of the split chooser's `sm_count`; the
# kernels that size a launch by it take the GPU's own count (stages/common/device.py)
SM_COUNT = DEFAULT_SM_COUNT["sm_90a"]
MAX_SPLITS = 128
MANY_EXTRA = 3  # "many" = T + MANY_EXTRA splits: the last MANY_EXTRA are empty


_SHAPE_WORD = re.compile(r"b(\d+)s(\d+)h(\d+)n(\d+)d(\d+)(?:p(\d+))?")


@dataclass(frozen=True)
class DecodeShape:
    """A decode problem: b sequences, s_q tokens, h_q heads of width d, one KV head of n keys in
        n_alloc ≥ n rows; word b{b}s{s_q}h{h_q}n{n}d{d}[p{pad}] (n_alloc = n + pad)."""

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


_BRANCH_WORD = re.compile(r"b(\d+)s(\d+)h(\d+)m(\d+)n(\d+)d(\d+)")


@dataclass(frozen=True)
class BranchShape:
    """A two-branch decode problem (D5): b, s_q, h_q, d, a main branch of n_main keys and an SWA
        branch of n_swa; word b{b}s{s_q}h{h_q}m{n_main}n{n_swa}d{d}."""

    b: int
    s_q: int
    h_q: int
    n_main: int
    n_swa: int
    d: int

    @staticmethod
    def parse(word: str) -> "BranchShape":
        m = _BRANCH_WORD.fullmatch(str(word))
        if not m:
            raise ValueError(f"shape {word!r} is not b<B>s<S>h<H>m<MAIN>n<SWA>d<D>, e.g. b4s2h128m128n256d512")
        vals = [int(x) for x in m.groups()]
        if min(vals) < 1:
            raise ValueError(f"shape {word!r}: every size must be positive")
        return BranchShape(*vals)


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


def _max(a, b):
    """max on Python ints, or on traced integers inside a kernel (cutlass.max)."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    import cutlass

    return cutlass.max(a, b)


def key_limit(capacity: int, fill=None, causal: bool = False, s_q: int = 1, token=0):
    """Leading keys of a branch of `capacity` one token may attend: all (fill None), or min(fill,
        capacity) clamped at 0; `causal` (D4): max(fill − s_q + t + 1, 0).  Ints or traced Int32."""
    if fill is None:
        return capacity
    lim = _min(_max(fill, 0), capacity)
    if causal:
        lim = _max(lim - (s_q - 1) + token, 0)
    return lim


def valid_tiles(limit, block_n: int):
    """Tiles of `block_n` keys that hold at least one of the first `limit` keys."""
    return (limit + (block_n - 1)) // block_n


class VisitPlan(NamedTuple):
    """The KV tiles one CTA visits (see the module doc): n_first branch-1 tiles from
    first_begin, then count − n_first branch-2 tiles from second_begin (branch-local)."""

    count: Any
    n_first: Any
    first_begin: Any
    second_begin: Any

    def tile(self, i):
        """(is_second, branch-local tile) of visit i (ints, or traced with a select)."""
        second = i >= self.n_first
        if isinstance(i, int) and isinstance(self.n_first, int):
            return second, (self.second_begin + i - self.n_first) if second else (self.first_begin + i)
        import cutlass

        return second, cutlass.Int32(cutlass.select_(second, self.second_begin + i - self.n_first, self.first_begin + i))


def visit_tiles(begin, end, tiles_first: int, valid_first, valid_second=None) -> VisitPlan:
    """The plan of a CTA owning static tiles [begin, end) of [0, tiles_first) ++ [tiles_first,
        tiles_first + T₂) whose branches hold valid keys in their first valid_first / valid_second
        tiles (None: no second branch).  One unmasked branch (ints): the range itself."""
    if valid_second is None and isinstance(valid_first, int) and valid_first == tiles_first:
        return VisitPlan(end - begin, end - begin, begin, 0)
    if valid_second is None:
        valid_second = 0
    n_first = _max(_min(end, valid_first) - begin, 0)
    second_begin = _max(begin, tiles_first) - tiles_first
    n_second = _max(_min(end - tiles_first, valid_second) - second_begin, 0)
    return VisitPlan(n_first + n_second, n_first, begin, second_begin)


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

    @property
    def items(self) -> int:
        """Work items of the launch: one per CTA of `grid` (a persistent kernel walks them)."""
        gx, gy, gz = self.grid
        return gx * gy * gz

    def item(self, i) -> DecodeWork:
        """The work of item i (0 … items − 1): that of the CTA `grid` would number i, x fastest
        (so the items that run together read the same KV tiles, as the grid's CTAs do)."""
        gx, gy, _ = self.grid
        return self.work(i % gx, (i // gx) % gy, i // (gx * gy))

    def row_block(self, w: DecodeWork):
        """Index of w's 64-row block in O and Q viewed as [b · s_q · h_q / block_m] blocks of
        rows (rows = (batch, token, head) row-major)."""
        return (w.batch * self.tokens + w.token) * self.head_blocks + w.head_block

    def partial_row_block(self, w: DecodeWork):
        """Index of w's row block in the split partials, [splits · b · s_q · h_q / block_m]
        blocks (split-major)."""
        return w.split * self.row_blocks + self.row_block(w)
