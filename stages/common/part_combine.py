"""The combine of a persistent decode launch (part_scheduler.py): merge the partials of every
sequence a part boundary cut, and leave every other row alone.

Row r (rows (batch, token, head) row-major, `heads` = h_q) belongs to sequence s = r // heads,
cut into n(s) partials in slots 0 … n − 1.  n = 1: untouched (the kernel wrote it).  n > 1:
SplitCombine's math (combine.py) over those slots — empty partials skipped, no key: O = 0,
LSE = +∞, the sink once.  One warp a row, 4 rows a CTA, lane l the d/32 columns from l·d/32
(16-byte loads and stores); every slot's LSE loaded first.  Sequences the attention kernel merged
(`skip_two`) are left alone.  CTA (b, c) of the grid ((P − 1) · heads / 4) takes boundary b + 1
and rows 4c … 4c + 3 of the sequence it cuts (PartGrid.cut_at; other CTAs idle).  Launched with
programmatic dependent launch: its CTAs wait (griddepcontrol.wait) for the attention grid.

`fast` (stage E's default): where every sequence is cut (L < T), CTA (s, c) of S · heads / 4
takes rows 4c … 4c + 3 of sequence s, and a row's slots are read in groups of at most GROUP
(`load_groups`), all a group's loads issued first (predicated, ld.global.cg): 1 +
len(load_groups(n)) L2 round trips a row, not 1 + n."""

from __future__ import annotations

import math
import struct

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from stages.common.combine import LN2, LOG2_E, sink_factor
from stages.common.fp8_epilogue import Fp8Out, store_row_fp8
from stages.common.part_scheduler import PartGrid

GROUP = 8  # slots whose rows one lane has in flight at once (16 fp32 a slot: 128 registers)


