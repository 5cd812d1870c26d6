"""Stage E's fused FP8 epilogue, oracle side: rotation, exponent rule, layout, metric; planted bugs fail."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from harness.execution.compile import ptxas_resources
from harness.execution.metrics import POISON_BITS, compare, judge, poison_
from harness.spec.spec import load_spec
from oracles import fp8_epilogue as fe
from oracles import sparse_decode as sd
from tests.conftest import compile_cases, e_sm90_builds

CASE = {"b": 2, "config": "s2h64_m128bs256_x512bs64", "kv_format": "model1", "scenario": "lonely", "splits": 1,
        "epilogue": "fp8_rope"}


def test_poison_matches_the_harness():
    assert fe.POISON_F32 == POISON_BITS["float32"]


def test_inverse_rotation_undoes_the_forward_one_and_moves_only_the_rope_lanes():
    g = torch.Generator().manual_seed(1)
    o = torch.randn(6, 8, 512, generator=g, dtype=torch.float64)
    cs = fe.make_cos_sin_cache()
    pos = torch.tensor([0, 1, 7, 100, 2047, 4095])
    fwd = fe.rotate(o, cs, pos, inverse=False)
    assert torch.equal(fwd[..., :448], o[..., :448])
    assert torch.equal(fwd[0], o[0])  # position 0: no rotation
    assert (fwd[1:, :, 448:] - o[1:, :, 448:]).abs().max() > 0.1
    back = fe.rotate(fwd, cs, pos)
    assert (back - o).abs().max() < 1e-6  # fp32 cos/sin: cos² + sin² = 1 to ~1e-7
    # the inverse is the conjugate
    x = torch.zeros(1, 1, 512, dtype=torch.float64)
    x[..., 448], x[..., 449] = 1.0, 0.0
    y = fe.rotate(x, cs, torch.tensor([5]))
    c, s = float(cs[5, 0]), float(cs[5, 32])
    assert y[0, 0, 448].item() == pytest.approx(c) and y[0, 0, 449].item() == pytest.approx(-s)
    # 32 cos then 32 sin of θ_i = p · 10000^(−2i/64)
    assert float(cs[5, 3]) == pytest.approx(math.cos(5 * 10000 ** (-6 / 64)), abs=1e-6)
    assert float(cs[5, 35]) == pytest.approx(math.sin(5 * 10000 ** (-6 / 64)), abs=1e-6)


def test_exponent_rule_on_edge_values():
    def exp_of(amax: float) -> int:
        o = torch.zeros(512, dtype=torch.float64)
        o[3] = amax
        return int(fe.block_exponents(o)[0])

    assert exp_of(0.0) == fe.ZERO_BLOCK_EXP == -22  # an all-zero block: the 1e-4 floor
    assert exp_of(448.0) == 0 and exp_of(448.0 * (1 + 2**-20)) == 1  # a power of two: its own exponent
    assert exp_of(448.0 * 2**-5) == -5 and exp_of(448.0 * 2**-5 * 0.999) == -5
    assert exp_of(1e-9) == -22  # below the floor
    assert exp_of(-300.0) == 0  # |x|
    ref = fe.exponent_reference(torch.tensor([448.0 * 2**-3] + [0.0] * 511, dtype=torch.float64))
    assert float(ref[0]) == -2.5  # either −3 or −2 passes
    assert float(ref[1]) == -22.0
    ref = fe.exponent_reference(torch.tensor([448.0 * 2**-3 * 1.1] + [0.0] * 511, dtype=torch.float64))
    assert float(ref[0]) == -2.0  # outside the band: exact


def test_pack_and_decode_round_trip_and_layout():
    g = torch.Generator().manual_seed(2)
    b, s_q, h_q = 3, 2, 16
    o = torch.randn(b, s_q, h_q, 512, generator=g, dtype=torch.float64) * torch.pow(2.0, torch.randint(-6, 3, (b, s_q, h_q, 1), generator=g).double())
    o[1, 0, 5] = 0.0
    q, e = fe.quantise(o)
    out, scales = fe.pack(q, e, b, s_q, h_q)
    assert out.shape == (2, 6, 8, 512) and scales.shape == (2, 8, 8) and scales.dtype == torch.int32
    # head 13 of token (1, 0): group 1, slot 5
    assert torch.equal(out[1, 2, 5], q[1, 0, 13])
    word = int(scales[1, 5, 2]) & 0xFFFFFFFF
    assert [(word >> (8 * k)) & 0xFF for k in range(4)] == [int(x) + 127 for x in e[1, 0, 13]]
    assert int(scales[0, 0, 7]) == 0  # align-4 pad
    vals, e2 = fe.unpack(out, scales, b, s_q, h_q)
    assert torch.equal(e2, e)
    assert float(vals[1, 0, 5].abs().max()) == 0.0 and int(e[1, 0, 5, 0]) == -22
    o_w, s_w = fe.words_of(out, scales)
    dec, ex = fe.decode_words(o_w, s_w, b, s_q, h_q)
    assert torch.equal(dec.double(), vals) and torch.equal(ex, e.float())
    rel = float((vals - o).norm() / o.norm())
    assert 0.005 < rel < 0.04  # e4m3's 3 mantissa bits


def test_unwritten_words_stay_unwritten_after_decode():
    b, s_q, h_q = 1, 2, 8
    o_w = poison_(torch.empty(1, 2, 8, 128))
    s_w = poison_(torch.empty(1, 8, 4))
    s_w.view(torch.int32)[:, :, :2] = 0x7F7F7F7F  # every exponent 0
    o_w.view(torch.int32)[0, 0] = 0  # token 0's values written (zeros); token 1's not
    dec, ex = fe.decode_words(o_w, s_w, b, s_q, h_q)
    ref = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    m = compare(dec, ref)
    assert m.unwritten == 8 * 512 and compare(ex, torch.zeros(b, s_q, h_q, 4)).unwritten == 0


def _kernel_like(inputs, case, sign: float = 1.0, exp_shift: int = 0):
    """An exact fp8_rope kernel's words; `exp_shift` moves one block's exponent."""
    c = sd.SparseConfig.parse(case["config"])
    bf = dict(case, epilogue="bf16")
    o = sd.reference(inputs, bf)["O"]  # the unrotated float64 rows
    b = case["b"]
    o = fe.rotate(o.reshape(b * c.s_q, c.h_q, 512), inputs["cos_sin_cache"], inputs["positions"], sign=sign).view(o.shape)
    q, e = fe.quantise(o)
    if exp_shift:  # a block whose exponent is unambiguous
        at = (fe.exponent_reference(o) == e.double()).nonzero()[0].tolist()
        e[tuple(at)] += exp_shift
    out, scales = fe.pack(q, e, b, c.s_q, c.h_q)
    o_w, s_w = fe.words_of(out, scales)
    return {"O_fp8": o_w, "O_scale": s_w, "LSE": sd.reference(inputs, bf)["LSE"].float()}


def _verdict(outputs, inputs, case):
    import pathlib
    stage = load_spec(pathlib.Path(__file__).resolve().parents[1] / "stages.yaml").stage("E")
    ref = sd.reference(inputs, case)
    got = sd.decode(outputs, case)
    assert set(got) == set(ref)
    metrics = {k: compare(got[k], ref[k]).to_json() for k in ref}
    return judge(stage.tolerances_for(case), metrics), metrics


@pytest.mark.parametrize("scenario", ["lonely", "sink_inf", "extreme"])
def test_an_exact_kernel_passes_the_stage_tolerances(scenario):
    case = dict(CASE, scenario=scenario)
    inputs = sd.make_inputs(case, seed=11)
    (status, why), metrics = _verdict(_kernel_like(inputs, case), inputs, case)
    assert status == "pass", (why, metrics)
    assert metrics["O"]["rel_l2"] < 0.035 and metrics["O_scale"]["max_abs"] <= 0.5


def test_a_wrong_sign_rotation_fails_the_metric():
    """wrong_e_rope_sign's bug on the oracle side (forward rotation): the lab says fail."""
    case = dict(CASE, scenario="sink")
    inputs = sd.make_inputs(case, seed=12)
    (status, why), metrics = _verdict(_kernel_like(inputs, case, sign=-1.0), inputs, case)
    assert status == "fail" and why.startswith("O:"), (why, metrics)


