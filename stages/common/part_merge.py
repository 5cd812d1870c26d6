"""A sequence cut into two pieces, merged inside the attention kernel (persistent parts,
stages/common/part_scheduler.py) instead of by a combine launch.

Who merges.  A sequence s that one part boundary cuts (n(s) = 2) is piece 0 at the END of part p
(its last segment, slot 0) and piece 1 at the START of part p + 1 (its first segment, slot 1).
Part p + 1 finishes piece 1 after a few tiles; part p reaches piece 0 last.  So piece 1 leaves a
partial (O₁ normalised, fp32, and lse₁ in slot 1 of the scratch) and raises the sequence's
flag; piece 0 — still in registers as acc₀ = Σ e^(s − m₀)·v with row sum ℓ₀ and lse₀ — waits
for the flag (in practice long raised), reads the partial and writes O and LSE itself:

    M = max(lse₀, lse₁),   eₖ = e^(lseₖ − M) (0 where lseₖ = −∞),   E = e₀ + e₁
    O = acc₀ · e₀ / (E · ℓ₀) + O₁ · e₁ / E,   LSE = M + ln E
    · the sink's factor 1 / (1 + e^(sink − LSE)) on both terms; E = 0 (no key in either piece):
      O = 0, LSE = +∞

— SplitCombine's math over two slots (stages/common/combine.py).  Sequences of three or more
pieces are left to PartCombine.

The flag.  One 32-bit word a row block: the first LSE of the row block's slot 0 (unwritten for a
two-piece sequence).  `ZeroFlags`, a launch of its own just before the attention kernel, clears
the flags; the attention kernel (programmatic dependent launch) waits for it
(griddepcontrol.wait) only before it touches a flag.  The hand-over is the
release/acquire pattern of a split-K semaphore: piece 1's MMA threads store the partial, meet at
a named barrier, and one thread `st.release.gpu`s the flag; piece 0's one thread spins with
`ld.acquire.gpu` until it is nonzero, then a named barrier lets the others read the partial —
through L2 (`ld.global.cg`, `cp.async.cg`; never the incoherent read-only path).  The merging
CTA stages the 128 KB partial block in the idle KV slots' shared memory by cp.asyncs and adds
it from there.

Deadlock: a flag is raised after a part's first segment, which waits on no flag, and a CTA
waits only for a later part's first segment; the merge is used only when every CTA of the
grid is resident at once (parts · head blocks ≤ the SM count), so that segment always runs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from stages.common.combine import LOG2_E, LN2, sink_factor
from stages.common.part_scheduler import PartGrid


def merges_in_kernel(grid: PartGrid, sm_count: int) -> bool:
    """Whether a launch merges its two-piece sequences itself: some sequence has two pieces and
    the whole grid is resident at once (see the module doc)."""
    return grid.parts * grid.head_blocks <= sm_count and any(grid.pieces(s) == 2 for s in range(grid.sequences))


def _asm(res_type, args, text: str, constraints: str, side_effects: bool, loc=None, ip=None):
    return llvm.inline_asm(res_type, args, text, constraints, has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def raise_flag(addr, *, loc=None, ip=None) -> None:
    """flag = 1 at global byte address `addr`, a release at GPU scope (every write this thread
    saw — through a barrier, the other threads' — is visible to whoever acquires the flag)."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)], "st.release.gpu.global.b32 [$0], 1;", "l", True, loc, ip)


@dsl_user_op
def wait_flag(addr, *, loc=None, ip=None) -> None:
    """Spin until the flag at global byte address `addr` is nonzero (an acquire at GPU scope)."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)],
         "{\n.reg .pred p;\n.reg .b32 v;\nWAIT_FLAG:\nld.acquire.gpu.global.b32 v, [$0];\n"
         "setp.eq.b32 p, v, 0;\n@p bra WAIT_FLAG;\n}", "l", True, loc, ip)


@dsl_user_op
def load_l2(addr, *, loc=None, ip=None) -> Float32:
    """One fp32 at global byte address `addr`, from L2 (ld.global.cg)."""
    return Float32(_asm(T.f32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.f32 $0, [$1];", "=f,l", True,
                        loc, ip))


@dsl_user_op
def copy16_async(smem_addr, gmem_addr, *, loc=None, ip=None) -> None:
    """cp.async.cg: 16 bytes from global `gmem_addr` (through L2) to shared `smem_addr`."""
    _asm(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
         "cp.async.cg.shared.global [$0], [$1], 16;", "r,l", True, loc, ip)


@dsl_user_op
def copies_done(*, loc=None, ip=None) -> None:
    """This thread's cp.asyncs have landed (cp.async.wait_all)."""
    _asm(None, [], "cp.async.wait_all;", "", True, loc, ip)


@dsl_user_op
def load_smem_pair(smem_addr, offset: int = 0, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """Two fp32 at the 8-byte aligned shared address `smem_addr` + `offset` (a constant, in the
    instruction)."""
    res = _asm(llvm.StructType.get_literal([T.f32(), T.f32()]), [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
               f"ld.shared.v2.f32 {{$0, $1}}, [$2+{int(offset)}];", "=f,=f,r", True, loc, ip)
    return (Float32(llvm.extractvalue(T.f32(), res, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(T.f32(), res, [1], loc=loc, ip=ip)))


@cute.jit
def merge_factors(inv_sum0: Float32, lse0: Float32, lse1: Float32, sink: Float32):
    """(factor on acc₀, factor on O₁, the row's natural-log LSE — −∞ for no key) of the module
    doc, the sink's factor included; `inv_sum0` = 1/ℓ₀ (0 where ℓ₀ = 0)."""
    m = cute.arch.fmax(lse0, lse1)
    e0 = Float32(0.0)
    e1 = Float32(0.0)
    if lse0 != -Float32.inf:
        e0 = cute.math.exp2((lse0 - m) * LOG2_E, fastmath=True)
    if lse1 != -Float32.inf:
        e1 = cute.math.exp2((lse1 - m) * LOG2_E, fastmath=True)
    total = e0 + e1
    lonely = total == 0.0
    inv = Float32(0.0) if lonely else cute.arch.rcp_approx(total)
    lse = -Float32.inf if lonely else m + cute.math.log2(total, fastmath=True) * LN2
    inv = inv * sink_factor(sink, lse)
    return e0 * inv * inv_sum0, e1 * inv, lse


UNIT = 32  # bytes: the swizzle's unit in a staged partial row (8 fp32, one accumulator column group)


def staged_offset(row: int, byte: int, row_bytes: int) -> int:
    """Shared-memory offset of byte `byte` of row `row` of a partial block: rows of `row_bytes`, the
        32-byte units of a row XOR-permuted by row mod 8, so the 8 rows one accumulator load reads
        fall on distinct banks (two wavefronts for 256 bytes).  Ints or traced Int32s."""
    return row * row_bytes + (((byte // UNIT) ^ (row % 8)) * UNIT) + byte % UNIT


def staged_copies(tidx, threads: int, rows: int, row_bytes: int) -> list:
    """(source offset, shared offset) of each 16-byte copy thread `tidx` of `threads` makes of a
        `rows` × `row_bytes` block: copy c = tidx + k · threads, row-major in the source,
        staged_offset's layout in shared memory.  Ints or traced Int32s."""
    per_row = row_bytes // 16
    out = []
    for k in range(rows * per_row // threads):
        c = tidx + k * threads
        out.append((c * 16, staged_offset(c // per_row, (c % per_row) * 16, row_bytes)))
    return out


@cute.jit
def stage_partial(tidx, threads: cutlass.Constexpr[int], src_addr, smem_base, rows: cutlass.Constexpr[int],
                  row_bytes: cutlass.Constexpr[int]) -> None:
    """Copy the fp32 partial block at `src_addr` into shared memory at `smem_base` (staged_offset's
        layout) by 16-byte cp.asyncs through L2, `threads` sharing them; waits for this thread's
        own (a barrier must follow)."""
    for src, dst in staged_copies(tidx, threads, rows, row_bytes):
        copy16_async(smem_base + dst, src_addr + Int64(src))
    copies_done()


def staged_read_bases(tidx, row_bytes: int, col0: int) -> list:
    """The 8 shared offsets of add_staged_rows' thread `tidx`: entry k serves the groups g ≡ k mod 8,
        whose units col0/8 + g XOR r8 = l//4 differ only in their low 3 bits.  Ints or traced."""
    lane = tidx % 32
    r8 = lane // 4
    base = ((tidx % 128) // 32 * 16 + r8) * row_bytes + (col0 // 8) * UNIT + 8 * (lane % 4)
    return [base + (k ^ r8) * UNIT for k in range(8)]


def staged_read_offset(h: int, g: int, row_bytes: int) -> int:
    """The constant part of the offset of (row half h, group g): added to staged_read_bases()[g % 8]."""
    return 8 * h * row_bytes + (g - g % 8) * UNIT


@cute.jit
def add_staged_rows(acc: cute.Tensor, tidx, smem_base, row_bytes: cutlass.Constexpr[int], col0: cutlass.Constexpr[int],
                    f_lo: Float32, f_hi: Float32) -> None:
    """acc += f · the staged partial at the accumulator's own coordinates (quad_store.py: register
        i = e + 2·h + 4·g is row 16·w + l//4 + 8·h, column col0 + 8·g + 2·(l%4) + e); f_lo for h = 0,
        f_hi for h = 1.  A (row, group)'s two columns are one 8-byte load at
        staged_read_bases()[g % 8] + staged_read_offset(h, g)."""
    bases = [smem_base + off for off in staged_read_bases(tidx, row_bytes, col0)]
    for h in cutlass.range_constexpr(2):
        f = f_lo if cutlass.const_expr(h == 0) else f_hi
        for g in cutlass.range_constexpr(cute.size(acc) // 4):
            a, b = load_smem_pair(bases[g % 8], staged_read_offset(h, g, row_bytes))
            acc[4 * g + 2 * h] = acc[4 * g + 2 * h] + f * a
            acc[4 * g + 2 * h + 1] = acc[4 * g + 2 * h + 1] + f * b


class ZeroFlags:
    """Clears the flag of every row block of a two-piece sequence (the first LSE of slot 0 of
        lse_part); launched just before the attention kernel, which waits for it
        (griddepcontrol.wait) only where it touches a flag."""

    THREADS = 128

    def __init__(self, grid: PartGrid, rows_per_block: int):
        self.grid, self.rows_per_block = grid, rows_per_block

    def launch(self, lse_part: cute.Tensor, stream):
        """Call from a @cute.jit host function, before the attention kernel on the same stream;
        `lse_part` the scratch's LSEs as one mode (capacity · rows)."""
        blocks = self.grid.row_blocks
        self.kernel(lse_part).launch(grid=((blocks + self.THREADS - 1) // self.THREADS, 1, 1),
                                     block=(self.THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, lse_part: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        rb = bidx * self.THREADS + tidx
        if rb < self.grid.row_blocks:
            if self.grid.pieces(rb // self.grid.head_blocks) == 2:
                lse_part[flag_index(rb, self.rows_per_block)] = Float32(0.0)  # bits 0: the flag down


def flag_index(row_block, rows_per_block: int):
    """Row block `row_block`'s flag: the index of its first LSE in slot 0 of the scratch's LSEs."""
    return row_block * rows_per_block


def flag_address(lse_part_base, row_block, rows_per_block: int):
    """The global byte address of row block `row_block`'s flag (`lse_part_base`: the byte address
    of the scratch's LSEs, slot 0 first)."""
    return lse_part_base + Int64(flag_index(row_block, rows_per_block)) * 4

