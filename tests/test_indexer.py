"""Stages I1/I2 on the CPU: quantisers, paged cache, oracles vs loops, −inf, NaN keys, generators, bugs."""

import ast
import math
import re

import pytest
import torch

from harness.execution.metrics import compare, judge
from harness.spec.spec import load_spec
from oracles import indexer as ix
from oracles.common import case_seed

I1_SMALL = [{"s": 8, "s_kv": 24, "ranges": "causal"}, {"s": 12, "s_kv": 40, "ranges": "cp"},
            {"s": 8, "s_kv": 24, "ranges": "cp", "heads": 32, "head_dim": 32},
            {"s": 4, "s_kv": 16, "ranges": "causal", "heads": 32, "head_dim": 64}]
I2_SMALL = [{"b": 3, "next_n": 2, "ctx": 40, "block_kv": 16}, {"b": 1, "next_n": 1, "ctx": 30, "block_kv": 8},
            {"b": 2, "next_n": 2, "ctx": 30, "block_kv": 8, "heads": 32, "head_dim": 32},
            {"b": 2, "next_n": 1, "ctx": 20, "block_kv": 8, "heads": 32, "head_dim": 64},
            {"b": 3, "next_n": 3, "ctx": 40, "block_kv": 16, "context_2d": True},
            {"b": 2, "next_n": 1, "ctx": 30, "block_kv": 8, "context_2d": True}]


def _ids(c: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in c.items())


# -- quantisers


def test_per_token_quantiser_round_trips():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g) * torch.exp(torch.randn(64, 1, generator=g))
    x[3] = 0.0  # the 1e-4 floor
    q, scale = ix.quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64,)
    amax = x.abs().amax(dim=1)
    assert torch.equal(scale, amax.clamp(min=1e-4) / 448.0)
    back = ix.dequantize(q, scale)
    # e4m3: relative error ≤ 2^-4, subnormal ≤ 2^-10 · scale
    bound = x.double().abs() * 2.0 ** -4 + scale.double()[:, None] * 2.0 ** -10
    assert bool(((back - x.double()).abs() <= bound).all())
    rows = [i for i in range(64) if i != 3]
    assert torch.equal(q.float().abs().amax(dim=1)[rows], torch.full((63,), 448.0))  # amax lands on e4m3's max
    assert bool((back[3] == 0).all())


def test_paged_cache_packs_and_unpacks_bytewise():
    g = torch.Generator().manual_seed(2)
    values, scale = ix.quantize_per_token(torch.randn(5 * 16, 128, generator=g))
    values, scale = values.view(5, 16, 128), scale.view(5, 16)
    cache = ix.pack_paged_cache(values, scale)
    assert cache.shape == (5, 16, 1, 132) and cache.dtype == torch.uint8
    raw = cache.reshape(5, -1)
    # block 2, token 7: value bytes at 7·128, scale at 16·128 + 7·4
    assert torch.equal(raw[2, 7 * 128:8 * 128], values[2, 7].view(torch.uint8))
    assert torch.equal(raw[2, 16 * 128 + 28:16 * 128 + 32], scale[2, 7:8].view(torch.uint8))
    v2, s2 = ix.unpack_paged_cache(cache)
    assert torch.equal(v2.view(torch.uint8), values.view(torch.uint8)) and torch.equal(s2, scale)


# -- I1


def loops_i1(inputs) -> list[list[float]]:
    """float64 loops: relu(q·k·k_scale)·w summed over heads, −inf outside [ks, ke)."""
    q = inputs["q"].float().double().tolist()
    k = inputs["kv"].float().double().tolist()
    sc = inputs["kv_scale"].double().tolist()
    w = inputs["weights"].double().tolist()
    ks, ke = inputs["ks"].tolist(), inputs["ke"].tolist()
    out = []
    for i in range(len(q)):
        row = []
        for j in range(len(k)):
            if not ks[i] <= j < ke[i]:
                row.append(-math.inf)
                continue
            row.append(math.fsum(max(math.fsum(a * b for a, b in zip(q[i][h], k[j])) * sc[j], 0.0) * w[i][h]
                                 for h in range(len(q[i]))))
        out.append(row)
    return out


