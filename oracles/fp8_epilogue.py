"""Stage E's fused FP8 output epilogue (`epilogue: fp8_rope`): O's trailing 64 (rope) lanes
inverse-rotated with the token's cos/sin, then O written as e4m3 with one UE8M0 exponent per
128-value block — the operand of DSV4's next projection (wo_a) directly.

Conventions (their sources: docs/STAGE_E.md "The FP8 output epilogue"):
    rope lanes   448 … 511, interleaved pairs (448 + 2i, 449 + 2i), i = 0 … 31, angle θ_i.
    cos_sin_cache  fp32 [max_position, 64]: row p = [cos θ_0 … θ_31, sin θ_0 … θ_31].
    positions    int32 [b · s_q]: token (batch i, token t) at i · s_q + t.
    inverse      y0 = x0 · cos + x1 · sin,  y1 = −x0 · sin + x1 · cos  (the conjugate rotation).
    blocks       4 blocks of 128 lanes a row; e = ceil(log2(max(amax_k, 1e-4) / 448)), q =
                 e4m3(x / 2^e); an all-zero block has e = −22 and zero values.
    O_fp8        e4m3 [h_q / 8, b · s_q, 8, 512]: head h of token r at [h // 8, r, h % 8, :].
    O_scale      int32 [h_q / 8, 8, align4(b · s_q)]: word [g, j, r] = the 4 exponents of head
                 8g + j of token r as UE8M0 bytes (e + 127), byte k block k; pad words unwritten.
The lab's tensors hold these bytes as float32 (poisonable): O_fp8 [h_q/8, b·s_q, 8, 128],
O_scale [h_q/8, 8, align4(b·s_q)].

The check: `decode` turns the words into O = q · 2^e [b, s_q, h_q, 512] (against float64
attention → inverse rotation, unquantised) and the exponents [b, s_q, h_q, 4] (against the
float64 block's, exactly, except within a relative BAND of a power of two: e_low + 0.5 there,
so `max_abs ≤ 0.5` is exact agreement elsewhere).  torch, float64, no kernel code."""

from __future__ import annotations

import math

D = 512
ROPE_START = 448
ROPE_PAIRS = 32
BLOCK = 128
BLOCKS = D // BLOCK  # 4 exponents a row, one word
GROUP_HEADS = 8  # heads a group row of O_fp8 (the wo_a GEMM's groups)
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
UE8M0_BIAS = 127
ZERO_BLOCK_EXP = math.ceil(math.log2(AMAX_FLOOR / E4M3_MAX))  # −22: an all-zero block's exponent
# The kernel's O before quantising agrees with float64 to about a bf16 rounding of P (2^−8
# relative) — a block amax within 2^−6 of a power of two may round either way: both exponents pass
BAND = 2.0 ** -6
ROPE_THETA = 10000.0
MAX_POSITION = 4096  # rows of the generated cos_sin_cache
POISON_F32 = 0x7FA5A5A5  # the harness's float32 poison (harness/execution/metrics.py POISON_BITS)


def align4(n: int) -> int:
    return -(-n // 4) * 4


def make_cos_sin_cache(max_position: int = MAX_POSITION, theta: float = ROPE_THETA):
    """fp32 [max_position, 64]: row p = [cos(p·f_i)] then [sin(p·f_i)], f_i = θ^(−2i/64)."""
    import torch

    freqs = 1.0 / theta ** (torch.arange(0, 2 * ROPE_PAIRS, 2, dtype=torch.float64) / (2 * ROPE_PAIRS))
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(ang), torch.sin(ang)], dim=1).float()


def rotate(o, cos_sin_cache, positions, inverse: bool = True, sign: float = 1.0):
    """float64 copy of `o` [n_tokens, heads, 512] with lanes 448 … 511 rotated by each token's
    angles (positions int [n_tokens]); `inverse`: the conjugate rotation (the epilogue's), else
    the forward one.  `sign` multiplies the sin (−1: the planted wrong-sign rotation)."""
    import torch

    o = o.double().clone()
    cs = cos_sin_cache.double().to(o.device)[positions.long().to(o.device)]  # [n, 64]
    cos, sin = cs[:, None, :ROPE_PAIRS], sign * cs[:, None, ROPE_PAIRS:]
    if not inverse:
        sin = -sin
    x0, x1 = o[..., ROPE_START::2].clone(), o[..., ROPE_START + 1::2].clone()
    o[..., ROPE_START::2] = x0 * cos + x1 * sin
    o[..., ROPE_START + 1::2] = -x0 * sin + x1 * cos
    return o


def block_exponents(o):
    """int64 [..., 4]: each 128-lane block's e = ceil(log2(max(amax, 1e-4) / 448)) (float64 in)."""
    import torch

    amax = o.double().abs().reshape(*o.shape[:-1], BLOCKS, BLOCK).amax(dim=-1)
    return torch.ceil(torch.log2(torch.clamp_min(amax, AMAX_FLOOR) / E4M3_MAX)).to(torch.int64)


