"""E sm90's nvfp4 dequantisation on the CPU, emulated bit for bit, equals oracles/kvcache.py's."""

from pathlib import Path

import pytest
import torch

from oracles import kvcache as kc
from stages.common import e2m1_bits as eb
from stages.E_sparse_decode import sm90
from tests.conftest import bf16_value as _bf16, compile_cases, planted, prmt as _prmt


def _to_bf16(x: float) -> float:
    return float(torch.tensor([x], dtype=torch.float64).to(torch.bfloat16).double()[0])


def _halves(word: int) -> tuple[float, float]:
    return _bf16(word), _bf16(word >> 16)


def _scale(word: int, byte: int) -> tuple[float, float]:
    """(F, Sb) of scale_factors."""
    t = ((_prmt(word, 0, eb.scale_select(byte)) << 4) & 0xFFFFFFFF) & eb.SCALE_MASK
    lo, hi = _halves(t)
    assert lo == hi or (lo != lo and hi != hi)
    sb = _to_bf16(lo * 2.0 ** 120)
    f = _to_bf16(sb * 2.0 ** 126) if abs(sb * 2.0 ** 126) < 2.0 ** 128 else float("inf") * (1 if sb >= 0 else -1)
    return f, sb


def _word(word: int, f: float, sb: float, one_multiply: bool) -> list[float]:
    """The 8 values of e2m1x8_to_bf16."""
    even, odd = eb.split(word)
    vals = []
    for k in range(4):
        bits = eb.bits_of_pair(_prmt(even, odd, eb.pair_select(k)))
        for v in _halves(bits):
            vals.append(_to_bf16(v * f) if one_multiply else _to_bf16(_to_bf16(v * 2.0 ** 126) * sb))
    return vals


