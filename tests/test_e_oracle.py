"""Stage E's contract: sparse_decode.py vs a per-row loop, semantics, planted bugs."""

import math

import pytest
import torch

from oracles import kvcache as kc
from oracles import sparse_decode as sd

SMALL = "s2h4_m70bs2_x9bs3"  # two branches, odd topk, tiny blocks


def _case(fmt, scenario, config=SMALL, b=3):
    return dict(b=b, config=config, kv_format=fmt, scenario=scenario, splits=1)


def _token_by_hand(cache, fmt, bs, index):
    """One token's 512 values via torch's float8 views."""
    blk, off = divmod(int(index), bs)
    row = cache[blk]
    if fmt == "simple":
        q = row[off * 512 : off * 512 + 512].view(torch.float8_e4m3fn).double()
        return q * row[bs * 512 + off * 4 : bs * 512 + off * 4 + 4].view(torch.float32).double()
    if fmt == "model1":
        q = row[off * 576 : off * 576 + 448].view(torch.float8_e4m3fn).double().view(7, 64)
        s = row[bs * 576 + off * 8 : bs * 576 + off * 8 + 7].view(torch.float8_e8m0fnu).double()
        rope = row[off * 576 + 448 : off * 576 + 576].view(torch.bfloat16).double()
        return torch.cat([(q * s[:, None]).flatten(), rope])
    if fmt == "nvfp4":  # 16 e2m1 codes, low nibble first
        lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
        p = row[off * 352 : off * 352 + 224].long()
        q = lut[torch.stack([p & 15, p >> 4], dim=1).flatten()].view(28, 16)
        s = row[bs * 352 + off * 32 : bs * 352 + off * 32 + 28].view(torch.float8_e4m3fn).double()
        rope = row[off * 352 + 224 : off * 352 + 352].view(torch.bfloat16).double()
        return torch.cat([(q * s[:, None]).flatten(), rope])
    tok = row[off * 528 : off * 528 + 528]
    return (tok[:512].view(torch.float8_e4m3fn).double().view(16, 32) * tok[512:].view(torch.float8_e8m0fnu).double()[:, None]).flatten()


def _loop_reference(inputs, case):
    c = sd.SparseConfig.parse(case["config"])
    fmt = case["kv_format"]
    b = case["b"]
    o = torch.zeros(b, c.s_q, c.h_q, 512, dtype=torch.float64)
    lse = torch.zeros(b, c.h_q, c.s_q, dtype=torch.float64)
    branches = [("KV", "idx", "topk_length", c.block)] + ([("KV_extra", "idx_extra", "extra_length", c.extra_block)] if c.has_extra else [])
    scale = inputs["softmax_scale"].tolist()[0]
    for i in range(b):
        for t in range(c.s_q):
            keys = []
            for cache, idx, length, bs in branches:
                for j in range(inputs[idx].shape[-1]):
                    v = int(inputs[idx][i, t, j])
                    if j < int(inputs[length][i]) and v != -1:
                        keys.append(_token_by_hand(inputs[cache], fmt, bs, v))
            for h in range(c.h_q):
                q = inputs["Q"][i, t, h].double()
                if not keys:
                    lse[i, h, t] = math.inf
                    continue
                s = [float(q @ k) * scale for k in keys]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                tot = sum(w)
                acc = sum(wi * k for wi, k in zip(w, keys)) / tot
                l = m + math.log(tot)
                sink = float(inputs["sink"][h])
                f = 0.0 if sink == math.inf else 1.0 / (1.0 + math.exp(sink - l)) if sink != -math.inf else 1.0
                o[i, t, h] = acc * f
                lse[i, h, t] = l
    return o, lse


@pytest.mark.parametrize("fmt,scenario", [
    ("simple", "plain"), ("model1", "topk_len"), ("v4.1", "invalid"), ("model1", "lonely"),
    ("simple", "sink_inf"), ("v4.1", "dup"), ("model1", "extreme"), ("model1", "softmax_scale"),
    ("simple", "softmax_scale"), ("nvfp4", "extreme"), ("nvfp4", "invalid"), ("nvfp4", "lonely"),
])
def test_reference_matches_independent_loop(fmt, scenario):
    case = _case(fmt, scenario)
    inputs = sd.make_inputs(case, seed=11)
    ref = sd.reference(inputs, case)
    o, lse = _loop_reference(inputs, case)
    assert torch.equal(torch.isinf(ref["LSE"]), torch.isinf(lse))
    fin = torch.isfinite(lse)
    assert torch.allclose(ref["LSE"][fin], lse[fin], rtol=1e-12, atol=1e-12)
    assert torch.allclose(ref["O"], o, rtol=1e-10, atol=1e-12)
    assert bool(torch.isfinite(ref["O"]).all())