def test_a_wrong_exponent_fails_the_metric():
    case = dict(CASE, scenario="plain")
    inputs = sd.make_inputs(case, seed=13)
    (status, why), _ = _verdict(_kernel_like(inputs, case, exp_shift=1), inputs, case)
    assert status == "fail" and "O_scale: max_abs" in why, why


def test_bf16_cases_keep_their_inputs_and_outputs():
    """The epilogue axis draws its inputs last: bf16 cases as before, O_scale empty."""
    case = dict(CASE, epilogue="bf16", scenario="sink")
    a = sd.make_inputs(case, seed=5)
    b = sd.make_inputs({k: v for k, v in case.items() if k != "epilogue"}, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    specs = {s.name: s for s in sd.tensors(case)}
    assert specs["O"].role == "out" and specs["O_fp8"].role == "scratch" and specs["O_scale"].role == "scratch"
    specs8 = {s.name: s for s in sd.tensors(dict(case, epilogue="fp8_rope"))}
    assert specs8["O"].role == "scratch" and specs8["O_fp8"].shape == (8, 4, 8, 128) and specs8["O_scale"].shape == (8, 8, 4)
    ref = sd.reference(a, case)
    assert ref["O_scale"].numel() == 0


# -- compiled (sm_90a on the CPU)


def test_sm90_fp8_epilogue_compiles_without_spills_and_the_planted_sign_reaches_it(project_root, tmp_path, monkeypatch):
    """fp8_rope model1 h_q 64 splits 3, sm_90a: no spills, e4m3 conversions; wrong_e_rope_sign reaches it."""
    case = dict(b=2, config="s2h64_m128bs256_x512bs64", kv_format="model1", scenario="sink", splits=3, epilogue="fp8_rope")
    got = [e_sm90_builds(tmp_path / (name or "stage"), monkeypatch, [case], name)[0] for name in ("", "wrong_e_rope_sign")]
    (ptx, res), (wrong, _) = got
    assert res.get("spill", 0) == 0, res
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 2 * 64 + 8
    assert "st.global.v4.b32" in ptx  # PartCombine's 16-byte stores of e4m3

    def body(text):  # kernel names set aside
        import re

        for name in re.findall(r"\.entry\s+(\S+?)\(", text):
            text = text.replace(name, "K")
        return text

    assert wrong.count("cvt.rn.satfinite.e4m3x2.f32") == ptx.count("cvt.rn.satfinite.e4m3x2.f32")
    assert body(ptx) != body(wrong)


def test_the_kernels_addresses_and_exponent_bits_agree_with_the_oracle():
    """The kernel's byte offsets and exponent rule match oracles/fp8_epilogue.py."""
    from stages.common import fp8_epilogue as ke

    g = torch.Generator().manual_seed(3)
    b, s_q, h_q = 3, 2, 24
    q = torch.randint(0, 0x7E, (b, s_q, h_q, 512), generator=g).to(torch.uint8)
    e = torch.randint(-30, 10, (b, s_q, h_q, 4), generator=g)
    out, scales = fe.pack(q, e, b, s_q, h_q)
    flat_o, flat_s = out.reshape(-1), scales.contiguous().view(torch.uint8).reshape(-1)
    for row in range(b * s_q * h_q):
        i, t, h = row // (s_q * h_q), (row // h_q) % s_q, row % h_q
        at = ke.value_offset(row, h_q, b * s_q)
        assert torch.equal(flat_o[at:at + 512], q[i, t, h])
        at = ke.scale_offset(row, h_q, b * s_q)
        assert flat_s[at:at + 4].tolist() == (e[i, t, h] + 127).tolist()
    amax = torch.cat([torch.tensor([0.0, 1e-9, 1e-4, 448.0, 448.0 * 2**-7, 3.5e4]),
                      torch.exp(torch.empty(4000).uniform_(-25, 12, generator=g))]).float()
    for a in amax.tolist():
        o = torch.zeros(512, dtype=torch.float64)
        o[0] = a
        ref = float(fe.exponent_reference(o)[0])
        got = ke.ue8m0_of(a) - 127
        assert got == ref or (ref % 1 and abs(got - ref) == 0.5), (a, got, ref)


def test_sm100_fp8_epilogue_compiles_without_spills(project_root, tmp_path, monkeypatch):
    """sm_100a: the one-split and SplitCombine epilogues' conversions and stores, no spills."""
    cases = [dict(b=2, config="s2h64_m128bs256_x512bs64", kv_format="model1", scenario="sink", splits=splits,
                  epilogue="fp8_rope") for splits in (1, 4)]
    got = {c["splits"]: (Path(r.ptx_path).read_text(), ptxas_resources(Path(r.ptx_path), "sm_100a"))
           for c, r in zip(cases, compile_cases(monkeypatch, tmp_path, load_spec(root=project_root).stages["E"],
                                                "sm_100a", cases))}
    one, split = got[1][0], got[4][0]
    assert all(r.get("spill", 0) == 0 for _, r in got.values()), [r for _, r in got.values()]
    assert one.count("cvt.rn.satfinite.e4m3x2.f32") == 128 and one.count("st.global.v4.b32") == 16
    assert split.count("st.global.b8") == 16 and split.count("cvt.rn.satfinite.e4m3x2.f32") == 16