@pytest.mark.parametrize("case", I1_SMALL, ids=_ids)
def test_i1_oracle_matches_plain_loops(case):
    inputs = ix.make_inputs(case, seed=case_seed("I1", case))
    h, d = case.get("heads", 64), case.get("head_dim", 128)
    assert inputs["q"].shape == (case["s"], h, d) and inputs["kv"].shape == (case["s_kv"], d)
    assert inputs["weights"].shape == (case["s"], h)
    assert [s.shape for s in ix.tensors(case)][:4] == [(case["s"], h, d), (case["s_kv"], d), (case["s_kv"],), (case["s"], h)]
    assert ix.flops(case) == 2 * h * d * ix.valid_pairs(case)
    ref = ix.reference(inputs, case)["logits"]
    want = torch.tensor(loops_i1(inputs), dtype=torch.float64)
    assert ref.dtype == torch.float64 and ref.shape == (case["s"], case["s_kv"])
    assert torch.equal(torch.isinf(ref), torch.isinf(want))
    fin = torch.isfinite(want)
    assert torch.allclose(ref[fin], want[fin], rtol=1e-12, atol=1e-9)


def test_i1_neg_inf_exactly_outside_each_range():
    case = {"s": 128, "s_kv": 1024, "ranges": "cp"}
    inputs = ix.make_inputs(case, seed=3)
    ref = ix.reference(inputs, case)["logits"]
    j = torch.arange(1024)
    inside = (j[None, :] >= inputs["ks"][:, None]) & (j[None, :] < inputs["ke"][:, None])
    assert torch.equal(ref == -math.inf, ~inside)
    assert not torch.isnan(ref).any() and not (ref == math.inf).any()
    assert int(inside.sum()) == ix.valid_pairs(case)


@pytest.mark.parametrize("kind", ["causal", "cp"])
def test_i1_ranges_have_empty_rows_and_two_chunks(kind):
    s, s_kv = 128, 1024
    ks, ke = ix.ranges_of({"s": s, "s_kv": s_kv, "ranges": kind})
    empty = [i for i in range(s) if ke[i] <= ks[i]]
    assert empty and all(i % ix.EMPTY_EVERY == ix.EMPTY_FIRST for i in empty if i != 3)
    assert all(0 <= ks[i] and ke[i] <= s_kv for i in range(s))
    if kind == "cp":
        assert ks[3] > ke[3]  # a reversed range is empty too
        ends = [ke[i] for i in range(s) if ke[i] > ks[i]]
        firsts, seconds = ends[: len(ends) // 2], ends[len(ends) // 2:]
        assert max(firsts) < min(seconds) - s // 2  # two disjoint chunks of positions
        assert any(ks[i] > 0 for i in range(s) if ke[i] > ks[i])  # a window that does not start at 0
    else:
        assert ke[-1] == s_kv and all(k == 0 for i, k in enumerate(ks) if i not in empty)


def test_i1_generator_is_seeded_and_not_degenerate():
    case = {"s": 128, "s_kv": 1024, "ranges": "causal"}
    a, b, c = ix.make_inputs(case, 7), ix.make_inputs(case, 7), ix.make_inputs(case, 8)
    for name in ("q", "kv", "kv_scale", "weights"):
        assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.float8_e4m3fn else a[name],
                           b[name].view(torch.uint8) if b[name].dtype == torch.float8_e4m3fn else b[name])
    assert not torch.equal(a["kv"].view(torch.uint8), c["kv"].view(torch.uint8))
    assert a["kv_scale"].std() / a["kv_scale"].mean() > 0.3  # the scales vary per key
    assert (a["q"].float() != 0).float().mean() > 0.9 and (a["weights"] < 0).any() and (a["weights"] > 0).any()
    specs = {s.name: s for s in ix.tensors(case)}
    assert {k: tuple(v.shape) for k, v in a.items()} == {k: s.shape for k, s in specs.items() if s.role == "in"}
    assert ix.flops(case) == 2 * 64 * 128 * ix.valid_pairs(case) > 0


# -- I2


