"""Stage E's fused FP8 output epilogue (`epilogue: fp8_rope`; the contract: oracles/fp8_epilogue.py).

A finished O row (1/ℓ and the sink factor applied, fp32) leaves as
    1. rope lanes 448 … 511 inverse-rotated, pair i = (448 + 2i, 449 + 2i), with the token's
       cos_sin_cache row: y0 = x0·cos + x1·sin, y1 = −x0·sin + x1·cos — a pair is two adjacent
       columns one thread holds, so no exchange;
    2. per 128-lane block k: amax (shuffles), e = ceil(log2(max(amax, 1e-4) / 448)) read off the
       fp32 bits of v = max(amax, 1e-4) / 448 (biased exponent, + 1 when the mantissa is not
       zero), the byte e + 127;
    3. x · 2^−e (2^−e: bits (254 − byte) << 23) to e4m3 by cvt.rn.satfinite.e4m3x2.f32;
    4. the bytes to O_fp8 at ((h // 8 · n + r) · 8 + h % 8) · 512 + column, the exponent bytes to
       O_scale word ((h // 8) · 8 + h % 8) · align4(n) + r, byte k.
A row of zeros gets e = −22 and zero values.  `sin_sign` multiplies every sin (a planted bug: −1)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

ROPE_START = 448
ROPE_PAIRS = 32
BLOCK = 128
GROUP_HEADS = 8


def _asm(res_type, args, text: str, constraints: str, side_effects: bool = False, loc=None, ip=None):
    return llvm.inline_asm(res_type, args, text, constraints, has_side_effects=side_effects, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def cvt_e4m3x2(lo, hi, *, loc=None, ip=None) -> Int32:
    """16 bits (in an int32): e4m3(lo) the low byte, e4m3(hi) the high one (round to nearest even,
    saturating at ±448)."""
    res = _asm(T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
               "{\n.reg .b16 t;\ncvt.rn.satfinite.e4m3x2.f32 t, $2, $1;\ncvt.u32.u16 $0, t;\n}", "=r,f,f",
               loc=loc, ip=ip)
    return Int32(res)


@dsl_user_op
def ue8m0_byte(amax, *, loc=None, ip=None) -> Int32:
    """The UE8M0 byte (e + 127) of a block whose |x| max is `amax` (the module doc's step 2)."""
    res = _asm(T.i32(), [Float32(amax).ir_value(loc=loc, ip=ip)],
               "{\n.reg .f32 v;\n.reg .b32 bits, m;\n.reg .pred p;\n"
               "max.f32 v, $1, 0f38D1B717;\n"  # 1e-4
               "div.rn.f32 v, v, 0f43E00000;\n"  # / 448
               "mov.b32 bits, v;\n"
               "shr.u32 $0, bits, 23;\nand.b32 $0, $0, 255;\n"
               "and.b32 m, bits, 8388607;\nsetp.ne.u32 p, m, 0;\n@p add.u32 $0, $0, 1;\n}",
               "=r,f", loc=loc, ip=ip)
    return Int32(res)


@dsl_user_op
def inverse_scale(byte, *, loc=None, ip=None) -> Float32:
    """2^−e of a UE8M0 byte e + 127 (1 ≤ byte ≤ 253): the float of bits (254 − byte) << 23."""
    res = _asm(T.f32(), [Int32(byte).ir_value(loc=loc, ip=ip)],
               "{\n.reg .b32 t;\nsub.u32 t, 254, $1;\nshl.b32 t, t, 23;\nmov.b32 $0, t;\n}", "=f,r",
               loc=loc, ip=ip)
    return Float32(res)


@dsl_user_op
def st_b16(addr, value, *, loc=None, ip=None) -> None:
    """st.global.b16 of `value`'s low 16 bits at byte address `addr`."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
         "{\n.reg .b16 t;\ncvt.u16.u32 t, $1;\nst.global.b16 [$0], t;\n}", "l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_b32(addr, value, *, loc=None, ip=None) -> None:
    """st.global.b32 of `value` at the 4-byte aligned byte address `addr`."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
         "st.global.b32 [$0], $1;", "l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def st_v4(addr, a, b, c, d, *, loc=None, ip=None) -> None:
    """st.global.v4.b32 {a, b, c, d} at the 16-byte aligned byte address `addr`."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip)] + [Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b, c, d)],
         "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", side_effects=True, loc=loc, ip=ip)


def value_offset(row, heads: int, tokens: int):
    """Byte offset in O_fp8 of row `row`'s 512 values (token r = row // heads, head h = row % heads):
        ((h // 8 · tokens + r) · 8 + h % 8) · 512.  Ints or traced."""
    token, head = row // heads, row % heads
    return ((head // GROUP_HEADS * tokens + token) * GROUP_HEADS + head % GROUP_HEADS) * 512


def scale_offset(row, heads: int, tokens: int):
    """Byte offset in O_scale of row `row`'s int32 word: word (h // 8 · 8 + h % 8) · align4(tokens)
    + r, i.e. (h · align4(tokens) + r) · 4 (the word's byte k is block k's exponent)."""
    token, head = row // heads, row % heads
    return (head * (-(-tokens // 4) * 4) + token) * 4


def ue8m0_of(amax: float) -> int:
    """The UE8M0 byte `ue8m0_byte` computes, in Python on the same float32 bits (the module doc's
    step 2) — for the CPU test against the oracle's rule."""
    import struct

    v = struct.unpack("<f", struct.pack("<f", max(struct.unpack("<f", struct.pack("<f", amax))[0], 1e-4)))[0]
    v = struct.unpack("<f", struct.pack("<f", v / 448.0))[0]
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    return ((bits >> 23) & 0xFF) + (1 if bits & 0x7FFFFF else 0)


def rotate_pair(x0, x1, cos, sin):
    """The conjugate rotation of one pair: (x0·cos + x1·sin, −x0·sin + x1·cos)."""
    return x0 * cos + x1 * sin, x1 * cos - x0 * sin


def absmax(m, x):
    return cute.arch.fmax(m, cute.arch.fmax(x, -x))


class Fp8Out:
    """Where the epilogue writes (O_fp8, O_scale addresses) and reads (cos/sin rows, positions), for
        (batch, token, head) rows of `heads` heads and `tokens` = b · s_q."""

    def __init__(self, o8, scale, cos_sin, positions, heads: int, tokens: int, sin_sign: float = 1.0):
        self.o8, self.scale, self.cos_sin, self.positions = o8, scale, cos_sin, positions
        self.heads, self.tokens, self.sin_sign = heads, tokens, sin_sign

    def row_addresses(self, row):
        """(byte address of row `row`'s 512 e4m3 values, of its scale word, its position)."""
        o8 = self.o8.iterator.toint() + Int64(value_offset(row, self.heads, self.tokens))
        sc = self.scale.iterator.toint() + Int64(scale_offset(row, self.heads, self.tokens))
        return o8, sc, self.positions[row // self.heads]

    def cos_sin_at(self, pos, i):
        """(cos θ_i, sin_sign · sin θ_i) of position `pos`."""
        return self.cos_sin[pos * (2 * ROPE_PAIRS) + i], self.sin_sign * self.cos_sin[pos * (2 * ROPE_PAIRS) + ROPE_PAIRS + i]


@cute.jit
def store_accumulator_fp8(acc: cute.Tensor, tidx, wg: cutlass.Constexpr[int], row_block, out: cutlass.Constexpr,
                          cols_per_wg: cutlass.Constexpr[int]) -> None:
    """The epilogue for a scaled m64nN wgmma accumulator (quad_store.py's layout), warpgroup `wg`'s
        columns from col0 = wg · cols_per_wg, rows of 64-row block `row_block`; `out` an Fp8Out.  A
        quad holds whole rows of a block, so a block's amax is two shuffles; the rope pairs are a
        thread's own e = 0, 1 columns.  2-byte stores; the scale word's bytes of this warpgroup's
        blocks by one 2-byte store of the quad's first thread."""
    lane = tidx % 32
    q = lane % 4
    row0 = (tidx % 128) // 32 * 16 + lane // 4
    col0 = wg * cols_per_wg
    groups = cute.size(acc) // 4
    blocks = cols_per_wg // BLOCK  # 128-lane blocks of this warpgroup
    gpb = BLOCK // 8  # 8-column groups a block
    for h in cutlass.range_constexpr(2):
        row = row_block * 64 + row0 + 8 * h
        o8, sc, pos = out.row_addresses(row)
        # in place: the accumulator is dead after this epilogue (a copy of a row's 64 values
        # spilled at h_q 128 in simple)
        for g in cutlass.range_constexpr(groups):
            if cutlass.const_expr(col0 + 8 * g >= ROPE_START):
                cos, sin = out.cos_sin_at(pos, (col0 + 8 * g - ROPE_START) // 2 + q)
                i = 4 * g + 2 * h
                acc[i], acc[i + 1] = rotate_pair(acc[i], acc[i + 1], cos, sin)
        word = Int32(0)
        for k in cutlass.range_constexpr(blocks):
            m = Float32(0.0)
            for g in cutlass.range_constexpr(gpb):
                for e in cutlass.range_constexpr(2):
                    m = absmax(m, acc[4 * (gpb * k + g) + 2 * h + e])
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
            byte = ue8m0_byte(m)
            inv = inverse_scale(byte)
            word = word | (byte << (8 * k))
            for g in cutlass.range_constexpr(gpb):
                i = 4 * (gpb * k + g) + 2 * h
                st_b16(o8 + col0 + 8 * (gpb * k + g) + 2 * q, cvt_e4m3x2(acc[i] * inv, acc[i + 1] * inv))
        if q == 0:
            st_b16(sc + col0 // BLOCK, word)


@cute.jit
def store_row_fp8(vals: cute.Tensor, lane, row, out: cutlass.Constexpr) -> None:
    """One row held as PartCombine holds it (lane l: columns 16·l … + 15, `vals` scaled): a block is
        8 lanes (amax: three shuffles), lanes 28 … 31 hold the rope pairs, one 16-byte store a lane,
        the scale word by lane 0 (block k's byte from lane 8k)."""
    o8, sc, pos = out.row_addresses(row)
    # no branch: the nope lanes rotate by (cos, sin) = (1, 0), reading the pairs of lane 28's place
    rope = lane >= ROPE_START // 16
    first = 8 * (cutlass.max(lane, ROPE_START // 16) - ROPE_START // 16)
    for m in cutlass.range_constexpr(8):
        cos, sin = out.cos_sin_at(pos, first + m)
        cos, sin = cutlass.select_(rope, cos, Float32(1.0)), cutlass.select_(rope, sin, Float32(0.0))
        vals[2 * m], vals[2 * m + 1] = rotate_pair(vals[2 * m], vals[2 * m + 1], cos, sin)
    amax = Float32(0.0)
    for i in cutlass.range_constexpr(16):
        amax = absmax(amax, vals[i])
    for bit in cutlass.range_constexpr(3):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << bit))
    byte = ue8m0_byte(amax)
    inv = inverse_scale(byte)
    w = cute.make_rmem_tensor(4, Int32)
    for i in cutlass.range_constexpr(4):
        w[i] = (cvt_e4m3x2(vals[4 * i] * inv, vals[4 * i + 1] * inv)
                | (cvt_e4m3x2(vals[4 * i + 2] * inv, vals[4 * i + 3] * inv) << 16))
    st_v4(o8 + lane * 16, w[0], w[1], w[2], w[3])
    word = Int32(0)
    for k in cutlass.range_constexpr(4):
        word = word | (cute.arch.shuffle_sync(byte, 8 * k) << (8 * k))
    if lane == 0:
        st_b32(sc, word)


@dsl_user_op
def st_b8(addr, value, *, loc=None, ip=None) -> None:
    """st.global.b8 of `value`'s low 8 bits at byte address `addr`."""
    _asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
         "{\n.reg .b16 t;\ncvt.u16.u32 t, $1;\nst.global.b8 [$0], t;\n}", "l,r", side_effects=True, loc=loc, ip=ip)


@cute.jit
def store_strided_row_fp8(vals: cute.Tensor, lane, o8, sc, cos_sin, pos, sin_sign: cutlass.Constexpr[float]) -> None:
    """One row held as SplitCombine holds it (lane l: columns l + 32·k, k = 0 … 15): a rope pair
        (448 + 2i, 449 + 2i) is lanes (2j, 2j + 1) of k = 14, 15 (one shuffle); a block spans the
        warp (amax: five shuffles); a byte a store; the scale word by lane 0."""
    odd = (lane % 2) == 1
    for k in cutlass.range_constexpr(ROPE_START // 32, 16):
        other = cute.arch.shuffle_sync_bfly(vals[k], offset=1)
        x0 = cutlass.select_(odd, other, vals[k])
        x1 = cutlass.select_(odd, vals[k], other)
        i = (lane + 32 * k - ROPE_START) // 2
        cos = cos_sin[pos * (2 * ROPE_PAIRS) + i]
        sin = sin_sign * cos_sin[pos * (2 * ROPE_PAIRS) + ROPE_PAIRS + i]
        y0, y1 = rotate_pair(x0, x1, cos, sin)
        vals[k] = cutlass.select_(odd, y1, y0)
    word = Int32(0)
    for blk in cutlass.range_constexpr(4):
        amax = Float32(0.0)
        for k in cutlass.range_constexpr(4 * blk, 4 * blk + 4):
            amax = absmax(amax, vals[k])
        for bit in cutlass.range_constexpr(5):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << bit))
        byte = ue8m0_byte(amax)
        inv = inverse_scale(byte)
        word = word | (byte << (8 * blk))
        for k in cutlass.range_constexpr(4 * blk, 4 * blk + 4):
            st_b8(o8 + lane + 32 * k, cvt_e4m3x2(vals[k] * inv, Float32(0.0)))
    if lane == 0:
        st_b32(sc, word)
