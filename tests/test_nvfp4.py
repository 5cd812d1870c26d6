"""oracles/kvcache.py's nvfp4 format: bytes, quantiser and dequantiser."""

import pytest
import torch

from oracles import kvcache as kc

SIGNED = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=torch.float64)  # e2m1 codes 0 … 15 in order


def _token_bytes(cache, bs, index):
    """(data, scales) bytes of token `index` by the layout's arithmetic."""
    blk, off = divmod(index, bs)
    row = cache[blk]
    return row[off * 352 : off * 352 + 352], row[bs * 352 + off * 32 : bs * 352 + off * 32 + 32]


def test_e2m1_decode_is_the_table_and_encode_inverts_it():
    codes = torch.arange(16)
    assert torch.equal(kc.e2m1_decode(codes), SIGNED)
    assert torch.equal(torch.signbit(kc.e2m1_decode(codes)), codes >= 8)  # code 8 is −0
    assert torch.equal(kc.e2m1_encode(SIGNED), codes)


def test_e2m1_rounds_to_nearest_even_and_saturates():
    # midpoints round to even mantissa
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 5.01, 6.5, 1e9, -0.1, -5.0, -7.0],
                     dtype=torch.float64)
    want = [0, 2, 2, 4, 4, 6, 6, 1, 1, 7, 7, 7, 8, 14, 15]
    assert kc.e2m1_encode(y).tolist() == want


@pytest.mark.parametrize("bs", [1, 2, 3, 64, 256])
def test_block_is_384_bytes_a_token_data_plane_then_scale_plane(bs):
    assert kc.block_bytes("nvfp4", bs) == 384 * bs
    assert (kc.NVFP4_NOPE, kc.NVFP4_DATA, kc.NVFP4_SCALE_BYTES, kc.NVFP4_TOKEN, kc.NVFP4_SCALES) == (224, 352, 32, 384, 28)
    d0, s0 = kc.token_offsets("nvfp4", bs, torch.tensor([0, bs - 1, bs]))
    assert d0.tolist() == [0, (bs - 1) * 352, 384 * bs]
    assert s0.tolist() == [bs * 352, bs * 352 + (bs - 1) * 32, 384 * bs + bs * 352]


def test_every_code_times_every_e4m3_scale_round_trips_exactly():
    """Every code × every positive e4m3 s, and a zero group: the scale is s, dequantising is exact."""
    scale_bytes = list(range(0x01, 0x7F)) + [0]  # 126 scales and a zero group: 127 groups
    s = kc.e4m3_decode(torch.tensor(scale_bytes, dtype=torch.uint8))
    groups = SIGNED[None, :] * s[:, None]  # [127, 16]; the zero group's −0s stay −0
    n_tok = -(-len(scale_bytes) // kc.NVFP4_SCALES)  # 5 tokens
    nope = torch.zeros(n_tok * kc.NVFP4_SCALES, 16, dtype=torch.float64)
    nope[: len(scale_bytes)] = groups
    x = torch.zeros(n_tok, kc.D, dtype=torch.float64)
    x[:, : kc.D_NOPE] = nope.reshape(n_tok, kc.D_NOPE)
    x[:, kc.D_NOPE :] = torch.randn(n_tok, kc.D_ROPE, generator=torch.Generator().manual_seed(0))
    data, scales = kc.encode_tokens(x, "nvfp4")
    assert scales[:, : kc.NVFP4_SCALES].reshape(-1)[: len(scale_bytes)].tolist() == scale_bytes
    assert not bool(scales[:, kc.NVFP4_SCALES :].any())  # the 4 pad bytes are 0
    packed = data[:, : kc.NVFP4_NOPE].reshape(-1, 8).to(torch.int64)
    assert bool((packed[:126] == torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])).all())  # codes 0 … 15
    assert packed[126].tolist() == [0x00] * 4 + [0x88] * 4  # the zero group: codes ±0 (x's signs kept)
    cache = kc.quantize(x.view(1, n_tok, kc.D), "nvfp4")
    y = kc.dequantize(cache, "nvfp4", n_tok).view(n_tok, kc.D)
    assert torch.equal(y[:, : kc.D_NOPE], x[:, : kc.D_NOPE])
    assert torch.equal(torch.signbit(y[:, : kc.D_NOPE]), torch.signbit(x[:, : kc.D_NOPE]))
    assert torch.equal(y[:, kc.D_NOPE :], x[:, kc.D_NOPE :].to(torch.bfloat16).double())  # rope in bf16


