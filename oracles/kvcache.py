"""DSV4's FP8 paged KV-cache formats: byte layouts, quantisers and dequantisers.

A cache holds `num_blocks` page blocks of `block_size` tokens; each token is one latent KV row of
512 values (448 "nope" + 64 "rope" columns).  Every format is stored here as ONE byte tensor
`uint8 [num_blocks, block_bytes]` (row-major, blocks contiguous); the typed views below are how a
kernel or a peer reads it.  A token is addressed by `index = block_id · block_size + offset`.

Formats (`kv_format`):

    simple   the first kernel plan: 512 e4m3 values per token and one fp32 scale per token,
             x ≈ e4m3 · scale,  scale = max(amax(row), 1e-4) / 448.
             Block bytes: [block_size × 512 e4m3][block_size × fp32 scale], padded to 16 B.
             Views: `values [num_blocks, block_size, 512] e4m3`, `scale [num_blocks, block_size] fp32`.

    model1   DSV4's production layout (FlashMLA's MODEL1_FP8Sparse, legacy kv_format "V4"):
             [block_size × 576 B: per token 448 e4m3 (nope) + 64 bf16 (rope, not quantised)]
             [block_size × 8 B:   per token 7 e8m0 scales (one per 64-column tile of the nope
                                  part) + 1 pad byte]
             padded so the block is a multiple of 576 B.  FlashMLA's own view of it is the
             strided `[num_blocks, block_size, 1, 584]` tensor with strides
             (block_bytes, 584, 584, 1) (`model1_flashmla_view`): its shape carries the block
             size, its first stride the block size in bytes; the row at `t · 584` is NOT token t
             (token t's data start at t · 576, its scales at block_size · 576 + t · 8).
             Scale of a 64-wide tile: 2^ceil(log2(max(amax/448, 1e-4))), q = e4m3(x / scale).

    v4.1     FlashMLA's current (Blackwell) layout: per token 512 e4m3 (rope quantised too), then
             16 e8m0 scales, one per 32 consecutive values: 528 B per token, blocks unpadded,
             i.e. `[num_blocks, block_size, 1, 528]` contiguous.  Same scale rule per 32 values.

    nvfp4    FlashInfer's NVFP4 cache (SM120; docs/STAGE_E.md has the byte diagram and sources):
             [block_size × 352 B: per token 224 B of packed e2m1 nope (value 2i in the LOW
                                  nibble of byte i) + 64 bf16 rope]
             [block_size × 32 B:  per token 28 e4m3 scales (one per 16 nope values) + 4 zero pad]
             384 B a token, unpadded; no per-tensor scale.  e2m1 s.ee.m: ±{0, 0.5, 1, 1.5, 2, 3,
             4, 6}.  A group of 16: scale = e4m3(amax / 6) (nearest even, saturating at 448), code
             = e2m1(x / scale) (nearest even, saturating at ±6, the sign kept: −0 is code 8); a
             scale of 0 gives codes ±0.  Dequantising: e2m1 · e4m3 scale.

e8m0 (float8_e8m0fnu) is a bare exponent: byte e means 2^(e − 127), 0xFF is NaN.  Every power of
two from 2^−127 to 2^127 is exact; the quantisers produce ≥ 2^−14 (the 1e-4 floor); a cache
writer may store any exponent, and the dequantisers honour it (2^−20 … 2^15 are tested).

Checked against FlashMLA@9241ae3 tests/quant.py (MODEL1_FP8Sparse) and the sgl-flash-mla 1.0.0
wheel's docstring for V4.1 (its quantiser is unpublished: model1's rule on 32-value groups is an
assumption; the dequantiser follows the documented bytes).  nvfp4 differs from FlashInfer by
design: x / scale exactly, not x · rcp.approx, and a scale rounding to 0 gives ±0, not ±6.

Everything here is torch on any device, float64 where it computes, no kernel code.
"""

from __future__ import annotations

import math