def test_inputs_match_tensors_and_poison_unindexed_tokens():
    for fmt in kc.FORMATS:
        for scenario in sd.SCENARIOS:
            case = _case(fmt, scenario)
            inputs = sd.make_inputs(case, seed=1)
            specs = {s.name: s for s in sd.tensors(case)}
            for name, t in inputs.items():
                assert tuple(t.shape) == specs[name].shape and str(t.dtype) == "torch." + specs[name].dtype, (name, fmt, scenario)
    # unindexed tokens read as NaN
    case = _case("model1", "plain")
    inputs = sd.make_inputs(case, seed=2)
    nb = inputs["KV"].shape[0]
    c = sd.SparseConfig.parse(SMALL)
    used = set(inputs["idx"].flatten().tolist())
    rest = torch.tensor([i for i in range(nb * c.block) if i not in used])
    assert bool(kc.read_tokens(inputs["KV"], "model1", c.block, rest).isnan().all())


def test_garbage_past_topk_length_is_ignored_and_honouring_it_is_caught():
    case = _case("model1", "topk_len")
    inputs = sd.make_inputs(case, seed=3)
    ref = sd.reference(inputs, case)
    length = inputs["topk_length"]
    assert int(length.min()) < 70  # some garbage exists
    past = torch.arange(70)[None, None, :] >= length[:, None, None]
    assert bool(((inputs["idx"] == sd.INT_MAX) & past).any())
    other = dict(inputs)
    other["idx"] = torch.where(past, torch.full_like(inputs["idx"], -123), inputs["idx"])
    assert torch.equal(sd.reference(other, case)["O"], ref["O"])
    # wrong_e_len: stale entries honoured
    tokens = inputs["KV"].shape[0] * sd.SparseConfig.parse(case["config"]).block
    inside = (inputs["idx"] >= 0) & (inputs["idx"] < tokens)
    bug = {**inputs, "topk_length": torch.full_like(length, 70),
           "idx": torch.where(inside, inputs["idx"], torch.full_like(inputs["idx"], -1))}
    assert bool((past & inside).any())  # stale entries exist
    o = sd.reference(bug, case)["O"]
    assert bool(torch.isfinite(o).all())  # they are real tokens: a wrong row, not a NaN
    cos = torch.nn.functional.cosine_similarity(o.flatten(), ref["O"].flatten(), dim=0)
    assert cos < 0.9999


def test_wrong_tile_scale_is_caught_by_the_tolerance():
    """The wrong-tile scale bug moves O past the cosine bound."""
    case = _case("model1", "plain", config="s1h8_m64bs64")
    inputs = sd.make_inputs(case, seed=4)
    ref = sd.reference(inputs, case)["O"]
    bad = dict(inputs)
    cache = inputs["KV"].clone()
    _, _, sc = kc.model1_views(cache, 64)
    sc.copy_(torch.roll(sc.clone(), 1, dims=-1))
    bad["KV"] = cache
    o = sd.reference(bad, case)["O"]
    cos = torch.nn.functional.cosine_similarity(o.flatten(), ref.flatten(), dim=0)
    assert cos < 0.99


def _scaled(inputs, scale):
    return {**inputs, "softmax_scale": torch.tensor([scale], dtype=torch.float32)}


def test_softmax_scale_scenario_carries_flashmla_scale_and_the_others_the_default():
    """softmax_scale is 1/sqrt(512) except the `softmax_scale` scenario's 512^−0.55."""
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    for scenario in sd.SCENARIOS:
        x = sd.make_inputs(_case("v4.1", scenario), seed=9)
        want = f32(512 ** -0.55) if scenario == "softmax_scale" else f32(1 / math.sqrt(512))
        assert x["softmax_scale"].dtype == torch.float32 and x["softmax_scale"].tolist() == [want], scenario
    assert sd.ALT_SCALE == 512 ** -0.55 and sd.DEFAULT_SCALE == 1 / math.sqrt(512)
    x = sd.make_inputs(_case("model1", "softmax_scale"), seed=9)
    assert bool(torch.isfinite(x["sink"]).all()) and bool((x["idx"] == -1).any())  # sink's: finite sinks, ~10 % −1