def load_groups(capacity: int, group: int = GROUP) -> list[range]:
    """The slots 0 … capacity − 1 in consecutive groups of at most `group`, as even as can be
    (capacity 18: 6, 6, 6 — not 8, 8, 2): the combine issues a group's loads together."""
    if capacity < 1 or group < 1:
        raise ValueError(f"load_groups: capacity and group must be positive, got {capacity}, {group}")
    n = -(-capacity // group)
    out, at = [], 0
    for i in range(n):
        size = capacity // n + (i < capacity % n)
        out.append(range(at, at + size))
        at += size
    return out


@dsl_user_op
def ldcg_or(addr, valid, words: int, fill: float = 0.0, *, loc=None, ip=None) -> tuple[Float32, ...]:
    """`words` (1, 2 or 4) fp32 at global `addr` (aligned to 4 · words) through L2 (ld.global.cg)
        when `valid`, else `fill`, nothing read: a predicated load, so a group's loads fly together."""
    outs = ", ".join(f"${i}" for i in range(words))
    operand = outs if words == 1 else "{" + outs + "}"
    bits = f"0f{struct.unpack('<I', struct.pack('<f', fill))[0]:08X}"
    asm = ("{\n.reg .pred p;\n"
           f"setp.ne.b32 p, ${words + 1}, 0;\n"
           + "".join(f"mov.f32 ${i}, {bits};\n" for i in range(words))
           + f"@p ld.global.cg{'' if words == 1 else f'.v{words}'}.f32 {operand}, [${words}];\n}}")
    res_type = T.f32() if words == 1 else llvm.StructType.get_literal([T.f32()] * words)
    res = llvm.inline_asm(
        res_type,
        [Int64(addr).ir_value(loc=loc, ip=ip), Int32(cutlass.select_(valid, Int32(1), Int32(0))).ir_value(loc=loc, ip=ip)],
        asm, ",".join(["=f"] * words + ["l", "r"]), has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    if words == 1:
        return (Float32(res),)
    return tuple(Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(words))


class PartCombine:
    """GPU combine for a part schedule (T = `num_tiles` a sequence, parts of L = `part_tiles`): o_part
        (capacity · rows, d) fp32 slot-major, lse_part, o (rows, d), lse (rows,), sink [heads] (−∞: none)."""

    ROWS_PER_CTA = 4
    THREADS = 32 * ROWS_PER_CTA

    def __init__(self, grid: PartGrid, heads: int, d: int, skip_two: bool = False, fast: bool = False,
                 group: int = GROUP, fp8: bool = False):
        rows = grid.sequences * heads
        # fp8: a merged row leaves through stage E's fused FP8 epilogue (stages/common/
        # fp8_epilogue.py: inverse RoPE, e4m3 and a UE8M0 exponent a 128 values), not as `o`
        self.fp8 = fp8
        if fp8 and (d != 512 or heads % 8):
            raise ValueError(f"PartCombine: the FP8 epilogue takes d 512 and heads a multiple of 8, got {d}, {heads}")
        if heads % self.ROWS_PER_CTA or d % 32:
            raise ValueError(f"PartCombine: heads ({heads}) must be a multiple of {self.ROWS_PER_CTA}, d ({d}) of 32")
        self.grid = grid
        self.rows, self.heads, self.d = rows, heads, d
        self.chunks = heads // self.ROWS_PER_CTA  # CTAs a sequence
        self.skip_two = skip_two  # the attention kernel merged every two-piece sequence itself
        # fast (docs/STAGE_E.md): a CTA per (sequence, 4 rows) where parts shorter than a sequence
        # cut every sequence, none idle; a row's slots loaded in groups, each group's loads issued
        # together (predicated ld.global.cg) — 1 + len(load_groups(n)) L2 round trips, not 1 + n
        self.fast = fast
        if fast and (d // 32) % 4:
            raise ValueError(f"PartCombine: a lane's d/32 columns ({d // 32}) must be whole 16-byte loads")
        self.groups = [tuple(g) for g in load_groups(grid.capacity, group)]
        self.every_cut = fast and grid.part_tiles < grid.num_tiles

    @property
    def ctas(self) -> int:
        """The launch's CTAs: every sequence's chunks where every sequence is cut, else every
        part boundary's (each names at most one cut sequence)."""
        return (self.grid.sequences if self.every_cut else max(self.grid.parts - 1, 1)) * self.chunks

    def cta_sequence(self, bidx):
        """(sequence, whether CTA `bidx` combines rows of it).  Ints or traced."""
        if self.every_cut:
            return bidx // self.chunks, bidx >= 0  # True (an int or a traced Boolean)
        return self.grid.cut_at(bidx // self.chunks + 1)

    def launch(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, sink: cute.Tensor,
               stream, fp8_args=None):
        """Call from a @cute.jit host function, after the attention kernel on the same stream.
        `fp8_args` (with fp8): (O_fp8, O_scale, cos_sin_cache, positions, sin_sign)."""
        o8, osc, cs, pos, self.sin_sign = fp8_args if self.fp8 else (None, None, None, None, 1.0)  # bf16: no parameters
        self.kernel(o_part, lse_part, o, lse, sink, o8, osc, cs, pos).launch(
            grid=(self.ctas, 1, 1), block=(self.THREADS, 1, 1), stream=stream, use_pdl=True,
        )

    @cute.kernel
    def kernel(self, o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor, lse: cute.Tensor, sink: cute.Tensor,
               o8: cute.Tensor | None, osc: cute.Tensor | None, cos_sin: cute.Tensor | None,
               positions: cute.Tensor | None):
        rows, cols, cap = self.rows, self.d // 32, self.grid.capacity
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        s, mine = self.cta_sequence(bidx)
        row = s * self.heads + (bidx % self.chunks) * self.ROWS_PER_CTA + tidx // 32
        n = self.grid.pieces(s)  # > 1 where `mine`: the boundary cuts s
        if cutlass.const_expr(self.skip_two):
            mine = mine & (n > 2)
        cute.arch.griddepcontrol_wait()  # the attention grid is complete, its partials visible
        if mine:
            # every slot's LSE at once (n ≤ capacity; slots past n are never read)
            lses = cute.make_rmem_tensor(cap, Float32)
            m = -Float32.inf
            if cutlass.const_expr(self.fast):
                lse_at = lse_part.iterator.toint() + cutlass.Int64(row) * 4
                for j in cutlass.range_constexpr(cap):
                    lses[j] = ldcg_or(lse_at + cutlass.Int64(j * rows) * 4, j < n, 1, -math.inf)[0]
                    m = cute.arch.fmax(m, lses[j])
            else:
                for j in cutlass.range_constexpr(cap):
                    lses[j] = -Float32.inf
                    if j < n:
                        lses[j] = lse_part[j * rows + row]
                    m = cute.arch.fmax(m, lses[j])
            acc = cute.make_rmem_tensor(cols, Float32)
            acc.fill(0.0)
            total = Float32(0.0)
            if cutlass.const_expr(self.fast):
                total = self.add_groups(o_part, row, lane, lses, m, acc)
            else:
                for j in cutlass.range_constexpr(cap):
                    if lses[j] != -Float32.inf:  # an empty partial (or a slot past n) is skipped, never read
                        w = cute.math.exp2((lses[j] - m) * LOG2_E, fastmath=True)
                        total = total + w
                        vals = cute.make_rmem_tensor(cols, Float32)
                        at = o_part.iterator.toint() + cutlass.Int64(j * rows + row) * (self.d * 4) + lane * (cols * 4)
                        cute.autovec_copy(cute.make_tensor(cute.make_ptr(Float32, at, cute.AddressSpace.gmem,
                                                                         assumed_align=16),
                                                           cute.make_layout(cols)), vals)
                        for k in cutlass.range_constexpr(cols):
                            acc[k] = acc[k] + w * vals[k]
            lonely = total == 0.0
            inv = 0.0 if lonely else cute.arch.rcp_approx(total)
            row_lse = -Float32.inf if lonely else m + cute.math.log2(total, fastmath=True) * LN2
            inv = inv * sink_factor(sink[row % self.heads], row_lse)
            if cutlass.const_expr(self.fp8):
                for k in cutlass.range_constexpr(cols):
                    acc[k] = acc[k] * inv
                cs = cute.make_tensor(cos_sin.iterator, cute.make_layout(cute.size(cos_sin)))
                store_row_fp8(acc, lane, row, Fp8Out(o8, osc, cs, positions, self.heads,
                                                     self.rows // self.heads, self.sin_sign))
            else:
                out = cute.make_rmem_tensor(cols, o.element_type)
                for k in cutlass.range_constexpr(cols):
                    out[k] = (acc[k] * inv).to(o.element_type)
                size = o.element_type.width // 8
                at = o.iterator.toint() + cutlass.Int64(row) * (self.d * size) + lane * (cols * size)
                cute.autovec_copy(out, cute.make_tensor(cute.make_ptr(o.element_type, at, cute.AddressSpace.gmem,
                                                                      assumed_align=16), cute.make_layout(cols)))
            if lane == 0:
                lse[row] = Float32.inf if lonely else row_lse

    @cute.jit
    def add_groups(self, o_part, row, lane, lses, m, acc) -> Float32:
        """`fast`: acc += Σ_j e^(lse_j − m) · O_j over the row's live slots (this lane's columns),
        a group of slots' loads issued before any is used (load_groups); returns Σ_j e^(lse_j − m)."""
        rows, cols = self.rows, self.d // 32
        total = Float32(0.0)
        row_at = o_part.iterator.toint() + cutlass.Int64(row) * (self.d * 4) + lane * (cols * 4)
        for group in cutlass.range_constexpr(len(self.groups)):
            slots = self.groups[group]
            # every load of the group first (an empty partial, or a slot past n: predicated off,
            # zeros, never read), then the sums
            vals = cute.make_rmem_tensor((len(slots), cols), Float32)
            for i in cutlass.range_constexpr(len(slots)):
                at = row_at + cutlass.Int64(slots[i] * rows) * (self.d * 4)
                for v in cutlass.range_constexpr(cols // 4):
                    got = ldcg_or(at + 16 * v, lses[slots[i]] != -Float32.inf, 4)
                    for e in cutlass.range_constexpr(4):
                        vals[i, 4 * v + e] = got[e]
            for i in cutlass.range_constexpr(len(slots)):
                j = slots[i]
                if lses[j] != -Float32.inf:  # an empty partial is skipped (its zeros never weighed)
                    w = cute.math.exp2((lses[j] - m) * LOG2_E, fastmath=True)
                    total = total + w
                    for k in cutlass.range_constexpr(cols):
                        acc[k] = acc[k] + w * vals[i, k]
        return total