FORMATS = ("simple", "model1", "v4.1", "nvfp4")
D = 512
D_NOPE = 448
D_ROPE = 64
MODEL1_TILE = 64
MODEL1_TILES = D_NOPE // MODEL1_TILE  # 7
MODEL1_DATA = D_NOPE + 2 * D_ROPE  # 576 bytes per token: e4m3 nope + bf16 rope
MODEL1_SCALES = 8  # 7 e8m0 + 1 pad byte
MODEL1_TOKEN = MODEL1_DATA + MODEL1_SCALES  # 584
MODEL1_ALIGN = 576
V41_GROUP = 32
V41_SCALES = D // V41_GROUP  # 16
V41_TOKEN = D + V41_SCALES  # 528
NVFP4_GROUP = 16  # nope values a scale
NVFP4_SCALES = D_NOPE // NVFP4_GROUP  # 28 e4m3 scales a token
NVFP4_NOPE = D_NOPE // 2  # 224 bytes of packed e2m1
NVFP4_DATA = NVFP4_NOPE + 2 * D_ROPE  # 352: a token's data row (e2m1 nope + bf16 rope)
NVFP4_SCALE_BYTES = 32  # 28 e4m3 + 4 zero pad, after the block's rows
NVFP4_TOKEN = NVFP4_DATA + NVFP4_SCALE_BYTES  # 384
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0 … 7 (bit 3: the sign)
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4
E8M0_BIAS = 127


def _check(fmt: str, block_size: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"kv_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def block_bytes(fmt: str, block_size: int) -> int:
    """Bytes of one page block of `block_size` tokens in format `fmt`."""
    _check(fmt, block_size)
    if fmt == "simple":
        return (block_size * (D + 4) + 15) // 16 * 16
    if fmt == "model1":
        return (block_size * MODEL1_TOKEN + MODEL1_ALIGN - 1) // MODEL1_ALIGN * MODEL1_ALIGN
    if fmt == "nvfp4":
        return block_size * NVFP4_TOKEN
    return block_size * V41_TOKEN


def block_size_of(fmt: str, nbytes: int) -> int | None:
    """The block size whose block is `nbytes` bytes in format `fmt` (at most one), or None.  nvfp4:
        powers of two only, so the bytes alone tell the format (its 384-byte token makes other sizes
        collide with simple and v4.1 blocks); one collision is left: nvfp4's 512 tokens are
        simple's 381 (tests/test_e_peers.py)."""
    if fmt == "nvfp4":
        size = _search(fmt, nbytes)
        return size if size is not None and size & (size - 1) == 0 else None
    return _search(fmt, nbytes)


def _search(fmt: str, nbytes: int) -> int | None:
    lo, hi = 1, max(1, nbytes)
    while lo <= hi:
        mid = (lo + hi) // 2
        got = block_bytes(fmt, mid)
        if got == nbytes:
            return mid
        lo, hi = (mid + 1, hi) if got < nbytes else (lo, mid - 1)
    return None


# ---------------------------------------------------------------------------------------------
# e8m0 and e4m3 by hand (bit-exact, independent of torch's float8 casts where it matters)


def e8m0_decode(b):
    """float64 2^(b − 127) of uint8 bytes `b` (0xFF → NaN)."""
    import torch

    e = b.to(torch.int64)
    out = torch.pow(torch.full(e.shape, 2.0, dtype=torch.float64, device=e.device), (e - E8M0_BIAS).double())
    return torch.where(e == 255, torch.full_like(out, math.nan), out)


def e8m0_encode_exponent(exp):
    """uint8 bytes of scales 2^exp (integer tensor `exp`, −127 ≤ exp ≤ 127)."""
    import torch

    exp = exp.to(torch.int64)
    if bool(((exp < -E8M0_BIAS) | (exp > 127)).any()):
        raise ValueError("e8m0 holds exponents −127 … 127")
    return (exp + E8M0_BIAS).to(torch.uint8)


def e4m3_decode(b):
    """float64 values of float8_e4m3fn bytes `b` (sign, 4 exponent bits with bias 7, 3 mantissa
    bits; exponent 0 is subnormal; 0x7F / 0xFF are NaN; no infinities)."""
    import torch

    b = b.to(torch.int64)
    sign = torch.where((b & 0x80) != 0, -1.0, 1.0).double()
    e = (b >> 3) & 0xF
    m = (b & 0x7).double()
    normal = torch.ldexp(1.0 + m / 8.0, (e - 7).to(torch.int32))
    sub = torch.ldexp(m / 8.0, torch.full_like(e, -6).to(torch.int32))
    v = sign * torch.where(e == 0, sub, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.full_like(v, math.nan), v)


def _pow2_scale_exponent(amax):
    """Integer exponent e with 2^e = 2^ceil(log2(max(amax / 448, 1e-4))) (float64 in)."""
    import torch

    s = torch.clamp_min(amax.double() / E4M3_MAX, SCALE_FLOOR)
    return torch.ceil(torch.log2(s)).to(torch.int64)


def _e4m3_bytes(x):
    """float8_e4m3fn bytes of `x` (round to nearest even, saturating at ±448: |x| ≤ 448 here)."""
    import torch

    return x.float().to(torch.float8_e4m3fn).view(torch.uint8)


def e2m1_decode(n):
    """float64 values of e2m1 codes `n` (integers 0 … 15: bit 3 the sign, bits 0 … 2 the
    magnitude's index into E2M1_VALUES; e2m1 has no NaN or infinity)."""
    import torch

    n = n.to(torch.int64)
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=n.device)[n & 7]
    return torch.where((n & 8) != 0, -mag, mag)