def test_softmax_scale_multiplies_the_scores():
    """ref(s) = ref(s₀) with Q · s/s₀; at s = 0 LSE = ln(valid keys), O = their mean."""
    case = _case("model1", "invalid")
    x = sd.make_inputs(case, seed=12)
    x["sink"] = torch.full_like(x["sink"], -math.inf)
    s0 = x["softmax_scale"].tolist()[0]
    base = sd.reference(x, case)
    for s in (512 ** -0.55, 0.3, 1e-3):
        s32 = float(torch.tensor(s, dtype=torch.float32))
        got = sd.reference(_scaled(x, s), case)
        folded = sd.reference({**x, "Q": x["Q"].double() * (s32 / s0)}, case)
        assert torch.allclose(got["O"], folded["O"], rtol=1e-9, atol=1e-12)
        fin = torch.isfinite(got["LSE"])
        assert torch.equal(fin, torch.isfinite(folded["LSE"]))
        assert torch.allclose(got["LSE"][fin], folded["LSE"][fin], rtol=1e-12)
        assert not torch.allclose(got["O"], base["O"], rtol=1e-3)  # it moves O
    zero = sd.reference(_scaled(x, 0.0), case)
    c = sd.SparseConfig.parse(case["config"])
    kv, valid = sd.branch_keys(x["KV"], "model1", c.block, x["idx"], x["topk_length"])
    kvx, validx = sd.branch_keys(x["KV_extra"], "model1", c.extra_block, x["idx_extra"], x["extra_length"])
    kv, valid = torch.cat([kv, kvx], dim=2), torch.cat([valid, validx], dim=2)
    n = valid.sum(-1).double()  # [b, s_q]
    mean = kv.sum(2) / n[..., None]  # invalid keys are zeros
    assert torch.allclose(zero["LSE"], torch.log(n)[:, None, :].expand_as(zero["LSE"]), rtol=1e-12)
    assert torch.allclose(zero["O"], mean[:, :, None, :].expand_as(zero["O"]), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fmt", kc.FORMATS)
def test_a_kernel_that_ignores_the_softmax_scale_is_caught(fmt):
    """wrong_e_softmax_scale fails only on `softmax_scale`."""
    for config in ("s2h64_m128bs256_x512bs64", "s1h64_m96bs64"):
        case = _case(fmt, "softmax_scale", config=config, b=2)
        x = sd.make_inputs(case, seed=13)
        ref = sd.reference(x, case)
        bug = sd.reference(_scaled(x, sd.DEFAULT_SCALE), case)
        for name, bound in (("O", 1e-2), ("LSE", 1e-5)):
            fin = torch.isfinite(ref[name])
            rel = float((bug[name][fin] - ref[name][fin]).norm() / ref[name][fin].norm())
            assert rel > 10 * bound, (config, name, rel)


def test_lonely_rows_and_sink_semantics():
    case = _case("model1", "lonely", config="s2h6_m64bs64_x64bs2")
    inputs = sd.make_inputs(case, seed=5)
    ref = sd.reference(inputs, case)
    lonely_lse = ref["LSE"] == math.inf  # [b, h, s]
    assert bool(lonely_lse[1].all()) and bool(lonely_lse[0, :, 1].all()) and not bool(lonely_lse[0, :, 0].any())
    assert bool((ref["O"][1] == 0).all()) and bool(torch.isfinite(ref["O"]).all())
    sink = inputs["sink"]
    assert bool((sink == math.inf).any()) and bool((sink == -math.inf).any())
    o = ref["O"][0, 0]  # +inf sink → 0, −inf sink → no sink
    nosink = dict(inputs)
    nosink["sink"] = torch.full_like(sink, -math.inf)
    ref0 = sd.reference(nosink, case)
    assert bool((o[sink == math.inf] == 0).all())
    assert torch.equal(o[sink == -math.inf], ref0["O"][0, 0][sink == -math.inf])
    assert torch.equal(ref["LSE"], ref0["LSE"])  # the LSE never includes the sink
    fin = torch.isfinite(sink)
    lse = ref0["LSE"][0, :, 0]
    assert torch.allclose(o[fin], ref0["O"][0, 0][fin] / (1 + torch.exp(sink[fin].double() - lse[fin]))[:, None])


def test_two_branches_merge_by_lse():
    """The one-softmax result equals the branches merged by LSE."""
    case = _case("v4.1", "invalid", config="s2h4_m64bs64_x64bs2")
    inputs = sd.make_inputs(case, seed=6)
    inputs["sink"] = torch.full_like(inputs["sink"], -math.inf)
    both = sd.reference(inputs, case)
    main = sd.reference({**inputs, "extra_length": torch.zeros_like(inputs["extra_length"])}, case)
    swa = sd.reference({**inputs, "topk_length": torch.zeros_like(inputs["topk_length"])}, case)
    l1, l2 = main["LSE"].permute(0, 2, 1), swa["LSE"].permute(0, 2, 1)
    lse = torch.logaddexp(l1, l2)
    o = torch.exp(l1 - lse)[..., None] * main["O"] + torch.exp(l2 - lse)[..., None] * swa["O"]
    assert torch.allclose(o, both["O"], atol=1e-12) and torch.allclose(lse.permute(0, 2, 1), both["LSE"])


def test_config_words_and_capacity():
    c = sd.SparseConfig.parse("s2h128_m128bs256_x1024bs64")
    assert (c.s_q, c.h_q, c.topk, c.block, c.extra_topk, c.extra_block) == (2, 128, 128, 256, 1024, 64)
    assert c.tiles() == 2 + 16
    assert not sd.SparseConfig.parse("s1h64_m96bs64").has_extra and sd.SparseConfig.parse("s1h64_m96bs64").tiles() == 2
    with pytest.raises(ValueError):
        sd.SparseConfig.parse("s2h128_m128")
    case = dict(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", scenario="plain", splits="auto")
    assert sd.split_capacity(case) == 18 and sd.split_capacity({**case, "b": 256}) == 1
    assert sd.flops({**case, "b": 64}) == 2.0 * 64 * 128 * 2 * 1024 * 1152