def exponent_reference(o):
    """float64 [..., 4]: block_exponents, or e_low + 0.5 where max(amax, 1e-4) / 448 is within a
    relative BAND of a power of two 2^e_low (the module doc's rule)."""
    import torch

    amax = o.double().abs().reshape(*o.shape[:-1], BLOCKS, BLOCK).amax(dim=-1)
    l2 = torch.log2(torch.clamp_min(amax, AMAX_FLOOR) / E4M3_MAX)
    near = torch.round(l2)
    ambiguous = (l2 - near).abs() <= math.log2(1.0 + BAND)
    return torch.where(ambiguous, near + 0.5, torch.ceil(l2))


def quantise(o):
    """(e4m3 bytes uint8 [..., 512], exponents int64 [..., 4]) of float rows `o` (float64 in)."""
    import torch

    e = block_exponents(o)
    scale = torch.pow(2.0, e.double()).repeat_interleave(BLOCK, dim=-1)
    q = (o.double() / scale).clamp(-E4M3_MAX, E4M3_MAX).float().to(torch.float8_e4m3fn).view(torch.uint8)
    return q, e


def pack(q, e, b: int, s_q: int, h_q: int):
    """(O_fp8 uint8 [h_q/8, b·s_q, 8, 512], O_scale int32 [h_q/8, 8, align4(b·s_q)]) of bytes
    q [b, s_q, h_q, 512] and exponents e [b, s_q, h_q, 4]; the scale pad words are 0."""
    import torch

    n, g = b * s_q, h_q // GROUP_HEADS
    out = q.reshape(n, g, GROUP_HEADS, D).permute(1, 0, 2, 3).contiguous()
    ue = (e + UE8M0_BIAS).to(torch.int64).reshape(n, g, GROUP_HEADS, BLOCKS)
    words = ue[..., 0] | (ue[..., 1] << 8) | (ue[..., 2] << 16) | (ue[..., 3] << 24)  # [n, g, 8]
    scales = torch.zeros(g, GROUP_HEADS, align4(n), dtype=torch.int64)
    scales[:, :, :n] = words.permute(1, 2, 0)
    return out, (scales - ((scales >> 31) << 32)).to(torch.int32)  # two's complement into int32


def unpack(out, scales, b: int, s_q: int, h_q: int):
    """(values float64 [b, s_q, h_q, 512] = q · 2^e, exponents int64 [b, s_q, h_q, 4]) of the
    packed tensors (pack's inverse; the scale pad words are ignored)."""
    from oracles.kvcache import e4m3_decode

    n = b * s_q
    words = scales[:, :, :n].to(out.device).long() & 0xFFFFFFFF  # [g, 8, n]
    e = (((words[..., None] >> (8 * _arange(BLOCKS, words.device))) & 0xFF) - UE8M0_BIAS)  # [g, 8, n, 4]
    e = e.permute(2, 0, 1, 3).reshape(b, s_q, h_q, BLOCKS)
    q = out.reshape(h_q // GROUP_HEADS, n, GROUP_HEADS, D).permute(1, 0, 2, 3).reshape(b, s_q, h_q, D)
    import torch

    vals = e4m3_decode(q) * torch.pow(2.0, e.double()).repeat_interleave(BLOCK, dim=-1)
    return vals, e


def _arange(n: int, device):
    import torch

    return torch.arange(n, device=device)


def decode_words(o_fp8_words, o_scale_words, b: int, s_q: int, h_q: int):
    """What is compared of the kernel's float32-carried words: (O [b, s_q, h_q, 512] dequantised,
        exponents [b, s_q, h_q, 4]); a value or exponent whose word (or scale word) still holds the
        poison keeps the poison bits (counted unwritten)."""
    import torch

    n, g = b * s_q, h_q // GROUP_HEADS
    raw = o_fp8_words.contiguous().view(torch.int32)
    sraw = o_scale_words.contiguous().view(torch.int32)
    poison = POISON_F32  # < 2^31: the same int32
    v_bad = (raw == poison).reshape(g, n, GROUP_HEADS, D // 4).repeat_interleave(4, dim=-1)
    v_bad = v_bad.permute(1, 0, 2, 3).reshape(b, s_q, h_q, D)
    s_bad = (sraw[:, :, :n] == poison).permute(2, 0, 1).reshape(b, s_q, h_q)
    vals, e = unpack(raw.view(torch.uint8).reshape(g, n, GROUP_HEADS, D), sraw, b, s_q, h_q)
    bad_v = v_bad | s_bad[..., None]
    o = vals.float()
    o.view(torch.int32)[bad_v] = poison  # the exact bits
    ex = e.float()
    ex.view(torch.int32)[s_bad[..., None].expand_as(ex)] = poison
    return o, ex


def words_of(out, scales):
    """The float32-carried form of packed tensors (pack's): O_fp8 [g, n, 8, 128] and O_scale
    [g, 8, align4(n)] as float32 words of the same bytes."""
    import torch

    g, n = out.shape[0], out.shape[1]
    return (out.contiguous().view(torch.float32).reshape(g, n, GROUP_HEADS, D // 4),
            scales.contiguous().view(torch.float32))