def e2m1_encode(y):
    """int64 e2m1 codes of float64 `y`: round to nearest, ties to the even code (mantissa bit 0),
    saturating at ±6; the sign bit is the sign of y (a −0 or a negative that rounds to 0 is 8)."""
    import torch

    y = y.double()
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=y.device)
    dist = (y.abs().clamp(max=E2M1_MAX)[..., None] - grid).abs()  # [..., 8]
    best = dist.min(dim=-1, keepdim=True).values
    # among the nearest (one, or two at a tie), the even code; codes 0 … 7 alternate even / odd
    even = torch.arange(8, device=y.device) % 2 == 0
    pick = torch.where((dist == best) & even, 0, torch.where(dist == best, 1, 2))
    code = torch.argmin(pick * 8 + torch.arange(8, device=y.device), dim=-1)
    return code | (torch.signbit(y).to(torch.int64) << 3)


def _nvfp4_scales(amax):
    """uint8 e4m3 bytes of the group scales e4m3(amax / 6) (round to nearest even, saturating
    at 448) of float `amax` (≥ 0)."""
    import torch

    return _e4m3_bytes(torch.clamp(amax.double() / E2M1_MAX, max=E4M3_MAX))


# ---------------------------------------------------------------------------------------------
# Typed views of a byte cache


def simple_views(cache, block_size: int):
    """(values uint8 [nb, bs, 512] (e4m3 bytes), scale fp32 [nb, bs]) of a simple cache."""
    import torch

    nb = cache.shape[0]
    vals = cache[:, : block_size * D].reshape(nb, block_size, D)
    scale = cache[:, block_size * D : block_size * (D + 4)].contiguous().view(torch.float32).reshape(nb, block_size)
    return vals, scale


def model1_views(cache, block_size: int):
    """(nope uint8 [nb, bs, 448] (e4m3 bytes), rope bf16 [nb, bs, 64], scales uint8 [nb, bs, 7]
    (e8m0 bytes)) of a model1 cache."""
    import torch

    nb = cache.shape[0]
    data = cache[:, : block_size * MODEL1_DATA].reshape(nb, block_size, MODEL1_DATA)
    nope = data[:, :, :D_NOPE]
    rope = data[:, :, D_NOPE:].contiguous().view(torch.bfloat16)
    sc = cache[:, block_size * MODEL1_DATA : block_size * MODEL1_TOKEN].reshape(nb, block_size, MODEL1_SCALES)
    return nope, rope, sc[:, :, :MODEL1_TILES]


