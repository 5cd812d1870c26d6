"""e2m1 (NVFP4) → bf16 on Hopper's CUDA cores by moving bits, then exact bf16x2 multiplies by
the group's e4m3 scale (stage E's `nvfp4` cache; oracles/kvcache.py the reference).

sm_90 has no e2m1 conversion at all (cvt …e2m1x2 is sm_100a+).  A 32-bit word w of packed codes
holds 8 values, value 2i in the LOW nibble of byte i (FlashInfer's order).  A code s.ee.m (bit 3
the sign, ee the exponent, m the mantissa) is ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}.  Per word:

    E = w & 0x0F0F0F0F, O = (w >> 4) & 0x0F0F0F0F     the even / odd values' codes, a byte each
    per output word k (values 2k, 2k+1; 4 a word):
    PRMT   t = [E.byte k, 0, O.byte k, 0]             selector k | (8|k)<<4 | (4+k)<<8 | (8|k)<<12:
                                                     a "sign-replicate" nibble (8|k) on E's byte
                                                     k, whose top bit is 0, gives the zero bytes
    IMAD   t · 0x1040 = (t << 6) + (t << 12)          (no bits overlap, so + is |): in each half
    LOP3   & 0x81C081C0                               the code's ee.m at bits 6 … 8 and its sign at
                                                     15 — the bf16 s 00000ee m000000, whose value
                                                     is the e2m1 value × 2^−126: ee ≥ 1 is a normal
                                                     bf16 with exponent ee − 127 (1 + m/2), ee = 0,
                                                     m = 1 the bf16 subnormal 0.5 · 2^−126 — the
                                                     e2m1 subnormal 0.5 lands with the same factor
    HFMA2  × F (+ −0, so a −0 code stays −0)          F = scale · 2^126, or in two steps × 2^126
                                                     (exact: back to the e2m1 value) then × scale

The scale: its e4m3 byte moved into a bf16 (PRMT the byte and its sign copy into each half, SHL 4,
AND 0x87F087F0: e4m3 s eeee mmm → bf16 s eeee mmm0000, the scale × 2^−120, a subnormal e4m3
onto a bf16 subnormal with the same factor), × 2^120 → Sb (bf16x2, exact: e4m3 ⊂ bf16), × 2^126
→ F.  F is a bf16 only for a scale below 4 (2^2 · 2^126 = 2^128 overflows): `one_multiply`, a
warp's vote that every scale byte b has (b & 0x7F) < 0x48, takes × F; else × 2^126 then × Sb.
Every product is exact — e2m1 has 2 significant bits, e4m3 4, bf16 8 — so the result is bit for
bit bf16(code · scale) (= code · scale), the oracle's value.

Kernel(e2m1_table=True) builds the alternative, a PRMT-indexed 16-entry table (`table_half`).

The asm blocks are free of side effects, so ptxas schedules them like any arithmetic.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

EVEN_ODD = 0x0F0F0F0F  # a byte's low nibble
SPREAD = 0x1040  # × this: t << 6 | t << 12
MASK = 0x81C081C0  # per half: the sign (bit 15) and ee.m (bits 6 … 8)
TWO_126 = 0x7E807E80  # bf16x2 2^126, both halves
TWO_120 = 0x7B807B80  # bf16x2 2^120
SCALE_MASK = 0x87F087F0  # per half: an e4m3 s eeee mmm moved to bf16 bits 15, 7 … 13 … 4
FITS_LIMIT = 0x48  # scale bytes b with (b & 0x7F) below this are below 4: F = scale · 2^126 is a bf16


def pair_select(k: int) -> int:
    """The PRMT selector of output word k (0 … 3): bytes [E.k, 0, O.k, 0]."""
    return k | (8 | k) << 4 | (4 + k) << 8 | (8 | k) << 12


def scale_select(byte):
    """The PRMT selector putting byte `byte` (0 … 3) of a word and its sign copy in both halves:
    [b, s…s, b, s…s] (an int, or a traced Int32)."""
    return byte * 0x1111 + 0x8080


def bits_of_pair(t: int) -> int:
    """The bf16x2 bits (code_lo · 2^−126, code_hi · 2^−126) of t = code_lo | code_hi << 16: the
    IMAD and LOP3 above (plain ints: the CPU model tests/test_nvfp4_kernel.py checks)."""
    return (t * SPREAD) & MASK & 0xFFFFFFFF


def split(word):
    """(E, O) of a word of 8 codes: the even values' codes and the odd values', a byte each (the
    shift may be arithmetic: the mask drops what it brings in).  Ints or traced Int32s."""
    return word & EVEN_ODD, (word >> 4) & EVEN_ODD


@dsl_user_op
def scale_factors(word, select, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """(F, Sb) bf16x2 of the e4m3 scale byte `select` (scale_select) picks from `word`: F =
    scale · 2^126 (inf for a scale ≥ 4: used only where one_multiply holds), Sb = scale."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]),
        [Int32(word).ir_value(loc=loc, ip=ip), Int32(select).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 t, z, c120, c126;\n"
        "mov.b32 z, 0x80008000;\n"
        f"mov.b32 c120, {TWO_120:#x};\n"
        f"mov.b32 c126, {TWO_126:#x};\n"
        "prmt.b32 t, $2, 0, $3;\n"
        "shl.b32 t, t, 4;\n"
        f"and.b32 t, t, {SCALE_MASK:#x};\n"
        "fma.rn.bf16x2 $1, t, c120, z;\n"
        "fma.rn.bf16x2 $0, $1, c126, z;\n}",
        "=r,=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return (Int32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
            Int32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)))