def model_token(data: bytes, scales: bytes, group_byte=lambda b: b) -> dict[int, list[float]]:
    """column → [values written] for one token by its key's 4 threads; `group_byte` is the hook."""
    words = [int.from_bytes(scales[4 * i : 4 * i + 4], "little") for i in range(8)]
    one_multiply = all(eb.scales_fit(words[i]) == 0 for i in range(7))
    out: dict[int, list[float]] = {}
    t = sm90.Kernel.NVFP4_TAIL
    for q in range(4):
        for p in range(t):  # pieces 0 … 2: bytes 64·p + 16·q, words i
            sw = words[2 * p + q // 2]
            for i in range(4):
                f, sb = _scale(sw, group_byte(2 * (q % 2) + i // 2))
                w = int.from_bytes(data[64 * p + 16 * q + 4 * i : 64 * p + 16 * q + 4 * i + 4], "little")
                for c, v in enumerate(_word(w, f, sb, one_multiply)):
                    out.setdefault(128 * p + 32 * q + 8 * i + c, []).append(v)
        f, sb = _scale(words[6], group_byte(q))
        for i in range(2):  # tail: bytes 192 + 8·q
            w = int.from_bytes(data[64 * t + 8 * q + 4 * i : 64 * t + 8 * q + 4 * i + 4], "little")
            for c, v in enumerate(_word(w, f, sb, one_multiply)):
                out.setdefault(64 * 6 + 16 * q + 8 * i + c, []).append(v)
    return out


def _token(seed: int, scale_bytes: list[int]):
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(1, kc.D)
    x[0, kc.D_NOPE :] = torch.randn(kc.D_ROPE, generator=g)
    cache = kc.quantize(x.view(1, 1, kc.D), "nvfp4")
    flat = cache.view(-1)
    flat[: kc.NVFP4_NOPE] = torch.randint(0, 256, (kc.NVFP4_NOPE,), generator=g).to(torch.uint8)  # every code
    flat[kc.NVFP4_DATA : kc.NVFP4_DATA + kc.NVFP4_SCALES] = torch.tensor(scale_bytes, dtype=torch.uint8)
    return cache, bytes(flat[: kc.NVFP4_DATA].tolist()), bytes(flat[kc.NVFP4_DATA :].tolist())


SMALL = [0x01, 0x07, 0x08, 0x30, 0x38, 0x3F, 0x47, 0xB8, 0x00, 0x21, 0x44, 0x2A, 0x36, 0xC7] * 2  # all below 4
LARGE = [0x01, 0x7E, 0x07, 0x68, 0x48, 0x6F, 0x34, 0xFE, 0x3F, 0x00] * 2 + [0x50] * 8  # 4 … 448 too


@pytest.mark.parametrize("scale_bytes,one", [(SMALL, True), (LARGE, False)])
def test_thread_model_equals_the_oracle_column_for_column(scale_bytes, one):
    cache, data, scales = _token(1, scale_bytes)
    words = [int.from_bytes(scales[4 * i : 4 * i + 4], "little") for i in range(7)]
    assert all(eb.scales_fit(w) == 0 for w in words) == one  # which path the warp's vote takes
    got = model_token(data, scales)
    assert sorted(got) == list(range(kc.D_NOPE)) and all(len(v) == 1 for v in got.values())  # each column once
    want = kc.dequantize(cache, "nvfp4", 1)[0, 0, : kc.D_NOPE]
    assert [got[c][0] for c in range(kc.D_NOPE)] == want.tolist()  # exact: bf16(code · scale) = code · scale


def test_both_paths_agree_where_the_scale_is_below_4():
    for b in range(0x48):
        for s in (b, b | 0x80):
            f, sb = _scale(s, 0)
            w = 0xFEDCBA98 if s & 1 else 0x76543210  # every code
            assert _word(w, f, sb, True) == _word(w, f, sb, False), hex(s)


def test_scales_fit_is_the_byte_test():
    for b in range(256):
        word = b | (0x38 << 8) | (0x01 << 16) | (0xB0 << 24)
        assert (eb.scales_fit(word) == 0) == ((b & 0x7F) < 0x48), hex(b)


def test_a_neighbouring_groups_scale_moves_the_values():
    """wrong_e_nvfp4_group's hook changes the columns wherever the two scales differ."""
    cache, data, scales = _token(2, LARGE)
    good = model_token(data, scales)
    bad = model_token(data, scales, group_byte=lambda b: b ^ 1)
    moved = [c for c in range(kc.D_NOPE) if good[c] != bad[c]]
    assert len(moved) > 200


def test_the_pair_kernel_compiles_without_spills_and_converts_by_bit_moves(project_root, tmp_path, monkeypatch):
    """sm_90a h_q 128 pair: no spill, e2m1 codes, scale factors, two 16-byte scale loads."""
    from harness.spec.spec import load_spec

    case = dict(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="nvfp4", scenario="plain", splits=1, epilogue="bf16")
    (res,) = compile_cases(monkeypatch, tmp_path, load_spec(root=project_root).stages["E"], "sm_90a", [case])
    assert res.resources.get("spill", 0) == 0 and res.resources.get("stack", 0) == 0, res.resources
    ptx = Path(res.ptx_path).read_text()
    assert f"mul.lo.u32 t, t, {eb.SPREAD:#x}" in ptx and f"and.b32 t, t, {eb.MASK:#x}" in ptx
    assert f"mov.b32 c120, {eb.TWO_120:#x}" in ptx and f"mov.b32 c126, {eb.TWO_126:#x}" in ptx
    assert "@p ld.global.nc.v4.b32" in ptx and "@p ld.global.nc.L2::256B.v2.b32" in ptx  # scales; the 8-byte tail


def test_the_neighbouring_group_bug_moves_o_past_the_tolerances():
    """wrong_e_nvfp4_group's swap on the float64 oracle fails the tolerances in plain, sink and dup."""
    from oracles import sparse_decode as sd

    for scenario in ("plain", "sink", "dup"):
        case = dict(b=2, config="s1h64_m96bs64", kv_format="nvfp4", scenario=scenario, splits=1, epilogue="bf16")
        inputs = sd.make_inputs(case, seed=5)
        ref = sd.reference(inputs, case)["O"]
        kv = inputs["KV"].clone()
        _, _, sc = kc.nvfp4_views(kv, 64)
        sc[...] = sc.reshape(*sc.shape[:2], 14, 2).flip(-1).reshape(sc.shape)  # views of kv's bytes
        assert not torch.equal(kv, inputs["KV"])
        wrong = sd.reference({**inputs, "KV": kv}, case)["O"]
        fin = torch.isfinite(ref) & torch.isfinite(wrong)
        a, b = ref[fin], wrong[fin]
        cos = float(torch.dot(a, b) / (a.norm() * b.norm()))
        rel = float((a - b).norm() / a.norm())
        assert cos < 0.9999 and rel > 1e-2, (scenario, cos, rel)


def test_the_planted_bug_reaches_the_compiled_kernel(project_root, tmp_path, monkeypatch):
    """The fixture's hook is called: its PTX differs, same conversions."""
    from harness.spec.spec import load_spec

    spec = load_spec(root=project_root)
    case = dict(b=2, config="s1h64_m96bs64", kv_format="nvfp4", scenario="plain", splits=1, epilogue="bf16")
    ptx = [Path(compile_cases(monkeypatch, tmp_path, st, "sm_90a", [case])[0].ptx_path).read_text()
           for st in (spec.stages["E"], planted(spec, "E", "wrong_e_nvfp4_group"))]
    bodies = [p.replace(p.split(".entry", 1)[1].split("(", 1)[0].strip(), "K") for p in ptx]
    # h_q 64: same lookups, scales differ
    assert bodies[0].count("prmt.b32") == bodies[1].count("prmt.b32") > 0
    assert bodies[0] != bodies[1]


def test_the_table_path_gives_every_code_exactly():
    """e2m1_table=True's lookup gives the bf16 of every e2m1 code for all 65 536 groups of 4."""
    bf16 = {c: int(torch.tensor([float(SIGNED_VALUES[c])], dtype=torch.bfloat16).view(torch.int16).item()) & 0xFFFF
            for c in range(16)}
    for half in range(1 << 16):
        w01, w23 = eb.table_pair_words(half)
        c = [(half >> (4 * n)) & 0xF for n in range(4)]
        assert w01 == bf16[c[0]] | bf16[c[1]] << 16 and w23 == bf16[c[2]] | bf16[c[3]] << 16, hex(half)


SIGNED_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