def v41_views(cache, block_size: int):
    """(values uint8 [nb, bs, 512] (e4m3 bytes), scales uint8 [nb, bs, 16] (e8m0 bytes))."""
    nb = cache.shape[0]
    tok = cache[:, : block_size * V41_TOKEN].reshape(nb, block_size, V41_TOKEN)
    return tok[:, :, :D], tok[:, :, D:]


def nvfp4_views(cache, block_size: int):
    """(nope uint8 [nb, bs, 224] (packed e2m1, low nibble first), rope bf16 [nb, bs, 64], scales
    uint8 [nb, bs, 28] (e4m3 bytes)) of an nvfp4 cache."""
    import torch

    nb = cache.shape[0]
    data = cache[:, : block_size * NVFP4_DATA].reshape(nb, block_size, NVFP4_DATA)
    rope = data[:, :, NVFP4_NOPE:].contiguous().view(torch.bfloat16)
    sc = cache[:, block_size * NVFP4_DATA : block_size * NVFP4_TOKEN].reshape(nb, block_size, NVFP4_SCALE_BYTES)
    return data[:, :, :NVFP4_NOPE], rope, sc[:, :, :NVFP4_SCALES]


def model1_flashmla_view(cache, block_size: int):
    """FlashMLA's `[num_blocks, block_size, 1, 584]` strided view of a model1 byte cache."""
    nb, bb = cache.shape
    if bb != block_bytes("model1", block_size):
        raise ValueError(f"a model1 block of {block_size} tokens is {block_bytes('model1', block_size)} bytes, got {bb}")
    return cache.as_strided((nb, block_size, 1, MODEL1_TOKEN), (bb, MODEL1_TOKEN, MODEL1_TOKEN, 1))


def v41_flashmla_view(cache, block_size: int):
    """FlashMLA's `[num_blocks, block_size, 1, 528]` view of a v4.1 byte cache."""
    return cache.view(cache.shape[0], block_size, 1, V41_TOKEN)


# ---------------------------------------------------------------------------------------------
# Tokens: encode, place, read (the cache writer and reader every function below is built on)


def _layout(fmt: str) -> tuple[int, int]:
    """(data bytes, scale bytes) of one token: simple (512, 4 fp32), model1 (576, 8 = 7 + pad),
    v4.1 (528, 0: its scales are part of the token's 528 contiguous bytes)."""
    return {"simple": (D, 4), "model1": (MODEL1_DATA, MODEL1_SCALES), "v4.1": (V41_TOKEN, 0),
            "nvfp4": (NVFP4_DATA, NVFP4_SCALE_BYTES)}[fmt]


def token_offsets(fmt: str, block_size: int, index):
    """(data offset, scale offset) int64 of token `index` (= block · block_size + offset) in the flat
        byte cache (v4.1's scales at data + 512; the others' in the block's scale plane)."""
    import torch

    _check(fmt, block_size)
    index = index.to(torch.int64)
    blk, off = index // block_size, index % block_size
    base = blk * block_bytes(fmt, block_size)
    ld, ls = _layout(fmt)
    if fmt == "v4.1":
        data = base + off * V41_TOKEN
        return data, data + D
    return base + off * ld, base + block_size * ld + off * ls