def loops_i2(inputs) -> list[list[float]]:
    """Plain float64 loops from the spec, reading the fused cache's bytes directly."""
    q = inputs["q"].float().double()
    next_n = q.shape[1]
    cache, table = inputs["kv_cache"], inputs["block_table"].tolist()
    bk, d = cache.shape[1], cache.shape[3] - 4
    w = inputs["weights"].double().tolist()
    max_len = len(table[0]) * bk
    out = []
    lens = inputs["context_lens"]
    for i, n in enumerate(lens.tolist()):
        for t in range(next_n):
            pos = n[t] - 1 if lens.dim() == 2 else n - next_n + t  # 2-D: token t sees keys < ctx[i, t]
            row = [-math.inf] * max_len
            for p in range(pos + 1):
                raw = cache[table[i][p // bk]].reshape(-1)
                slot = p % bk
                key = raw[slot * d:(slot + 1) * d].view(torch.float8_e4m3fn).double().tolist()
                sc = float(raw[bk * d + 4 * slot: bk * d + 4 * slot + 4].view(torch.float32))
                row[p] = math.fsum(max(math.fsum(x * y for x, y in zip(q[i, t, h].tolist(), key)) * sc, 0.0)
                                   * w[i * next_n + t][h] for h in range(q.shape[2]))
            out.append(row)
    return out


@pytest.mark.parametrize("case", I2_SMALL, ids=_ids)
def test_i2_oracle_matches_plain_loops(case):
    inputs = ix.paged_make_inputs(case, seed=case_seed("I2", case))
    h, d = case.get("heads", 64), case.get("head_dim", 128)
    assert inputs["q"].shape == (case["b"], case["next_n"], h, d) and inputs["kv_cache"].shape[3] == d + 4
    assert inputs["weights"].shape == (case["b"] * case["next_n"], h)
    assert [tuple(s.shape) for s in ix.paged_tensors(case)] == [tuple(v.shape) for v in inputs.values()] + [
        (case["b"] * case["next_n"], ix.paged_geometry(case)["max_len"])]
    ref = ix.paged_reference(inputs, case)["logits"]
    want = torch.tensor(loops_i2(inputs), dtype=torch.float64)
    geo = ix.paged_geometry(case)
    assert ref.shape == (case["b"] * case["next_n"], geo["max_len"])
    assert torch.equal(torch.isinf(ref), torch.isinf(want)) and not torch.isnan(ref).any()
    fin = torch.isfinite(want)
    assert torch.allclose(ref[fin], want[fin], rtol=1e-12, atol=1e-9)


def test_i2_context_2d_is_per_token():
    """context_2d [b, next_n]: last token's length is the sequence's; −inf at j ≥ ctx[i, t]."""
    case = {"b": 8, "next_n": 2, "ctx": 300, "block_kv": 64}
    c2 = {**case, "context_2d": True}
    assert [s.shape for s in ix.paged_tensors(c2)][2] == (8, 2) and ix.paged_tensors(case)[2].shape == (8,)
    lens2 = ix.token_context_lens(c2)
    assert [row[-1] for row in lens2] == ix.context_lens_of(case) and lens2 == ix.token_context_lens(c2)
    assert all(0 <= row[0] <= row[1] for row in lens2) and any(row[0] < row[1] - 1 for row in lens2)
    one, two = ix.paged_make_inputs(case, seed=5), ix.paged_make_inputs(c2, seed=5)
    assert torch.equal(one["kv_cache"], two["kv_cache"]) and torch.equal(one["block_table"], two["block_table"])
    assert two["context_lens"].tolist() == lens2
    ref = ix.paged_reference(two, c2)["logits"]
    j = torch.arange(ref.shape[1])
    assert torch.equal(ref == -math.inf, j[None, :] >= torch.tensor(lens2).view(-1)[:, None])
    assert not torch.isnan(ref).any()
    assert ix.paged_flops(c2) == 2 * 64 * 128 * int((ref > -math.inf).sum())
    # last token's row is the 1-D case's
    ref1 = ix.paged_reference(one, case)["logits"]
    assert torch.equal(ref[1::2], ref1[1::2]) and not torch.equal(ref[0::2], ref1[0::2])
    peer = ix.torch_paged_logits(two, c2)
    m = compare(peer, ref)
    assert m.nonfinite == 0 and m.cosine > 0.99999, m


def test_i2_neg_inf_past_each_causal_limit_and_nan_keys_planted():
    case = {"b": 8, "next_n": 2, "ctx": 300, "block_kv": 64}
    inputs = ix.paged_make_inputs(case, seed=5)
    ref = ix.paged_reference(inputs, case)["logits"]
    lens = inputs["context_lens"]
    assert not bool((lens % 64 == 0).any()) and lens.tolist() == ix.context_lens_of(case)
    pos = lens.repeat_interleave(2) - 2 + torch.arange(16) % 2
    j = torch.arange(ref.shape[1])
    assert torch.equal(ref == -math.inf, j[None, :] > pos[:, None])
    assert not torch.isnan(ref).any()
    # NaN keys past each context
    values, scale = ix.unpack_paged_cache(inputs["kv_cache"])
    table = inputs["block_table"]
    for i, n in enumerate(lens.tolist()):
        last = int(table[i, (n - 1) // 64])
        assert bool(torch.isnan(scale[last, n % 64:]).all()) and not torch.isnan(scale[last, : n % 64]).any()
        assert bool(torch.isnan(values[last, n % 64:].float()).all())
    # a sequence's blocks shuffled
    firsts = table[:, 0].tolist()
    assert firsts != sorted(firsts) or table[0, 1] != table[0, 0] + 1
    assert ix.paged_flops(case) == 2 * 64 * 128 * int((ref > -math.inf).sum())


# -- the tolerances catch the named bugs


def _tolerances(stage: str, case: dict):
    return load_spec().stages[stage].tolerances_for(case)


def _relu_dropped(inputs):
    q = inputs["q"].double()
    k = ix.dequantize(inputs["kv"], inputs["kv_scale"])
    logits = torch.einsum("shk,sh->sk", torch.einsum("shd,kd->shk", q, k), inputs["weights"].double())
    j = torch.arange(k.shape[0])
    inside = (j[None, :] >= inputs["ks"][:, None]) & (j[None, :] < inputs["ke"][:, None])
    return logits.masked_fill(~inside, -math.inf)


def _scale_per_head(inputs):
    """The key scale indexed by head instead of key (the bug a head-major epilogue makes)."""
    q = inputs["q"].double()
    k = inputs["kv"].double()
    sc = inputs["kv_scale"].double()[: q.shape[1]]
    s = torch.einsum("shd,kd->shk", q, k) * sc[None, :, None]
    logits = torch.einsum("shk,sh->sk", s.clamp(min=0), inputs["weights"].double())
    j = torch.arange(k.shape[0])
    inside = (j[None, :] >= inputs["ks"][:, None]) & (j[None, :] < inputs["ke"][:, None])
    return logits.masked_fill(~inside, -math.inf)


@pytest.mark.parametrize("bug", [_relu_dropped, _scale_per_head], ids=["relu_dropped", "scale_per_head"])
def test_i1_tolerances_fail_the_named_bugs(bug):
    case = {"s": 128, "s_kv": 1024, "ranges": "causal"}
    inputs = ix.make_inputs(case, seed=case_seed("I1", case))
    ref = ix.reference(inputs, case)["logits"]
    tol = _tolerances("I1", case)
    good = ref.float()  # the reference passes
    assert judge(tol, {"logits": compare(good, ref).to_json()})[0] == "pass"
    status, why = judge(tol, {"logits": compare(bug(inputs).float(), ref).to_json()})
    assert status == "fail", why


@pytest.mark.parametrize("case", [{"s": 12, "s_kv": 40, "ranges": "cp"}, {"s": 128, "s_kv": 1024, "ranges": "cp"},
                                  {"s": 8, "s_kv": 24, "ranges": "causal"}], ids=_ids)
def test_i1_compressed_logits_are_the_full_rows_from_ks(case):
    """compressed logits: column c of row i is key ks[i] + c, −inf past ke; vs plain loops."""
    comp = {**case, "compressed": True}
    ks, ke = ix.ranges_of(case)
    width = max(e - b for b, e in zip(ks, ke))
    assert [s.shape for s in ix.tensors(comp)][-1] == (case["s"], width)
    assert (width < case["s_kv"]) == (case["ranges"] == "cp")  # causal: a row sees every key
    inputs = ix.make_inputs(case, seed=case_seed("I1", case))
    full = ix.reference(inputs, case)["logits"]
    got = ix.reference(inputs, comp)["logits"]
    want = torch.full((case["s"], width), -math.inf, dtype=torch.float64)
    for i in range(case["s"]):
        for c in range(width):
            if ks[i] + c < ke[i]:
                want[i, c] = full[i, ks[i] + c]
    assert torch.equal(got, want)
    empty = [5] + ([3] if case["ranges"] == "cp" else [])  # ks = ke, ks > ke
    assert all(bool(torch.isinf(got[r]).all()) for r in empty)
    assert not bool(torch.isinf(got[1, : ke[1] - ks[1]]).any())
    peer = ix.torch_logits(inputs, comp)
    m = compare(peer, got)
    assert peer.shape == got.shape and m.nonfinite == 0 and m.cosine > 0.99999, m


@pytest.mark.parametrize("stage", ["I1", "I2"])
def test_bf16_logits_are_the_exact_logits_rounded_and_the_bugs_still_fail(stage):
    """bf16 logits: reference = float64 rounded to bf16; fp32 unchanged; named bugs still fail."""
    if stage == "I1":
        case = {"s": 128, "s_kv": 1024, "ranges": "causal"}
        tensors, make, reference = ix.tensors, ix.make_inputs, ix.reference
    else:
        case = {"b": 8, "next_n": 2, "ctx": 300, "block_kv": 64}
        tensors, make, reference = ix.paged_tensors, ix.paged_make_inputs, ix.paged_reference
    bf = {**case, "logits_dtype": "bf16"}
    assert tensors(case)[-1].dtype == "float32" and tensors(bf)[-1].dtype == "bfloat16"
    assert [s.dtype for s in tensors(case)[:-1]] == [s.dtype for s in tensors(bf)[:-1]]
    inputs = make(case, seed=4)
    exact = reference(inputs, case)["logits"]
    ref = reference(inputs, bf)["logits"]
    assert ref.dtype == torch.float64 and torch.equal(ref, exact.to(torch.bfloat16).double())
    assert not torch.equal(ref, exact) and torch.equal(torch.isinf(ref), torch.isinf(exact))
    tol = _tolerances(stage, bf)
    assert judge(tol, {"logits": compare(exact.to(torch.bfloat16), ref).to_json()})[0] == "pass"
    if stage == "I1":
        for bug in (_relu_dropped, _scale_per_head):
            assert judge(tol, {"logits": compare(bug(inputs).to(torch.bfloat16), ref).to_json()})[0] == "fail"
    with pytest.raises(ValueError, match="logits_dtype must be fp32 or bf16, got 'fp16'"):
        tensors({**case, "logits_dtype": "fp16"})


def _bf16_toward_zero(x):
    """float64 → fp32 → bf16 truncated → float64."""
    f = x.float()
    cut = (f.view(torch.int32) & ~0xFFFF).view(torch.float32)
    return torch.where(torch.isfinite(f), cut, f).double()


@pytest.mark.parametrize("stage", ["I1", "I2"])
def test_the_rel_l2_bound_follows_logits_dtype(stage):
    """rel_l2_max fp32 1e-3, bf16 2e-3: fp32 at 1.5e-3 fails, bf16 passes, truncating bf16 fails."""
    if stage == "I1":
        case = {"s": 128, "s_kv": 1024, "ranges": "causal"}
        make, reference = ix.make_inputs, ix.reference
    else:
        case = {"b": 8, "next_n": 2, "ctx": 300, "block_kv": 64}
        make, reference = ix.paged_make_inputs, ix.paged_reference
    fp32, bf = {**case, "logits_dtype": "fp32"}, {**case, "logits_dtype": "bf16"}
    assert _tolerances(stage, fp32)["logits"].rel_l2_max == 1.0e-3
    assert _tolerances(stage, bf)["logits"].rel_l2_max == 2.0e-3
    inputs = make(case, seed=4)
    exact = reference(inputs, fp32)["logits"]
    sign = torch.where(torch.arange(exact.numel()).reshape(exact.shape) % 2 == 0, 1.0, -1.0).double()
    off = torch.where(torch.isfinite(exact), exact * (1 + 1.5e-3 * sign), exact)  # rel_l2 1.5e-3 exactly
    m = compare(off.float(), exact).to_json()
    assert abs(m["rel_l2"] - 1.5e-3) < 1e-5, m
    status, why = judge(_tolerances(stage, fp32), {"logits": m})
    assert status == "fail" and "rel_l2" in why, why
    assert judge(_tolerances(stage, bf), {"logits": m}) == ("pass", None)
    ref = reference(inputs, bf)["logits"]
    g = torch.Generator().manual_seed(0)
    noisy = exact * (1 + 1.5e-4 * torch.randn(exact.shape, generator=g, dtype=torch.float64))
    near = compare(torch.where(torch.isfinite(exact), noisy, exact).to(torch.bfloat16), ref).to_json()
    assert 5e-4 < near["rel_l2"] < 1.5e-3 and judge(_tolerances(stage, bf), {"logits": near})[0] == "pass", near
    cut = compare(_bf16_toward_zero(exact).to(torch.bfloat16), ref).to_json()
    assert cut["rel_l2"] > 3e-3 and judge(_tolerances(stage, bf), {"logits": cut})[0] == "fail", cut


def test_i1_tolerances_fail_a_wrong_neg_inf_position():
    case = {"s": 128, "s_kv": 1024, "ranges": "cp"}
    inputs = ix.make_inputs(case, seed=1)
    ref = ix.reference(inputs, case)["logits"]
    out = ref.float().clone()
    row = 20
    out[row, int(inputs["ke"][row])] = 0.5  # one key past the range left finite
    status, why = judge(_tolerances("I1", case), {"logits": compare(out, ref).to_json()})
    assert status == "fail" and "NaN/Inf" in why
    out = ref.float().clone()
    out[row, int(inputs["ke"][row]) - 1] = -math.inf  # one key inside the range dropped
    assert judge(_tolerances("I1", case), {"logits": compare(out, ref).to_json()})[0] == "fail"


# -- the kernels' refusals (no GPU needed)


def test_kernels_refuse_what_they_cannot_do():
    from stages.I1_mqa_logits.sm90 import Kernel as I1
    from stages.I2_paged_mqa_logits.sm90 import Kernel as I2

    with pytest.raises(ValueError, match="s_kv must be a positive multiple of 64"):
        I1(s=128, s_kv=1000)
    with pytest.raises(ValueError, match="s must be a multiple"):
        I1(s=127, s_kv=1024)
    with pytest.raises(ValueError, match="block_kv must be 64"):
        I2(b=1, next_n=1, block_kv=32)
    with pytest.raises(ValueError, match="next_n must be 1"):
        I2(b=1, next_n=5, block_kv=64)
    with pytest.raises(ValueError, match="heads must be one of 32, 64, got 16"):
        I1(s=128, s_kv=1024, heads=16)
    with pytest.raises(ValueError, match="head_dim must be one of 32, 64, 128, got 256"):
        I2(b=1, next_n=1, block_kv=64, head_dim=256)
    with pytest.raises(ValueError, match="logits_dtype must be one of fp32, bf16, got 'fp16'"):
        I1(s=128, s_kv=1024, logits_dtype="fp16")
    # I1's table of s / 8 blocks: 34808 tokens fill the 227 KiB exactly, 8 more do not
    I1(s=34808, s_kv=1024)
    with pytest.raises(ValueError, match="s = 34816 needs 233472 B .* smaller chunks of tokens"):
        I1(s=34816, s_kv=1024)
    I1(s=128, s_kv=1024), I2(b=8, next_n=2, block_kv=64)  # the matrix's shapes are taken
    for h, d in ((32, 32), (32, 64), (64, 128)):
        I1(s=128, s_kv=1024, heads=h, head_dim=d), I2(b=8, next_n=2, block_kv=64, heads=h, head_dim=d)


def test_tmem_budget_refuses_more_than_512_columns():
    from stages.common.indexer import tmem_budget

    assert tmem_budget(2, 256, "I1") == 512 and tmem_budget(2, 128, "I2") == 256 and tmem_budget(1, 64, "x") == 64
    with pytest.raises(ValueError, match="3 accumulator buffers × 256 columns = 768 > 512"):
        tmem_budget(3, 256, "I1 sm100")


_I1_CASE = {"s": 128, "s_kv": 1024, "ranges": "causal", "heads": 64, "head_dim": 128, "logits_dtype": "fp32", "compressed": False}
_I2_CASE = {"b": 1, "next_n": 1, "ctx": 200, "block_kv": 64, "heads": 64, "head_dim": 128, "logits_dtype": "fp32", "context_2d": False}


def _probe(tmp_path, arch: str, probe: str, *args) -> dict:
    """Compile probe in a fresh interpreter with `args`; its last line is JSON."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "CUTE_DSL_ARCH": arch, "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path / "dump"),
           "DSV4_LAB_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    (tmp_path / "dump").mkdir()
    argv = [json.dumps(a) if isinstance(a, list) else str(a) for a in args]
    run = subprocess.run([sys.executable, "-c", probe, str(ROOT), *argv],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


_COMPILE_PROBE = r"""
import json, sys
from pathlib import Path
from harness.spec.spec import load_spec
from harness.execution.compile import compile_case
from tests.conftest import planted
root, arch, out = Path(sys.argv[1]), sys.argv[2], []
spec = load_spec(root=root)
for stage, case, fixture in json.loads(sys.argv[3]):
    keep = Path(sys.argv[4]) / str(len(out))
    r = compile_case(root, planted(spec, stage, fixture) if fixture else spec.stages[stage], arch, case, keep=keep)
    out.append([r.ok, r.error, r.resources if r.ok else {}, str(keep / "kernel.ptx")])
print(json.dumps(out))
"""


def _builds(tmp_path, arch: str, builds) -> list[tuple[dict, str]]:
    """(ptxas resources, PTX) of each [stage, case, fixture ("": the stage's own)], compiled in a fresh interpreter."""
    from pathlib import Path

    got = _probe(tmp_path, arch, _COMPILE_PROBE, arch, builds, tmp_path)
    for (stage, case, fixture), (ok, err, _, _) in zip(builds, got):
        assert ok, f"{stage} {fixture} {case}: {err}"
    return [(res, Path(ptx).read_text()) for _, _, res, ptx in got]


def test_sm90_register_increase_only_where_the_launch_grants_it(tmp_path):
    """setmaxnreg.inc only where the launch grants it; I2 next_n 1 asks none."""
    import importlib

    from tests.conftest import ROOT

    cases = [["I2", _I2_CASE], ["I2", {**_I2_CASE, "next_n": 2}], ["I1", _I1_CASE]]
    spec, incs = load_spec(root=ROOT), []
    for (stage, case), (res, ptx) in zip(cases, _builds(tmp_path, "sm_90a", [[st, c, ""] for st, c in cases])):
        key, ref, regs = (stage, case), spec.stages[stage].kernels["sm_90a"], res.get("regs")
        k = getattr(importlib.import_module(ref.module), ref.entry)(**{p: case[p] for p in spec.stages[stage].kernel_params})
        assert k.THREADS * regs <= 65536, f"{key}: {k.THREADS} threads × {regs} registers"
        freed, taken = 128 * (regs - k.LOAD_REGS), k.MMA_THREADS * (k.MMA_REGS - regs)
        incs.append("setmaxnreg.inc" in ptx)
        assert not incs[-1] or freed >= taken, f"{key}: setmaxnreg.inc takes {taken} registers, the decrease frees {freed}"
    assert incs == [False, True, True]  # the probe sees both kinds


def test_planted_relu_bug_reaches_the_compiled_i1_kernel(tmp_path):
    """wrong_i1's `head_partial` reaches the epilogue: relu in the stage, none in it."""
    (_, stage), (_, wrong) = _builds(tmp_path, "sm_90a", [["I1", _I1_CASE, f] for f in ("", "wrong_i1")])
    assert stage.count("max.f32") - wrong.count("max.f32") >= 64  # relu per tile gone
    assert stage.count("wgmma.mma_async") == wrong.count("wgmma.mma_async") > 0


def test_sm90_epilogue_issues_no_global_load(tmp_path):
    """Key scales load before the MMA: no ld.global after wgmma.wait_group (issue 31)."""
    cases = [["I1", _I1_CASE, ""], ["I2", {**_I2_CASE, "next_n": 2}, ""]]
    for key, (_, ptx) in zip(cases, _builds(tmp_path, "sm_90a", cases)):
        tail = ptx[ptx.rfind("wgmma.wait_group"):] if "wgmma.wait_group" in ptx else ""
        waits, loads = ptx.count("wgmma.wait_group"), tail.count("ld.global")
        assert waits == 1, f"{key}: {waits} wgmma.wait_group, the probe expects the MMA loop's one"
        assert loads == 0, f"{key}: {loads} ld.global after the MMA's wgmma.wait_group (in the epilogue)"


def _quad_lanes():
    """The four lanes of a quad as numpy arrays (lane q = element q): shuffle and select."""
    import numpy as np

    q = np.arange(4)
    return q, (lambda x, bit: x[q ^ bit]), (lambda c, a, b: np.where(c, a, b))


def test_quad_reduce_scatter_gives_lane_q_the_sum_of_value_q():
    import numpy as np

    from stages.common.indexer import quad_reduce_scatter

    q, shfl, sel = _quad_lanes()
    v = [np.array([10.0 ** i * (s + 1) for s in range(4)]) for i in range(4)]  # lane s, value i
    got = quad_reduce_scatter(v, q, shfl, sel)
    assert list(got) == [sum(v[i]) for i in range(4)]  # lane i: Σ over the lanes of value i
    with pytest.raises(ValueError):
        quad_reduce_scatter(v[:3], q, shfl, sel)


def test_quad_pick_takes_each_lanes_candidate():
    import numpy as np

    from stages.common.indexer import quad_pick

    q, _, sel = _quad_lanes()
    values = [np.full(4, 100 + i) for i in range(4)]
    for index in ([0, 0, 1, 1], [0, 1, 0, 1], [3, 2, 1, 0], [2, 2, 2, 2], [1, 0, 0, 1]):
        assert list(quad_pick(q, values, index, sel)) == [100 + index[lane] for lane in range(4)]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_indexer_options_compile_on_both_archs(tmp_path, arch):
    """Issue 35.2 options compile on both archs."""
    cases = [["I1", {"s": 128, "s_kv": 1024, "ranges": "causal", "heads": 32, "head_dim": 64}],
             ["I2", {"b": 8, "next_n": 2, "ctx": 200, "block_kv": 64, "heads": 32, "head_dim": 32}],
             ["I2", {"b": 8, "next_n": 1, "ctx": 200, "block_kv": 64, "logits_dtype": "bf16"}],
             ["I1", {"s": 128, "s_kv": 1024, "ranges": "cp", "compressed": True}],
             ["I2", {"b": 8, "next_n": 2, "ctx": 200, "block_kv": 64, "context_2d": True}],
             ["I1", {"s": 34808, "s_kv": 1024, "ranges": "causal"}]]
    full = {"heads": 64, "head_dim": 128, "logits_dtype": "fp32"}
    cases = [[st, {**full, **({"compressed": False} if st == "I1" else {"context_2d": False}), **c}] for st, c in cases]
    got = [[ptx.count("wgmma.mma_async"), ptx.count("tcgen05.mma.cta_group"),
            sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "cvt.rn.bf16.f32" in ptx, "st.global.b16" in ptx, "st.global.b32" in ptx, res.get("smem")]
           for res, ptx in _builds(tmp_path, arch, [[st, c, ""] for st, c in cases])]
    if arch == "sm_90a":
        assert [g[0:3] for g in got[:2]] == [[2, 0, ["m64n64k32"]], [1, 0, ["m64n64k32"]]]
    else:
        assert [g[0:2] for g in got[:2]] == [[0, 2], [0, 1]]
    assert [g[3:6] for g in got[:3]] == [[False, False, True], [False, False, True], [True, True, False]]
    # got[3], got[4] built: I1's compressed form, I2's 2-D context lengths
    if arch == "sm_90a":  # the longest prefill uses all smem
        from stages.common.device import SMEM_LIMIT

        assert got[5][-1] == SMEM_LIMIT


def test_persistent_shares_cover_every_block_once_and_balance():
    """share_segments: every (block, tile) pair in exactly one CTA, in order; edge cases."""
    import random

    from stages.common.indexer import block_tiles, share_segments

    i1_cp = block_tiles(*ix.ranges_of({"s": 2048, "s_kv": 4096, "ranges": "cp"}), 8, 4096, 64)
    assert (min(i1_cp), max(i1_cp), sum(i1_cp)) == (9, 33, 6336)
    rng = random.Random(7)
    cases = [[0], [5], [0, 0, 3, 0], [1] * 300, [40, 0, 17, 2, 0, 0, 9], i1_cp]
    cases += [[rng.choice([0, rng.randint(1, 300)]) for _ in range(rng.randint(1, 130))] for _ in range(40)]
    for blocks in cases:
        for ctas in (1, 3, 132, 264):
            seen, sizes = [], []
            for c in range(ctas):
                segs = share_segments(blocks, c, ctas)
                sizes.append(sum(n for _, _, n in segs))
                for seq, lo, n in segs:
                    assert n > 0 and 0 <= lo and lo + n <= blocks[seq]
                    seen += [(seq, j) for j in range(lo, lo + n)]
            assert seen == [(i, j) for i, n in enumerate(blocks) for j in range(n)], (blocks, ctas)
            assert max(sizes) - min(sizes) <= 1


def test_i2_sm90_slots_must_be_a_multiple_of_the_mma_warpgroups():
    """STAGES % W ≠ 0 (a parity wait passing on another warpgroup's slot) is refused."""
    from stages.I2_paged_mqa_logits.sm90 import Kernel

    with pytest.raises(ValueError, match="multiple of the warpgroups"):
        Kernel(b=8, next_n=2, block_kv=64, mma_wg=3, mma_regs=160, stages=8)
    Kernel(b=8, next_n=2, block_kv=64, mma_wg=3, mma_regs=160, stages=12)
    Kernel(b=8, next_n=2, block_kv=64)

@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_i1_fill_warps_use_the_common_fill_outside(arch):
    """I1's fill warps on both archs call indexer.py `fill_outside`, not a copy of it."""
    from tests.conftest import ROOT

    tree = ast.parse((ROOT / "stages" / "I1_mqa_logits" / f"{arch}.py").read_text())
    called = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert called.count("fill_outside") == 1 and not {"fill_rows", "fill_compressed"} & set(called), called


def test_planted_stale_weights_reach_the_compiled_i2_kernel(tmp_path):
    """wrong_i2's `segment_weights` override reaches the kernel: same MMAs, different PTX."""
    case = {**_I2_CASE, "b": 8, "next_n": 2, "ctx": 3000}
    stage, wrong = [ptx for _, ptx in _builds(tmp_path, "sm_90a", [["I2", case, f] for f in ("", "wrong_i2")])]
    assert stage.count("wgmma.mma_async") == wrong.count("wgmma.mma_async") > 0
    bodies = []
    for ptx in (stage, wrong):
        body = ptx.split(".entry", 1)[-1]
        entry = body.split("(", 1)[0].strip()
        bodies.append(body.replace(entry, "K") if entry else body)  # the kernel's name embeds its module's
    assert bodies[0] != bodies[1]


@pytest.mark.parametrize("fixture, stage", [("wrong_i1", "I1_mqa_logits"), ("wrong_i2", "I2_paged_mqa_logits"),
                                            ("wrong_e_window", "E_sparse_decode"),
                                            ("wrong_e_nvfp4_group", "E_sparse_decode"), ("wrong_e_rope_sign", "E_sparse_decode")])
def test_planted_bug_fixtures_override_only_hooks(fixture, stage):
    """Fixtures replace only the kernel's named hooks, never copy a long method."""
    from tests.conftest import ROOT

    def methods(path):
        cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Kernel")
        return {f.name: " ".join((ast.get_docstring(f) or "").split()) for f in cls.body if isinstance(f, ast.FunctionDef)}

    hooks = {k for k, doc in methods(ROOT / "stages" / stage / "sm90.py").items()
             if "so a test fixture can plant a bug here" in doc}
    overridden = set(methods(ROOT / "tests" / "fixtures" / fixture / "sm90.py"))
    assert overridden and overridden <= hooks, (overridden, hooks)
