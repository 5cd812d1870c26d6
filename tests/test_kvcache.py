"""oracles/kvcache.py: FP8 cache formats' bytes, quantisers, dequantisers."""

import pytest
import torch

from oracles import kvcache as kc

FP8 = [f for f in kc.FORMATS if f != "nvfp4"]  # the e4m3 formats (nvfp4: tests/test_nvfp4.py)


def _kv(nb, bs, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nb, bs, kc.D, generator=g) * spread
    x[:, :, :3] *= 40.0  # a few large columns: per-tile scales differ
    return x


@pytest.mark.parametrize("fmt,bs,want", [
    ("model1", 64, 65 * 576), ("model1", 2, 1728), ("model1", 256, 260 * 576),
    ("model1", 72, 73 * 576), ("v4.1", 64, 64 * 528), ("v4.1", 2, 1056), ("simple", 2, 1040), ("simple", 64, 64 * 516),
    ("nvfp4", 64, 64 * 384), ("nvfp4", 2, 768), ("nvfp4", 256, 256 * 384),
])
def test_block_bytes(fmt, bs, want):
    assert kc.block_bytes(fmt, bs) == want
    assert kc.block_size_of(fmt, want) == bs


def test_model1_block_is_multiple_of_576_and_holds_its_tokens():
    for bs in (1, 2, 3, 61, 64, 71, 72, 73, 256):
        bb = kc.block_bytes("model1", bs)
        assert bb % 576 == 0 and bb >= bs * 584 and bb - bs * 584 < 576


def test_e4m3_decode_matches_torch_on_every_byte():
    b = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    ours = kc.e4m3_decode(b)
    theirs = b.view(torch.float8_e4m3fn).double()
    same = (ours == theirs) | (ours.isnan() & theirs.isnan())
    assert bool(same.all())
    assert ours[0x7E] == 448.0 and ours[0x01] == 2.0 ** -9


def test_e8m0_decode_matches_torch_and_extremes():
    b = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    ours = kc.e8m0_decode(b)
    theirs = b.view(torch.float8_e8m0fnu).double()
    same = (ours == theirs) | (ours.isnan() & theirs.isnan())
    assert bool(same.all())
    for e in (-20, -14, 0, 15):
        assert kc.e8m0_decode(kc.e8m0_encode_exponent(torch.tensor([e])))[0] == 2.0 ** e


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("bs", [2, 64])
def test_round_trip_error_is_e4m3_rounding(fmt, bs):
    x = _kv(3, bs, seed=1)
    cache = kc.quantize(x, fmt)
    assert cache.dtype == torch.uint8 and tuple(cache.shape) == (3, kc.block_bytes(fmt, bs))
    y = kc.dequantize(cache, fmt, bs)
    assert tuple(y.shape) == (3, bs, kc.D) and bool(torch.isfinite(y).all())
    group = {"simple": kc.D, "model1": kc.MODEL1_TILE, "v4.1": kc.V41_GROUP}[fmt]
    xd = x.double()
    # half an ulp at the group's amax + subnormal step
    g = xd[..., : (kc.D_NOPE if fmt == "model1" else kc.D)].reshape(3, bs, -1, group if fmt != "simple" else kc.D)
    amax = g.abs().amax(dim=-1, keepdim=True)
    err = (y[..., : g.shape[-2] * g.shape[-1]].reshape(g.shape) - g).abs()
    assert bool((err <= amax * 2.0 ** -4 + 1e-12).all())
    if fmt == "model1":  # rope kept in bf16
        assert torch.equal(y[..., kc.D_NOPE:], x[..., kc.D_NOPE:].to(torch.bfloat16).double())


@pytest.mark.parametrize("fmt", ["model1", "v4.1"])
def test_power_of_two_scales_follow_flashmla_rule(fmt):
    x = _kv(2, 4, seed=2)
    cache = kc.quantize(x, fmt)
    if fmt == "model1":
        _, _, sc = kc.model1_views(cache, 4)
        tiles = x[..., : kc.D_NOPE].reshape(2, 4, 7, 64)
    else:
        _, sc = kc.v41_views(cache, 4)
        tiles = x.reshape(2, 4, 16, 32)
    amax = tiles.abs().amax(dim=-1).double()
    want = torch.pow(2.0, torch.ceil(torch.log2(torch.clamp_min(amax / 448.0, 1e-4))))
    assert torch.equal(kc.e8m0_decode(sc), want)


def test_values_that_are_exact_in_e4m3_round_trip_exactly():
    """Values on the e4m3 grid come back exact."""
    g = torch.Generator().manual_seed(3)
    for fmt in ("model1", "v4.1"):
        group = 64 if fmt == "model1" else 32
        for e in (-13, -1, 0, 7, 15):
            q = torch.randint(0, 0x7E, (1, 2, kc.D), generator=g).to(torch.uint8)  # positive e4m3 bytes, no NaN
            vals = kc.e4m3_decode(q)
            vals.view(1, 2, -1, group)[..., 0] = 448.0  # every group's amax is 448 · 2^e exactly
            x = vals * 2.0 ** e
            cache = kc.quantize(x, fmt)
            y = kc.dequantize(cache, fmt, 2)
            n = kc.D_NOPE if fmt == "model1" else kc.D
            assert torch.equal(y[..., :n], x[..., :n]), (fmt, e)