def encode_tokens(x, fmt: str):
    """(data uint8 [N, Ld], scales uint8 [N, Ls]) of rows `x [N, 512]` (finite): the bytes a
    writer stores for each token (see the module doc; the model1 pad byte is 0)."""
    import torch

    _check(fmt, 1)
    n = x.shape[0]
    xf = x.float()  # every division below is by a power of two (exact) or the simple fp32 scale
    if fmt == "simple":
        scale = torch.clamp_min(xf.abs().amax(dim=-1), SCALE_FLOOR) / E4M3_MAX  # fp32 [N]
        return _e4m3_bytes(xf / scale[:, None]), scale.contiguous().view(torch.uint8).reshape(n, 4)
    if fmt == "model1":
        tiles = xf[:, :D_NOPE].reshape(n, MODEL1_TILES, MODEL1_TILE)
        exp = _pow2_scale_exponent(tiles.abs().amax(dim=-1))  # [N, 7]
        q = _e4m3_bytes(tiles / torch.ldexp(torch.ones_like(tiles), exp[..., None].to(torch.int32)))
        rope = x[:, D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * D_ROPE)
        pad = torch.zeros(n, 1, dtype=torch.uint8, device=x.device)
        return torch.cat([q.reshape(n, D_NOPE), rope], dim=1), torch.cat([e8m0_encode_exponent(exp), pad], dim=1)
    if fmt == "nvfp4":
        groups = x[:, :D_NOPE].double().reshape(n, NVFP4_SCALES, NVFP4_GROUP)
        sc = _nvfp4_scales(groups.abs().amax(dim=-1))  # [N, 28] e4m3 bytes
        s = e4m3_decode(sc)[..., None]
        codes = e2m1_encode(torch.where(s > 0, groups / torch.where(s > 0, s, 1.0), groups * 0.0)).reshape(n, D_NOPE)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # the even value in the low nibble
        rope = x[:, D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * D_ROPE)
        pad = torch.zeros(n, NVFP4_SCALE_BYTES - NVFP4_SCALES, dtype=torch.uint8, device=x.device)
        return torch.cat([packed, rope], dim=1), torch.cat([sc, pad], dim=1)
    groups = xf.reshape(n, V41_SCALES, V41_GROUP)
    exp = _pow2_scale_exponent(groups.abs().amax(dim=-1))  # [N, 16]
    q = _e4m3_bytes(groups / torch.ldexp(torch.ones_like(groups), exp[..., None].to(torch.int32)))
    return torch.cat([q.reshape(n, D), e8m0_encode_exponent(exp)], dim=1), torch.zeros(n, 0, dtype=torch.uint8, device=x.device)


def _spans(fmt: str, block_size: int, index):
    """Flat byte positions [N, Ld] and [N, Ls] of tokens `index`."""
    import torch

    ld, ls = _layout(fmt)
    d0, s0 = token_offsets(fmt, block_size, index)
    return (d0[:, None] + torch.arange(ld, device=d0.device)[None, :],
            s0[:, None] + torch.arange(ls, device=s0.device)[None, :])


def write_tokens(cache, fmt: str, block_size: int, index, x) -> None:
    """Quantise rows `x [N, 512]` into tokens `index [N]` of the byte cache (in place)."""
    nb, bb = cache.shape
    if bb != block_bytes(fmt, block_size):
        raise ValueError(f"a {fmt} block of {block_size} tokens is {block_bytes(fmt, block_size)} bytes, got {bb}")
    data, scales = encode_tokens(x, fmt)
    dpos, spos = _spans(fmt, block_size, index.to(cache.device))
    flat = cache.view(-1)
    flat[dpos.reshape(-1)] = data.to(cache.device).reshape(-1)
    if scales.shape[1]:
        flat[spos.reshape(-1)] = scales.to(cache.device).reshape(-1)


def read_tokens(cache, fmt: str, block_size: int, index):
    """float64 [N, 512] of tokens `index [N]` of the byte cache (NaN where the bytes say so)."""
    import torch

    nb, bb = cache.shape
    if bb != block_bytes(fmt, block_size):
        raise ValueError(f"a {fmt} block of {block_size} tokens is {block_bytes(fmt, block_size)} bytes, got {bb}")
    dpos, spos = _spans(fmt, block_size, index.to(cache.device))
    flat = cache.reshape(-1)
    data = flat[dpos]
    if fmt == "simple":
        scale = flat[spos].contiguous().view(torch.float32).double()  # [N, 1]
        return e4m3_decode(data) * scale
    if fmt == "model1":
        s = e8m0_decode(flat[spos][:, :MODEL1_TILES]).repeat_interleave(MODEL1_TILE, dim=-1)
        rope = data[:, D_NOPE:].contiguous().view(torch.bfloat16).double()
        return torch.cat([e4m3_decode(data[:, :D_NOPE]) * s, rope], dim=1)
    if fmt == "nvfp4":
        return torch.cat([nvfp4_nope_decode(data[:, :NVFP4_NOPE], flat[spos][:, :NVFP4_SCALES]),
                          data[:, NVFP4_NOPE:].contiguous().view(torch.bfloat16).double()], dim=1)
    return e4m3_decode(data[:, :D]) * e8m0_decode(data[:, D:]).repeat_interleave(V41_GROUP, dim=-1)