@dsl_user_op
def pair_to_bf16x2(even, odd, k: int, f, sb=None, *, loc=None, ip=None) -> Int32:
    """Values 2k and 2k+1 of the word split into (even, odd) → one bf16x2 word: × f (= F) alone,
    or × 2^126 then × sb when sb is given (the two-multiply path)."""
    args = [Int32(even).ir_value(loc=loc, ip=ip), Int32(odd).ir_value(loc=loc, ip=ip), Int32(f).ir_value(loc=loc, ip=ip)]
    if sb is None:
        last = "fma.rn.bf16x2 $0, t, $3, z;\n}"
        constraints = "=r,r,r,r"
    else:
        args.append(Int32(sb).ir_value(loc=loc, ip=ip))
        last = f"mov.b32 c, {TWO_126:#x};\nfma.rn.bf16x2 t, t, c, z;\nfma.rn.bf16x2 $0, t, $4, z;\n}}"
        constraints = "=r,r,r,r,r"
    return Int32(llvm.inline_asm(
        T.i32(),
        args,
        "{\n.reg .b32 t, z, c;\n"
        "mov.b32 z, 0x80008000;\n"
        f"prmt.b32 t, $1, $2, {pair_select(k):#x};\n"
        f"mul.lo.u32 t, t, {SPREAD:#x};\n"
        f"and.b32 t, t, {MASK:#x};\n"
        + last,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    ))


def scales_fit(word):
    """0 when every byte b of a word of e4m3 scale bytes has (b & 0x7F) < 0x48 (a scale below 4):
        (b & 0x7F) + 0x38 carries into bit 7 iff (b & 0x7F) ≥ 0x48, never past it.  Ints or traced."""
    return ((word & 0x7F7F7F7F) + 0x38383838) & 0x80808080


# The 16-entry table alternative (Kernel(e2m1_table=True), for timing it against the bit moves):
# the bf16 of the 8 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 split into high and low bytes, two
# 8-byte PRMT tables indexed by 4 codes' magnitudes at a time (selector nibbles = ee.m).
TABLE_HI = (0x3F3F3F00, 0x40404040)  # bytes 0 … 7: 00 3F 3F 3F 40 40 40 40
TABLE_LO = (0xC0800000, 0xC0804000)  # bytes 0 … 7: 00 00 80 C0 00 40 80 C0
SIGNS_01 = 0x01001000  # × the 4 sign bits (3, 7, 11, 15): bit 3 → 15, bit 7 → 31 (the rest masked)
SIGNS_23 = 0x00010010  # bit 11 → 15, bit 15 → 31


