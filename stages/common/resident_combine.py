"""The combine of a persistent decode launch done inside the attention kernel, for sequences of
any number of pieces, while the whole grid is resident (stage E sm90's `resident_combine`
option; issue 30, docs/STAGE_E.md "The timeline at b = 2": PartCombine's launch and its chain
after the attention kernel were ~4 µs of b 2's ~17).

Who combines.  Sequence s is cut into n(s) pieces (PartGrid.pieces), piece j the segment whose
partial fills slot j of the scratch (stages/common/part_scheduler.py).  Every piece of a cut
sequence, after storing its partial (normalised fp32 O_j and lse_j, as for PartCombine), ARRIVES
on its row block's counter, WAITS until all n pieces have arrived, and then combines a share of
the row block's 64 rows: piece j takes rows j, j + n, j + 2n, … (`share_rows` of them,
`share_row` the i-th) — every row exactly once over j = 0 … n − 1 (tests/test_resident_combine.py).
A row is one warp's (lane l the d/32 contiguous columns from l·d/32, 16-byte loads through L2),
SplitCombine's math over slots 0 … n − 1 (stages/common/combine.py, PartCombine's `fast` form:
every slot's LSE at once, then the rows in groups of GROUP slots, each group's loads issued
before any is used; an empty partial, lse = −∞, never read; no key in any piece: O = 0,
LSE = +∞; the sink's factor on the merged row), O written in bf16 and the final LSE.
PartCombine is not launched: every cut sequence of such a grid is combined here.

The counter.  One 32-bit word a row block of a cut sequence: the final LSE of the row block's
row 0 (`counter_index`), which nothing else writes before the combine's end — so it needs no
scratch (the harness's scratch has no word to spare where the pieces fill every slot).  The
output holds anything on entry, so `ZeroCounters`, a launch just before the attention kernel,
clears the counters; the attention kernel is launched with programmatic dependent launch and
its counting thread waits for that launch (griddepcontrol.wait) before it touches a counter —
the pattern of part_merge.ZeroFlags.  The release/acquire chain is a split-K semaphore's: a
piece's MMA threads issue their partial's stores, meet at a named barrier, and one thread adds
1 (`arrive`: red.release.gpu); it spins with ld.acquire.gpu until the count is n (`wait_count`),
adds 1 again (`depart`: it has seen n) and a named barrier lets the others read the partials —
through L2 (ld.global.cg; never the non-coherent path).  The word's final LSE overwrites the
count, so the lane that writes row 0's LSE (piece 0's, which also counted) first waits until the
count is 2n: every piece has seen n, and no one reads the word again.

Deadlock.  A piece arrives before it waits, and waits only for pieces of its own sequence.
Piece j of s is its part's first segment (j ≥ 1) or last (j = 0), and the segments of a part
before it belong to sequences < s; so by induction on s — every piece of the sequences before s
has arrived, waited and combined — every piece of s arrives, and the waits of s end.  That needs
every part running at once: the combine is used only when every CTA of the grid is resident
(parts · head blocks ≤ the SM count, one CTA a SM: `resident_combines`, the condition of
part_merge.merges_in_kernel); a larger grid keeps the separate PartCombine.  The 2n wait needs
only the departures, which follow the arrivals with no other wait.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from stages.common.combine import LN2, LOG2_E, sink_factor
from stages.common.hang_guard import BUDGET_NS
from stages.common.part_combine import ldcg_or, load_groups
from stages.common.part_scheduler import PartGrid

# slots whose rows a lane has in flight at once (16 fp32 a slot: 80 registers; the MMA warpgroups
# hold 160–192): 9 slots in two groups; 9 at once spilled 460 bytes (b 2 s2 h128, ptxas)
GROUP = 5


def resident_combines(grid: PartGrid, sm_count: int) -> bool:
    """Whether a launch combines its cut sequences itself: some sequence is cut and every CTA of
    the grid is resident at once (parts · head blocks ≤ sm_count; see the module doc)."""
    return grid.parts * grid.head_blocks <= sm_count and grid.cut > 0


def share_rows(piece, n, rows: int = 64):
    """How many of a row block's `rows` rows piece `piece` of `n` combines: rows piece, piece + n,
    … below `rows` (0 where piece ≥ rows).  Ints or traced Int32s (only +, −, //)."""
    return (rows - piece + n - 1) // n


def share_row(piece, n, i):
    """The row of piece `piece` of `n`'s i-th share (i < share_rows(piece, n)).  Ints or traced."""
    return piece + i * n


def counter_index(row_block, rows_per_block: int):
    """Row block `row_block`'s counter: the index of its row 0 in the final LSE seen in row order."""
    return row_block * rows_per_block


def counter_address(lse_base, row_block, rows_per_block: int):
    """The global byte address of row block `row_block`'s counter (`lse_base`: the byte address of
    the final LSE)."""
    return lse_base + Int64(counter_index(row_block, rows_per_block)) * 4


def _asm(args, text: str, constraints: str, loc=None, ip=None):
    llvm.inline_asm(None, args, text, constraints, has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def arrive(addr, *, loc=None, ip=None) -> None:
    """count += 1 at global byte address `addr`, a release at GPU scope (every write this thread
    saw — through a barrier, the other threads' — is visible to whoever acquires the count)."""
    _asm([Int64(addr).ir_value(loc=loc, ip=ip)], "red.release.gpu.global.add.u32 [$0], 1;", "l", loc, ip)


@dsl_user_op
def depart(addr, *, loc=None, ip=None) -> None:
    """count += 1 at `addr`, after this thread's wait_count saw the arrivals (relaxed: it only says
    that this thread will not read the word again)."""
    _asm([Int64(addr).ir_value(loc=loc, ip=ip)], "red.relaxed.gpu.global.add.u32 [$0], 1;", "l", loc, ip)


@dsl_user_op
def wait_count(addr, target, *, loc=None, ip=None) -> None:
    """Spin until the count at global byte address `addr` is at least `target` (an acquire at GPU
    scope).  Bounded: past hang_guard.BUDGET_NS (%globaltimer) it traps — a count that never comes
    (a bug, or a grid not resident after all) ends as the launch's CUDA error, not a hang; a correct
    kernel waits microseconds."""
    _asm([Int64(addr).ir_value(loc=loc, ip=ip), Int32(target).ir_value(loc=loc, ip=ip)],
         "{\n.reg .pred p;\n.reg .b32 v;\n.reg .u64 t0, t;\nmov.u64 t0, %globaltimer;\nWAIT_COUNT:\n"
         "ld.acquire.gpu.global.b32 v, [$0];\nsetp.ge.u32 p, v, $1;\n@p bra WAIT_COUNT_DONE;\n"
         "mov.u64 t, %globaltimer;\nsub.u64 t, t, t0;\n"
         f"setp.gt.u64 p, t, {BUDGET_NS};\n@p trap;\nbra WAIT_COUNT;\nWAIT_COUNT_DONE:\n}}", "l,r", loc, ip)


@cute.jit
def combine_row(o_row, lse_row, slot_o_bytes: cutlass.Constexpr[int], slot_lse_bytes: cutlass.Constexpr[int], n,
                cap: cutlass.Constexpr[int], d: cutlass.Constexpr[int], lane, sink_h, out_row,
                out_type: cutlass.Constexpr, group: cutlass.Constexpr[int] = GROUP):
    """One warp, one row: SplitCombine's math over slots 0 … n − 1 (n ≤ cap) of the row's
    partials — slot j's O row at byte address o_row + j · slot_o_bytes, its LSE at lse_row + j ·
    slot_lse_bytes —, O (`out_type`) stored at byte address `out_row` (this lane's d/32 columns);
    returns the row's final LSE (+∞ where no piece had a key).  `group`: slots whose loads fly
    together (load_groups)."""
    cols = d // 32
    lses = cute.make_rmem_tensor(cap, Float32)
    m = -Float32.inf
    for j in cutlass.range_constexpr(cap):
        lses[j] = ldcg_or(lse_row + Int64(j * slot_lse_bytes), j < n, 1, -math.inf)[0]
        m = cute.arch.fmax(m, lses[j])
    acc = cute.make_rmem_tensor(cols, Float32)
    acc.fill(0.0)
    total = Float32(0.0)
    at = o_row + Int64(lane * (cols * 4))
    groups = [tuple(g) for g in load_groups(cap, group)]
    for gi in cutlass.range_constexpr(len(groups)):
        slots = groups[gi]
        vals = cute.make_rmem_tensor((len(slots), cols), Float32)
        for i in cutlass.range_constexpr(len(slots)):  # every load of the group first
            for v in cutlass.range_constexpr(cols // 4):
                got = ldcg_or(at + Int64(slots[i] * slot_o_bytes + 16 * v), lses[slots[i]] != -Float32.inf, 4)
                for e in cutlass.range_constexpr(4):
                    vals[i, 4 * v + e] = got[e]
        for i in cutlass.range_constexpr(len(slots)):
            if lses[slots[i]] != -Float32.inf:  # an empty partial (or a slot past n) is skipped
                w = cute.math.exp2((lses[slots[i]] - m) * LOG2_E, fastmath=True)
                total = total + w
                for k in cutlass.range_constexpr(cols):
                    acc[k] = acc[k] + w * vals[i, k]
    lonely = total == 0.0
    inv = 0.0 if lonely else cute.arch.rcp_approx(total)
    row_lse = -Float32.inf if lonely else m + cute.math.log2(total, fastmath=True) * LN2
    inv = inv * sink_factor(sink_h, row_lse)
    out = cute.make_rmem_tensor(cols, out_type)
    for k in cutlass.range_constexpr(cols):
        out[k] = (acc[k] * inv).to(out_type)
    size = out_type.width // 8
    cute.autovec_copy(out, cute.make_tensor(cute.make_ptr(out_type, out_row + Int64(lane * (cols * size)),
                                                          cute.AddressSpace.gmem, assumed_align=16),
                                            cute.make_layout(cols)))
    return Float32.inf if lonely else row_lse


class ZeroCounters:
    """Clears the counter of every row block of a cut sequence (one 32-bit word a row block, the
    final LSE of its row 0); launched just before the attention kernel, which waits for it
    (griddepcontrol.wait) only where it touches a counter."""

    THREADS = 128

    def __init__(self, grid: PartGrid, rows_per_block: int, early: bool = False):
        # early: griddepcontrol.launch_dependents at its start, so that the attention kernel
        # launches at once instead of after it (its counting threads still wait for it)
        self.grid, self.rows_per_block, self.early = grid, rows_per_block, early

    def launch(self, lse: cute.Tensor, stream):
        """Call from a @cute.jit host function, before the attention kernel on the same stream;
        `lse` the final LSE, indexed in row order."""
        blocks = self.grid.row_blocks
        self.kernel(lse).launch(grid=((blocks + self.THREADS - 1) // self.THREADS, 1, 1),
                                block=(self.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, lse: cute.Tensor):
        if cutlass.const_expr(self.early):
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rb = bidx * self.THREADS + tidx
        if rb < self.grid.row_blocks:
            if self.grid.pieces(rb // self.grid.head_blocks) > 1:
                lse[counter_index(rb, self.rows_per_block)] = Float32(0.0)  # bits 0: no piece arrived
