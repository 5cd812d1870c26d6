"""e4m3 → bf16 on Hopper's CUDA cores by moving bits, then one exact power-of-two scaling.

sm_90 has no e4m3 → bf16 conversion (cvt goes e4m3x2 → f16x2; to reach bf16 from there takes
f16 → f32 → bf16: 3 instructions a pair, plus the scale multiply in fp32).  Here, per 4 values
(one 32-bit word of e4m3 bytes b0 … b3):

    PRMT       each 16-bit half gets one byte and a copy of its sign bit above it:
               selector 0x9180 → halves (b0, b1), 0xB3A2 → (b2, b3)      [s…s | s eeee mmm]
    SHL 4      eeee mmm moves to bits 4 … 10, a sign copy to bit 15
    AND        0x87F0 per half keeps exactly those: the bf16 s eeee mmm0000, whose value is the
               e4m3's × 2^−120 (bf16's exponent bias is 127, e4m3's is 7; an e4m3 subnormal
               0 0000 mmm lands on the bf16 subnormal with the same factor: m/8 · 2^−126)
    2 × FMA    × m1 × m2 (bf16x2, round to nearest, + −0 so a zero keeps its sign), where the
               factor 2^120 · 2^(e − 127) = 2^(e − 7) of the e8m0 scale byte e is split as
               m1 = 2^(min(e, 134) − 7), m2 = 2^(max(e, 134) − 134) — each a normal bf16
               (2^(e − 7) alone overflows bf16 above e = 134, a scale of 2^7).

Every step is exact: an e4m3 value has 4 significant bits, a bf16 8, and the factors are powers
of two, so each product is the e4m3 value × 2^k with no rounding as long as it stays within bf16's
range — true for the scales a quantiser writes (oracles/kvcache.py: up to 2^15 and down to 2^−20;
the intermediate after m1 is at most 448 · 2^7).  So the result is bit for bit round(e4m3 ·
scale) to bf16.  For e ≤ 134 m2 = 1, so a warp whose lanes all have such scales skips the second
multiply (`one_multiply`, a vote: no divergence).  An e4m3 NaN comes out finite: the quantisers
never write one, and nobody indexes the rows that hold them.

The asm blocks are free of side effects, so ptxas schedules them like any arithmetic (CuTeDSL's
cute.arch.prmt is marked as having side effects: a scheduling fence).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SELECT_LO = 0x9180  # halves (b0, b1), each with its sign byte above it
SELECT_HI = 0xB3A2  # halves (b2, b3)
HALF_MASK = 0x87F087F0  # per half: the sign (bit 15) and eeee mmm (bits 4 … 10)
SPLIT_E = 134  # the largest e8m0 byte whose 2^(e − 7) is a bf16


@dsl_user_op
def _bits_to_bf16x2(word, select: int, m1, m2=None, *, loc=None, ip=None) -> Int32:
    """Two of the word's e4m3 bytes (by `select`) → one bf16x2 word, × m1 × m2 (bf16x2); × m1
    alone when m2 is None (the one-multiply path: m2 would be 1)."""
    args = [Int32(word).ir_value(loc=loc, ip=ip), Int32(m1).ir_value(loc=loc, ip=ip)]
    if m2 is None:
        last = "fma.rn.bf16x2 $0, t, $2, z;\n}"
        constraints = "=r,r,r"
    else:
        args.append(Int32(m2).ir_value(loc=loc, ip=ip))
        last = "fma.rn.bf16x2 t, t, $2, z;\nfma.rn.bf16x2 $0, t, $3, z;\n}"
        constraints = "=r,r,r,r"
    return Int32(llvm.inline_asm(
        T.i32(),
        args,
        "{\n.reg .b32 t, z;\n"
        "mov.b32 z, 0x80008000;\n"
        f"prmt.b32 t, $1, 0, {select:#x};\n"
        "shl.b32 t, t, 4;\n"
        f"and.b32 t, t, {HALF_MASK:#x};\n"
        + last,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    ))


BOTH_HALVES = (1 << 7) | (1 << 23)  # × this puts a bf16 exponent field into both halves: one IMAD


def factors(e):
    """(m1, m2) = 2^(min(e, 134) − 7) and 2^(max(e, 134) − 134) of the e8m0 byte `e` as bf16x2
    words (both halves equal).  A plain int (the CPU tests read the kernel's own formula) or a
    traced Int32 (the kernel)."""
    if isinstance(e, int):
        lo, hi = min(e, SPLIT_E), max(e, SPLIT_E)
    else:
        lo, hi = cutlass.min(e, SPLIT_E), cutlass.max(e, SPLIT_E)
    return (lo + 120) * BOTH_HALVES, (hi - 7) * BOTH_HALVES


def one_multiply_fits(e):
    """Whether m2 of the e8m0 byte `e` is 1 (e ≤ SPLIT_E: a scale up to 2^7), so × m1 alone gives
    the same bits."""
    return e <= SPLIT_E


@cute.jit
def e4m3x16_to_bf16(raw, e, vals, one_multiply=False):
    """vals (16 bf16) ← the 16 e4m3 in raw[0:4] × 2^(e − 127), exactly rounded.  `one_multiply` (true
        only where one_multiply_fits(e)): skip the × m2 = 1."""
    m1, m2 = factors(e)
    out = cute.recast_tensor(vals, Int32)
    if cutlass.const_expr(isinstance(one_multiply, bool)):
        _words(raw, out, m1, None if one_multiply else m2)
    elif one_multiply:
        _words(raw, out, m1, None)
    else:
        _words(raw, out, m1, m2)


def _words(raw, out, m1, m2) -> None:
    """out[0:8] (bf16x2 words) ← the 16 e4m3 of raw[0:4], × m1 (× m2 unless None)."""
    for i in range(4):
        out[2 * i] = _bits_to_bf16x2(raw[i], SELECT_LO, m1, m2)
        out[2 * i + 1] = _bits_to_bf16x2(raw[i], SELECT_HI, m1, m2)