def table_pair_words(half: int) -> tuple[int, int]:
    """The table path for 4 codes (a 16-bit half of a word, plain ints: the CPU model):
    (bf16x2 of values 0, 1; of values 2, 3), unscaled, as the asm of table_half computes."""
    def prmt(a, b, sel):
        src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
        return sum(src[(sel >> (4 * n)) & 7] << (8 * n) for n in range(4))

    sel = half & 0x7777
    hb, lb = prmt(*TABLE_HI, sel), prmt(*TABLE_LO, sel)
    m0, m1 = prmt(lb, hb, 0x5140), prmt(lb, hb, 0x7362)
    s = half & 0x8888
    return (m0 | ((s * SIGNS_01) & 0x80008000)) & 0xFFFFFFFF, (m1 | ((s * SIGNS_23) & 0x80008000)) & 0xFFFFFFFF


@dsl_user_op
def table_half(word, h: int, sb, *, loc=None, ip=None) -> tuple[Int32, Int32]:
    """Values 4h … 4h + 3 of a word of 8 codes → two bf16x2 words × sb: magnitudes by two PRMT table
        lookups and two interleaves, signs by IMAD + LOP3, one HFMA2 each."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32(), T.i32()]),
        [Int32(word).ir_value(loc=loc, ip=ip), Int32(sb).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 x, sel, hb, lb, m0, m1, s, g, z, th0, th1, tl0, tl1;\n"
        "mov.b32 z, 0x80008000;\n"
        f"mov.b32 th0, {TABLE_HI[0]:#x};\nmov.b32 th1, {TABLE_HI[1]:#x};\n"
        f"mov.b32 tl0, {TABLE_LO[0]:#x};\nmov.b32 tl1, {TABLE_LO[1]:#x};\n"
        f"shr.u32 x, $2, {16 * h};\n"
        "and.b32 sel, x, 0x7777;\n"
        "prmt.b32 hb, th0, th1, sel;\n"
        "prmt.b32 lb, tl0, tl1, sel;\n"
        "prmt.b32 m0, lb, hb, 0x5140;\n"
        "prmt.b32 m1, lb, hb, 0x7362;\n"
        "and.b32 s, x, 0x8888;\n"
        f"mul.lo.u32 g, s, {SIGNS_01:#x};\n"
        "and.b32 g, g, 0x80008000;\n"
        "or.b32 m0, m0, g;\n"
        f"mul.lo.u32 g, s, {SIGNS_23:#x};\n"
        "and.b32 g, g, 0x80008000;\n"
        "or.b32 m1, m1, g;\n"
        "fma.rn.bf16x2 $0, m0, $3, z;\n"
        "fma.rn.bf16x2 $1, m1, $3, z;\n}",
        "=r,=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return (Int32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
            Int32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)))


def e2m1x8_to_bf16_table(word, sb, out) -> None:
    """out[0:4] ← the 8 codes of `word` × sb by the table path (table_half)."""
    for h in range(2):
        out[2 * h], out[2 * h + 1] = table_half(word, h, sb)


def one_multiply_fits(word):
    """Whether every scale byte of `word` is below 4 (scales_fit is 0)."""
    return scales_fit(word) == 0


@cute.jit
def e2m1x8_to_bf16(word, f, sb, out, one_multiply=False):
    """out[0:4] (bf16x2 words of values 0 … 7) ← the 8 codes of `word` × the group's scale (f, sb
        of scale_factors).  `one_multiply` (true only where the scale is below 4): × f alone."""
    if cutlass.const_expr(isinstance(one_multiply, bool)):
        _words(word, out, f, None if one_multiply else sb)
    elif one_multiply:
        _words(word, out, f, None)
    else:
        _words(word, out, f, sb)


def _words(word, out, f, sb) -> None:
    even, odd = split(Int32(word))
    for k in range(4):
        out[k] = pair_to_bf16x2(even, odd, k, f, sb)