def test_flashinfer_known_encoding():
    """FlashInfer's known encoding: 0, −0, …, 6, −6 pack to 0x80, …, 0xF7; scale byte 0x38."""
    x = torch.zeros(1, kc.D)
    x[0, :16] = torch.tensor([0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0, 6.0, -6.0])
    data, scales = kc.encode_tokens(x, "nvfp4")
    assert data[0, :8].tolist() == [0x80, 0x91, 0xA2, 0xB3, 0xC4, 0xD5, 0xE6, 0xF7]
    assert int(scales[0, 0]) == 0x38
    assert not bool(scales[0, 1:].any())  # the other 27 groups are zero: scale 0


def test_scale_rule_and_saturation():
    """scale = e4m3(amax / 6), nearest even, saturating at 448."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, kc.D, generator=g) * torch.pow(2.0, torch.randint(-12, 12, (8, 1), generator=g).float())
    x[0, :16] = 1e5  # saturates
    _, scales = kc.encode_tokens(x, "nvfp4")
    amax = x[:, : kc.D_NOPE].double().reshape(8, 28, 16).abs().amax(-1)
    want = (amax / 6).clamp(max=448).float().to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(scales[:, :28], want)
    assert int(scales[0, 0]) == 0x7E


def test_hand_made_bytes_dequantise_bit_exactly():
    """Hand-written bytes read back as code · scale: normal, subnormal, negative, zero scales."""
    bs = 3
    cache = torch.zeros(2, kc.block_bytes("nvfp4", bs), dtype=torch.uint8)
    g = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (224,), generator=g).to(torch.uint8)
    sc = torch.tensor([0x01, 0x07, 0x08, 0x38, 0x7E, 0xB8, 0x00] * 4, dtype=torch.uint8)
    rope = torch.randn(64, generator=g).to(torch.bfloat16)
    data, scales = _token_bytes(cache, bs, 5)
    data[:224] = packed
    data[224:] = rope.view(torch.uint8)
    scales[:28] = sc
    y = kc.read_tokens(cache, "nvfp4", bs, torch.tensor([5]))[0]
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=1).reshape(-1)  # value 2i in the low nibble of byte i
    svals = {0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0, 0x7E: 448.0, 0xB8: -1.0, 0x00: 0.0}
    want = torch.tensor([SIGNED[c].item() * svals[int(sc[i // 16])] for i, c in enumerate(codes.tolist())], dtype=torch.float64)
    assert torch.equal(y[:448], want)
    assert torch.equal(y[448:], rope.double())
    nope, rope_v, sc_v = kc.nvfp4_views(cache, bs)
    assert torch.equal(nope[1, 2], packed) and torch.equal(rope_v[1, 2], rope) and torch.equal(sc_v[1, 2], sc)


def test_poisoned_tokens_read_nan_in_every_column_and_others_do_not():
    bs = 4
    x = torch.randn(2, bs, kc.D, generator=torch.Generator().manual_seed(3))
    cache = kc.quantize(x, "nvfp4")
    kc.poison_tokens(cache, "nvfp4", bs, torch.tensor([1, 6]))
    y = kc.dequantize(cache, "nvfp4", bs).view(2 * bs, kc.D)
    mask = torch.zeros(2 * bs, dtype=torch.bool)
    mask[[1, 6]] = True
    assert bool(y[mask].isnan().all()) and bool(torch.isfinite(y[~mask]).all())


def test_round_trip_error_is_half_an_e2m1_step_of_the_group_plus_scale_rounding():
    x = torch.randn(3, 64, kc.D, generator=torch.Generator().manual_seed(4))
    x[:, :, :5] *= 30.0
    y = kc.dequantize(kc.quantize(x, "nvfp4"), "nvfp4", 64)
    g = x[..., : kc.D_NOPE].double().reshape(3, 64, 28, 16)
    amax = g.abs().amax(-1, keepdim=True)
    err = (y[..., : kc.D_NOPE].reshape(g.shape) - g).abs()
    # half e2m1's widest step, plus clipping
    assert bool((err <= amax / 6 * (1 + 2.0 ** -4) + amax * 2.0 ** -4 + 1e-12).all())


def test_fp8_scale_setters_refuse_nvfp4_and_the_nvfp4_setter_writes_its_bytes():
    bs = 2
    cache = kc.quantize(torch.randn(2, bs, kc.D, generator=torch.Generator().manual_seed(5)), "nvfp4")
    with pytest.raises(ValueError, match="set_nvfp4_scales"):
        kc.set_scale_exponents(cache, "nvfp4", bs, 3, [0] * 28)
    kc.set_nvfp4_scales(cache, bs, 3, [0x01] * 28)
    assert kc.nvfp4_views(cache, bs)[2][1, 1].tolist() == [0x01] * 28