def nvfp4_nope_decode(packed, scales):
    """float64 [N, 448] of packed e2m1 bytes [N, 224] (low nibble the even value) and e4m3 scale
    bytes [N, 28] (one per 16 values): code · scale (a NaN scale — 0x7F, 0xFF — gives NaN)."""
    import torch

    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)
    return e2m1_decode(codes) * e4m3_decode(scales).repeat_interleave(NVFP4_GROUP, dim=-1)


def quantize(kv, fmt: str):
    """Byte cache `uint8 [num_blocks, block_bytes]` of `kv [num_blocks, block_size, 512]` (any
    float dtype; rows must be finite) in format `fmt`; block padding is 0."""
    import torch

    if kv.dim() != 3 or kv.shape[-1] != D:
        raise ValueError(f"kv must be [num_blocks, block_size, {D}], got {list(kv.shape)}")
    nb, bs, _ = kv.shape
    _check(fmt, bs)
    cache = torch.zeros(nb, block_bytes(fmt, bs), dtype=torch.uint8, device=kv.device)
    write_tokens(cache, fmt, bs, torch.arange(nb * bs, device=kv.device), kv.reshape(nb * bs, D))
    return cache


def dequantize(cache, fmt: str, block_size: int):
    """float64 `[num_blocks, block_size, 512]` of a byte cache (NaN where the bytes say so)."""
    import torch

    _check(fmt, block_size)
    nb = cache.shape[0]
    return read_tokens(cache, fmt, block_size, torch.arange(nb * block_size, device=cache.device)).reshape(nb, block_size, D)


def poison_tokens(cache, fmt: str, block_size: int, index) -> None:
    """Fill every byte of tokens `index` with 0xFF, in place: NaN in every e4m3, bf16, fp32 and e8m0
        field (nvfp4: codes −6, but every scale NaN, so every value NaN)."""
    dpos, spos = _spans(fmt, block_size, index.to(cache.device))
    flat = cache.view(-1)
    flat[dpos.reshape(-1)] = 0xFF
    if spos.shape[1]:
        flat[spos.reshape(-1)] = 0xFF


def set_scale_exponents(cache, fmt: str, block_size: int, index: int, exps: list[int]) -> None:
    """Overwrite token `index`'s scales with 2^exps (model1 7, v4.1 16; simple one fp32 2^exps[0]),
        for the extreme-scale cases."""
    import torch

    flat = cache.view(-1)
    _, s0 = token_offsets(fmt, block_size, torch.tensor([index]))
    start = int(s0[0])
    if fmt == "simple":
        flat[start : start + 4] = torch.tensor([2.0 ** exps[0]], dtype=torch.float32).view(torch.uint8).to(cache.device)
        return
    if fmt == "nvfp4":
        raise ValueError("nvfp4's scales are e4m3, not powers of two: use set_nvfp4_scales")
    want = MODEL1_TILES if fmt == "model1" else V41_SCALES
    if len(exps) != want:
        raise ValueError(f"{fmt} has {want} scales per token, got {len(exps)}")
    flat[start : start + want] = e8m0_encode_exponent(torch.tensor(exps)).to(cache.device)


def set_nvfp4_scales(cache, block_size: int, index: int, scale_bytes: list[int]) -> None:
    """Overwrite nvfp4 token `index`'s 28 e4m3 scale bytes (for cases with extreme or subnormal
    scales a writer may store)."""
    import torch

    if len(scale_bytes) != NVFP4_SCALES:
        raise ValueError(f"nvfp4 has {NVFP4_SCALES} scales per token, got {len(scale_bytes)}")
    _, s0 = token_offsets("nvfp4", block_size, torch.tensor([index]))
    start = int(s0[0])
    cache.view(-1)[start : start + NVFP4_SCALES] = torch.tensor(scale_bytes, dtype=torch.uint8).to(cache.device)