@pytest.mark.parametrize("fmt", FP8)
def test_extreme_written_scales_dequantise_exactly(fmt):
    """Any power-of-two scale 2^-20 … 2^15."""
    x = _kv(2, 2, seed=4)
    cache = kc.quantize(x, fmt)
    n = {"simple": 1, "model1": 7, "v4.1": 16}[fmt]
    exps = [(-20, 15, -7, 3, 0, -1, 9, -20, 15, 12, -18, 5, 1, -3, 14, -11)[i] for i in range(n)]
    kc.set_scale_exponents(cache, fmt, 2, 3, exps)  # token 3 = block 1, offset 1
    y = kc.dequantize(cache, fmt, 2)
    if fmt == "simple":
        vals, _ = kc.simple_views(cache, 2)
        assert torch.equal(y[1, 1], kc.e4m3_decode(vals[1, 1]) * 2.0 ** exps[0])
    elif fmt == "model1":
        nope, rope, _ = kc.model1_views(cache, 2)
        want = kc.e4m3_decode(nope[1, 1]).view(7, 64) * torch.tensor([2.0 ** e for e in exps], dtype=torch.float64)[:, None]
        assert torch.equal(y[1, 1, :448], want.flatten())
        assert torch.equal(y[1, 1, 448:], rope[1, 1].double())
    else:
        vals, _ = kc.v41_views(cache, 2)
        want = kc.e4m3_decode(vals[1, 1]).view(16, 32) * torch.tensor([2.0 ** e for e in exps], dtype=torch.float64)[:, None]
        assert torch.equal(y[1, 1], want.flatten())
    assert torch.equal(y[0], kc.dequantize(kc.quantize(x, fmt), fmt, 2)[0])  # other tokens untouched


def test_model1_layout_bytes_by_hand():
    """Token t: e4m3 at t·576, rope at t·576 + 448, scales at bs·576 + t·8."""
    bs = 3
    x = _kv(2, bs, seed=5)
    cache = kc.quantize(x, "model1")
    blk, off = 1, 2
    row = cache[blk]
    nope = row[off * 576 : off * 576 + 448]
    rope = row[off * 576 + 448 : off * 576 + 576].contiguous().view(torch.bfloat16)
    sc = row[bs * 576 + off * 8 : bs * 576 + off * 8 + 7]
    y = kc.e4m3_decode(nope).view(7, 64) * kc.e8m0_decode(sc)[:, None]
    assert torch.equal(kc.dequantize(cache, "model1", bs)[blk, off], torch.cat([y.flatten(), rope.double()]))
    assert int(row[bs * 576 + off * 8 + 7]) == 0  # the pad byte


def test_model1_flashmla_view_strides():
    cache = kc.quantize(_kv(3, 64), "model1")
    v = kc.model1_flashmla_view(cache, 64)
    assert tuple(v.shape) == (3, 64, 1, 584) and v.stride() == (65 * 576, 584, 584, 1)
    assert v.data_ptr() == cache.data_ptr()


def test_poison_tokens_makes_exactly_those_tokens_nan():
    for fmt in kc.FORMATS:
        cache = kc.quantize(_kv(2, 4, seed=6), fmt)
        mask = torch.zeros(8, dtype=torch.bool)
        mask[[1, 6]] = True
        kc.poison_tokens(cache, fmt, 4, torch.tensor([1, 6]))
        y = kc.dequantize(cache, fmt, 4).view(8, kc.D)
        assert bool(y[mask].isnan().all()) and bool(torch.isfinite(y[~mask]).all()), fmt


def test_wrong_format_or_bytes_refused():
    with pytest.raises(ValueError):
        kc.block_bytes("fp4", 64)
    with pytest.raises(ValueError):
        kc.dequantize(torch.zeros(2, 100, dtype=torch.uint8), "model1", 64)


@pytest.mark.parametrize("fmt", kc.FORMATS)
def test_write_read_tokens_touch_only_their_tokens(fmt):
    """Tokens written one by one equal the whole-cache bytes."""
    bs = 3
    x = _kv(2, bs, seed=7)
    whole = kc.quantize(x, fmt)
    cache = torch.zeros_like(whole)
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    kc.write_tokens(cache, fmt, bs, order, x.reshape(6, kc.D)[order])
    assert torch.equal(cache, whole)
    assert torch.equal(kc.read_tokens(cache, fmt, bs, torch.tensor([5, 1])),
                       kc.dequantize(whole, fmt, bs).reshape(6, kc.D)[[5, 1]])
