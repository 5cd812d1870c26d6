"""stages/common/e4m3_bits.py gives round(e4m3 · 2^(e − 127)) to bf16 exactly, for every byte pair."""

import numpy as np
import pytest

from stages.common import e4m3_bits as eb
from tests.conftest import bf16_value as _bf16, prmt


def _exact_bf16_product(x: float, m: float) -> float:
    """x · m, asserting no rounding."""
    y = x * m
    f = np.float32(y)
    assert float(f) == y
    bits = int(np.array([f], dtype=np.float32).view(np.uint32)[0])
    assert bits & 0xFFFF == 0, (x, m)  # representable in bf16
    return y


def _recipe(byte: int, e: int) -> float:
    word = byte * 0x01010101  # the byte in all four places
    m1, m2 = (m & 0xFFFF for m in eb.factors(e))
    t = (prmt(word, 0, eb.SELECT_LO) << 4) & eb.HALF_MASK & 0xFFFFFFFF
    x = _bf16(t & 0xFFFF)
    assert _bf16(t >> 16) == x
    other = (prmt(word & 0xFFFF0000, 0, eb.SELECT_HI) << 4) & eb.HALF_MASK & 0xFFFFFFFF  # bytes 2, 3 only
    assert other == t
    return _exact_bf16_product(_exact_bf16_product(x, _bf16(m1)), _bf16(m2))


E4M3 = [b for b in range(256) if b & 0x7F != 0x7F]  # every e4m3 but the NaNs


@pytest.mark.parametrize("e", [3, 60, 107, 120, 127, 134, 135, 142, 160])  # e < 3: e4m3 subnormals fall below bf16's
def test_recipe_is_the_scaled_e4m3_exactly(e):
    for byte in E4M3:
        want = _e4m3(byte)
        got = _recipe(byte, e)
        assert got == want * 2.0 ** (e - 127), (hex(byte), e, got, want)
        assert (np.signbit(got) == bool(byte & 0x80))


def _e4m3(byte: int) -> float:
    s = -1.0 if byte & 0x80 else 1.0
    ex, m = (byte >> 3) & 0xF, byte & 7
    return s * (m / 8 * 2.0 ** -6 if ex == 0 else (1 + m / 8) * 2.0 ** (ex - 7))


def test_reference_decoder_agrees_with_torch():
    torch = pytest.importorskip("torch")
    t = torch.tensor(E4M3, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    assert t == [_e4m3(b) for b in E4M3]


def test_factors_are_normal_bf16_powers_of_two():
    for e in range(1, 255):
        words = eb.factors(e)
        assert all(w >> 16 == w & 0xFFFF for w in words)  # both halves of each bf16x2 word alike
        m1, m2 = (w & 0xFFFF for w in words)
        for m in (m1, m2):
            assert 0 < (m >> 7) < 255 and m & 0x7F == 0  # a normal bf16, mantissa 0
        assert _bf16(m1) * _bf16(m2) == 2.0 ** (e - 7)


def test_one_multiply_drops_only_a_factor_of_one():
    """The one-multiply path skips × m2 only where m2 is 1.0."""
    for e in range(1, 255):
        m2 = eb.factors(e)[1] & 0xFFFF
        assert (m2 == 0x3F80) == bool(eb.one_multiply_fits(e)), e
    assert eb.one_multiply_fits(127) and eb.one_multiply_fits(134) and not eb.one_multiply_fits(135)
