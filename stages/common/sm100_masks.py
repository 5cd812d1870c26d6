"""Key masks of the Blackwell (sm_100a) decode rungs D3–D5 for the sm100 house's KV-once ring.
The rule is stages/common/masks.py's (a KEY LIMIT; only the BOUNDARY tile, rem = limit − its
first key < 64, needs the two steps); on sm100:

    mask_row_scores   softmax threads: thread t owns row t whole, so S[t, j] ← −∞ for every
                      key column j ≥ rem of ITS row's limit (D4: two tokens of a 128-row block
                      differ), by a select before the row max.  The register → key column map
                      is a trace-time constant (row_key_columns, proven for all 128 threads).
                      It runs on every visited tile (a runtime `if` cost registers).
    clean_v_rows      MMA warp, on a boundary tile's V chunk after its TMA landed: key rows ≥
                      rem (from the FILL level: rows below it past a causal limit are finite,
                      P = 0) ← 0 by the warp's 32 lanes, fence.proxy.async and a warp barrier
                      before the MMA (0 · NaN = NaN).  A K-only chunk is not cleaned: its NaN
                      scores are selected away.

The ring's key rows are 128-byte LINES: a K-major 128-byte-swizzled chunk stores key k,
columns 64a … 64a + 63 in line 64a + k (the swizzle permutes 16-byte pieces inside a line).
`line_view` addresses every element inside its true line, all zeroing rows needs;
`check_lines` proves it at trace time over every (key, column) of a slot, swizzle applied."""

from __future__ import annotations

import re

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from stages.common.masks import zero_kv_rows
from stages.common.sm100_idioms import fragment_coords

LINE = 64  # bf16 elements in a 128-byte line


def swizzle_bytes(swizzle):
    """A swizzle S<B, M, S> on the byte address: x ↦ x ^ ((x & yyy) >> S), yyy = (2^B − 1) << (M + S);
        S<3,4,3> permutes a 128-byte line's 16-byte pieces by the line's index mod 8."""
    m = re.search(r"S<\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*>", str(swizzle))
    if not m:
        raise ValueError(f"KV lines: cannot read the swizzle {swizzle}")
    b, base, shift = (int(x) for x in m.groups())
    yyy = ((1 << b) - 1) << (base + shift)
    return lambda x: x ^ ((x & yyy) >> shift)


def check_lines(k_smem, k_coords, keys: int, chunk: int, elem_bytes: int = 2) -> int:
    """Trace-time proof that element (key, col) of a ring slot (`k_smem`, swizzle applied to the byte
        address; `k_coords` partitioned like the B operand) lies in line (col // 64) · keys + key.
        Returns the elements checked; ValueError names the first outside."""
    one = cute.select(k_smem.outer, mode=[0, 1, 2])
    swz = swizzle_bytes(k_smem.inner)
    n = cute.size(k_coords)
    if n != keys * chunk:
        raise ValueError(f"KV lines: a slot holds {n} elements, expected {keys} × {chunk}")
    line_bytes = LINE * elem_bytes
    coords = fragment_coords(k_coords)
    for i in range(n):
        key, col = coords[i]
        want = (col // LINE) * keys + key
        at = swz(one(i) * elem_bytes)
        if at // line_bytes != want:
            raise ValueError(f"KV lines: key {key}, column {col} is at byte {at}, outside line {want}")
    return n


def line_view(ring: cute.Tensor, keys: int, chunk: int, slots: int, slot_elems: int) -> cute.Tensor:
    """(key, col, slot) view of the ring's storage (`ring`: its first element, any layout)
    that puts (key, col) in line (col // 64) · keys + key of its slot (see check_lines)."""
    blocks = chunk // LINE if chunk >= LINE else 1
    width = min(chunk, LINE)
    layout = cute.make_layout((keys, (width, blocks), slots), stride=(LINE, (1, LINE * keys), slot_elems))
    return cute.make_tensor(ring.iterator, layout)


def row_key_columns(s_load, cS, threads: int = 128) -> tuple:
    """The key column of each register of a thread's tcgen05.ld fragment of S, as Python ints, proven
        the same for all `threads` threads (32x32b: thread t row t), so the mask compares `rem` with
        constants."""
    cols = None
    for t in range(threads):
        coords = fragment_coords(s_load.get_slice(t).partition_D(cS), t == 0)
        if any(r != t for r, _ in coords):
            raise ValueError(f"S load: thread {t} holds a register of another row")
        mine = tuple(c for _, c in coords)
        if cols is None:
            cols = mine
        elif mine != cols:
            raise ValueError(f"S load: thread {t}'s registers hold other key columns than thread 0's")
    return cols


@cute.jit
def mask_row_scores(rS: cute.Tensor, cols: cutlass.Constexpr, rem) -> None:
    """rS[i] ← −∞ where register i's key column cols[i] (row_key_columns) is ≥ rem."""
    for i in cutlass.range_constexpr(cute.size(rS)):
        rS[i] = -Float32.inf if cols[i] >= rem else rS[i]


@cute.jit
def clean_v_rows(lines: cute.Tensor, slot, rem) -> None:
    """The calling warp zeroes key rows rem … 63 of ring slot `slot` (`lines`: line_view),
    fences the writes for the async proxy and meets at a warp barrier."""
    zero_kv_rows(lines[None, None, slot], rem, cute.arch.lane_idx(), 32)
    cute.arch.fence_view_async_shared()
    cute.arch.sync_warp()
