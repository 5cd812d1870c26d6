"""Stages D3–D5 on the CPU: oracles, merge, sink, generators, key limits, combine, refusals, bugs."""

import importlib
import itertools
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from harness.execution.metrics import compare, judge
from harness.spec.spec import Tolerance
from oracles import masked_decode as md
from oracles.common import case_seed
from stages.common import scheduler as sch
from stages.common.combine import combine_reference

ROOT = Path(__file__).resolve().parents[1]
INF = math.inf


def matrix(stage: str) -> list[dict]:
    axes = yaml.safe_load((ROOT / "stages.yaml").read_text())["stages"][stage]["matrix"]
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def tolerances(stage: str) -> dict[str, Tolerance]:
    tol = yaml.safe_load((ROOT / "stages.yaml").read_text())["stages"][stage]["tolerances"]
    return {k: Tolerance(**v) for k, v in tol.items()}


# -- an independent float64 loop


def loops(q, branches, sink=None):
    """float64 loops: branches [(kv, valid(b, t, j))], sink or None -> O, LSE."""
    b_, s_, h_, d = len(q), len(q[0]), len(q[0][0]), len(q[0][0][0])
    scale = 1.0 / math.sqrt(d)
    out = [[[None] * h_ for _ in range(s_)] for _ in range(b_)]
    lse = [[[None] * s_ for _ in range(h_)] for _ in range(b_)]
    for b in range(b_):
        for t in range(s_):
            keys = [kv[b][j] for kv, ok in branches for j in range(len(kv[b])) if ok(b, t, j)]
            for h in range(h_):
                if not keys:
                    out[b][t][h], lse[b][h][t] = [0.0] * d, INF
                    continue
                s = [math.fsum(x * y for x, y in zip(q[b][t][h], k)) * scale for k in keys]
                mx = max(s)
                e = [math.exp(x - mx) for x in s]
                tot = math.fsum(e)
                l_ = mx + math.log(tot)
                f = 1.0 if sink is None else 1.0 / (1.0 + math.exp(sink[h] - l_)) if sink[h] != INF else 0.0
                out[b][t][h] = [f * math.fsum(e[i] * keys[i][c] for i in range(len(keys))) / tot for c in range(d)]
                lse[b][h][t] = l_
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


def _close(ref, o, lse):
    assert torch.equal(torch.isinf(ref["LSE"]), torch.isinf(lse)), "lonely rows differ"
    fin = torch.isfinite(lse)
    assert torch.allclose(ref["LSE"][fin], lse[fin], rtol=0, atol=1e-10)
    assert torch.allclose(ref["O"], o, rtol=0, atol=1e-10)
    assert (ref["O"][torch.isinf(ref["LSE"]).permute(0, 2, 1)] == 0).all(), "a lonely row's O must be exactly 0"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape,fill", [("b4s3h3n70d8", 63), ("b4s2h2n9d4", "random"), ("b3s3h2n5d8", "at"),
                                        ("b4s2h2n6d4", "below"), ("b4s1h2n7d4", 0)])
def test_swa_oracles_match_plain_float64_loops(shape, fill, causal):
    case = {"shape": shape, "fill": fill, "splits": 1}
    inputs = md.swa_inputs(case, seed=case_seed("D4" if causal else "D3", case))
    lens = [int(x) for x in inputs["swa_lens"]]
    p = md.parse_shape(shape)
    s_q = p["s_q"]

    def ok(b, t, j):
        return j < lens[b] and (not causal or j <= lens[b] - s_q + t)

    ref = (md.causal_swa_reference if causal else md.swa_reference)(inputs, case)
    o, lse = loops(inputs["Q"].double().tolist(), [(inputs["KV"].double().tolist(), ok)])
    _close(ref, o, lse)
    assert [tuple(ref[k].shape) for k in ("O", "LSE")] == [s.shape for s in md.swa_tensors(case) if s.role == "out"]


@pytest.mark.parametrize("branches", ["0+0", "0+k", "k+0", "k+k", "full+full"])
@pytest.mark.parametrize("sink", ["none", "-inf", -5, 0, 5, "inf"])
def test_merge_oracle_matches_plain_float64_loops(branches, sink):
    case = {"shape": "b4s2h3m8n12d8", "branches": branches, "sink": sink, "splits": 1}
    inputs = md.merge_inputs(case, seed=case_seed("D5", case))
    ml, sl = ([int(x) for x in inputs[k]] for k in ("main_lens", "swa_lens"))
    ref = md.merge_reference(inputs, case)
    sv = md.sink_value(sink)
    o, lse = loops(
        inputs["Q"].double().tolist(),
        [(inputs["KV_main"].double().tolist(), lambda b, t, j: j < ml[b]),
         (inputs["KV_swa"].double().tolist(), lambda b, t, j: j < sl[b] and j <= sl[b] - 2 + t)],
        None if sv is None else [sv] * 3,
    )
    _close(ref, o, lse)
    assert torch.isfinite(ref["O"]).all()
    if sv == INF:
        assert (ref["O"] == 0).all() and torch.equal(ref["LSE"], md.merge_reference(inputs, {**case, "sink": "none"})["LSE"])
    if sv == -INF:
        assert torch.equal(ref["O"], md.merge_reference(inputs, {**case, "sink": "none"})["O"])


def test_merge_identity_two_branches_merged_by_lse_equal_one_softmax_over_the_union():
    """Two branches merged by LSE equal one softmax over the union (also empty); the sink applies after."""
    for branches in ("k+k", "0+k", "k+0", "0+0"):
        case = {"shape": "b4s2h64m128n256d64", "branches": branches, "sink": "none", "splits": 1}
        inputs = md.merge_inputs(case, seed=11)
        vm, vs = md.merge_valids(inputs, case)
        union = md.masked_attention(inputs["Q"], [inputs["KV_main"], inputs["KV_swa"]], [vm, vs])
        main = md.masked_attention(inputs["Q"], [inputs["KV_main"]], [vm])
        swa = md.masked_attention(inputs["Q"], [inputs["KV_swa"]], [vs])
        o, lse = md.merge_branches(main["O"], main["LSE"], swa["O"], swa["LSE"])
        assert torch.equal(torch.isinf(lse), torch.isinf(union["LSE"]))
        fin = torch.isfinite(lse)
        assert torch.allclose(lse[fin], union["LSE"][fin], rtol=0, atol=1e-9)
        assert torch.allclose(o, union["O"], rtol=0, atol=1e-9)
        assert torch.equal(union["O"], md.merge_reference(inputs, case)["O"])
    # a key present in both branches counts twice
    q = torch.randn(1, 1, 2, 8, dtype=torch.float64)
    kv = torch.randn(1, 4, 8, dtype=torch.float64)
    ok = torch.ones(1, 1, 4, dtype=torch.bool)
    twice = md.masked_attention(q, [kv, kv], [ok, ok])
    once = md.masked_attention(q, [kv], [ok])
    assert torch.allclose(twice["LSE"], once["LSE"] + math.log(2.0)) and torch.allclose(twice["O"], once["O"])


# -- inputs


def test_swa_inputs_nan_past_every_fill_level_lonely_beside_full_never_zeros():
    for stage in ("D3", "D4"):
        for case in matrix(stage):
            p = md.parse_shape(case["shape"])
            if case["splits"] != 1 or p["d"] != 512 or p["s_q"] > 2:
                continue
            inputs = md.swa_inputs(case, case_seed(stage, case))
            lens = [int(x) for x in inputs["swa_lens"]]
            n, s_q = p["n"], p["s_q"]
            want = {"full": n, "below": s_q - 1, "at": s_q}.get(case["fill"], case["fill"])
            if case["fill"] == "random":
                assert 1 <= lens[0] < n
            else:
                assert lens[0] == want
            assert lens[1:4] == [0, n, lens[3]] and 1 <= lens[3] < n, lens  # lonely beside full
            kv = inputs["KV"].float()
            for b, L in enumerate(lens):
                assert torch.isnan(kv[b, L:]).all() and torch.isfinite(kv[b, :L]).all()
                if L:
                    assert (kv[b, :L] != 0).float().mean() > 0.99
            assert (inputs["Q"] != 0).float().mean() > 0.99
            if case["shape"] == "b4s1h64n256d512":
                ref = (md.swa_reference if stage == "D3" else md.causal_swa_reference)(inputs, case)
                assert torch.isfinite(ref["O"]).all()
                assert torch.isinf(ref["LSE"][1]).all(), "batch 1 is lonely"


def test_merge_inputs_spread_lse_so_every_sink_value_matters():
    case = {"shape": "b4s2h128m128n256d512", "branches": "k+k", "sink": "none", "splits": 1}
    inputs = md.merge_inputs(case, case_seed("D5", case))
    lse = md.merge_reference(inputs, case)["LSE"]
    fin = lse[torch.isfinite(lse)]
    assert fin.min() < -5 and fin.max() > 5, (float(fin.min()), float(fin.max()))
    assert torch.isnan(inputs["sink"]).all(), "sink none: NaN, so a kernel reading it fails"
    for name, n, lens in (("KV_main", 128, inputs["main_lens"]), ("KV_swa", 256, inputs["swa_lens"])):
        assert [int(x) for x in lens] == [n, [int(x) for x in lens][1], 1, 65]
        for b, L in enumerate(lens.tolist()):
            assert torch.isnan(inputs[name][b, L:].float()).all() and torch.isfinite(inputs[name][b, :L].float()).all()


# -- key limits, tile visits


def test_key_limit_matches_the_causal_rule():
    for n, s_q in ((256, 1), (256, 2), (256, 3), (64, 3)):
        for fill in range(0, n + 1):
            for t in range(s_q):
                want = sum(1 for j in range(n) if j < fill and j <= fill - s_q + t)
                assert sch.key_limit(n, fill, True, s_q, t) == want
            assert sch.key_limit(n, fill) == fill
    assert sch.key_limit(128, None) == 128 and sch.key_limit(128, 500) == 128 and sch.key_limit(128, -3) == 0


@pytest.mark.parametrize("t1,t2", [(4, 0), (2, 16), (3, 5)])
def test_visit_tiles_is_the_valid_tiles_of_the_split_in_order(t1, t2):
    total = t1 + t2
    for splits in (1, 2, 3, total, total + 3):
        chunk = sch.tiles_per_split(total, splits)
        for v1 in range(t1 + 1):
            for v2 in range(t2 + 1):
                covered = []
                for s in range(splits):
                    begin, end = s * chunk, min(s * chunk + chunk, total)
                    plan = sch.visit_tiles(begin, end, t1, v1, v2 if t2 else None)
                    want = [g for g in range(begin, end) if (g < t1 and g < v1) or (g >= t1 and g - t1 < v2)]
                    got = [(t if not second else t1 + t) for second, t in (plan.tile(i) for i in range(max(plan.count, 0)))]
                    assert got == want, (splits, s, v1, v2, plan)
                    covered += got
                assert covered == [g for g in range(total) if g < v1 or t1 <= g < t1 + v2]
    d2 = sch.visit_tiles(3, 5, 8, 8)  # D2: one unmasked branch, the range itself
    assert d2 == sch.VisitPlan(2, 2, 3, 0)


def test_combine_with_sink_and_empty_splits():
    """3 splits (one empty) merged, then the sink; all-empty rows stay O = 0, LSE = +inf."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 12, generator=g, dtype=torch.float64) * 2
    v = torch.randn(12, 8, generator=g, dtype=torch.float64)
    parts = [range(0, 5), range(5, 5), range(5, 12)]
    o_p, l_p = [], []
    for r in parts:
        idx = list(r)
        if not idx:
            o_p.append(torch.full((3, 8), float("nan"), dtype=torch.float64))  # never read
            l_p.append(torch.full((3,), -INF, dtype=torch.float64))
            continue
        ss = s[:, idx]
        o_p.append(torch.cat([torch.softmax(ss, -1) @ v[idx], torch.zeros(1, 8, dtype=torch.float64)]))
        l_p.append(torch.cat([torch.logsumexp(ss, -1), torch.tensor([-INF], dtype=torch.float64)]))
    sink = torch.tensor([0.5, 3.0, 1.0], dtype=torch.float64)
    o, lse = combine_reference(torch.stack(o_p), torch.stack(l_p), sink)
    want_lse = torch.logsumexp(s, -1)
    want_o = (torch.softmax(s, -1) @ v) / (1 + torch.exp(sink[:2] - want_lse))[:, None]
    assert torch.allclose(lse[:2], want_lse) and torch.allclose(o[:2], want_o)
    assert lse[2] == INF and (o[2] == 0).all()
    o_inf, _ = combine_reference(torch.stack(o_p), torch.stack(l_p), torch.full((3,), INF, dtype=torch.float64))
    assert (o_inf == 0).all()


# -- the kernels' view of the matrices


@pytest.mark.parametrize("stage,module", [("D3", "stages.D3_swa.sm90"), ("D4", "stages.D4_causal_swa.sm90"),
                                          ("D5", "stages.D5_sink_merge.sm90")])
def test_kernels_accept_their_matrix_within_the_scratch(stage, module):
    Kernel = importlib.import_module(module).Kernel
    tensors = md.swa_tensors if stage != "D5" else md.merge_tensors
    for case in matrix(stage):
        params = {k: case[k] for k in ("shape", "splits", "sink") if k in case}
        k = Kernel(**params)
        cap = {s.name: s for s in tensors(case)}["O_part"].shape[0]
        assert k.splits == 1 or k.splits <= cap, case
        if case["splits"] == "many":
            assert k.splits > k.sched.num_tiles
        assert k.masked and (k.has_sink == (case.get("sink", "none") != "none"))
    with pytest.raises(ValueError, match="sink"):
        importlib.import_module("stages.D5_sink_merge.sm90").Kernel(shape="b1s1h64m64n64d512", splits=1, sink="lots")
    with pytest.raises(ValueError, match="n_swa"):
        importlib.import_module("stages.D5_sink_merge.sm90").Kernel(shape="b1s1h64m64n100d512", splits=1, sink="none")


# -- planted bugs move the LSE past tolerance on their GPU cases


def lse_only(q, kv, valid):
    """float64 LSE [b, h_q, s_q] over the valid keys (+inf when none)."""
    q, kv = q.double(), kv.double()
    kv = torch.where(valid.any(dim=1)[..., None], kv, torch.zeros_like(kv))
    s = torch.einsum("bthd,bnd->bthn", q, kv) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s.masked_fill(~valid[:, :, None, :], -INF), dim=-1)
    return torch.where(torch.isneginf(lse), torch.full_like(lse, INF), lse).permute(0, 2, 1)


def _lse_verdict(stage: str, out, ref) -> str:
    return judge({"LSE": tolerances(stage)["LSE"]}, {"LSE": compare(out.float(), ref).to_json()})[0]


def test_planted_off_by_one_fill_mask_fails_every_d3_case_of_its_gpu_test():
    for case in matrix("D3"):
        if case["shape"] != "b4s1h64n256d512" or case["splits"] != 1:
            continue
        inputs = md.swa_inputs(case, case_seed("D3", case))
        lens = [int(x) for x in inputs["swa_lens"]]
        ref = lse_only(inputs["Q"], inputs["KV"], md.valid_keys(lens, 256, 1, False))
        wrong = lse_only(inputs["Q"], inputs["KV"], md.valid_keys([max(L - 1, 0) for L in lens], 256, 1, False))
        assert _lse_verdict("D3", ref, ref) == "pass"
        assert _lse_verdict("D3", wrong, ref) == "fail", case


def test_planted_causal_limit_ignoring_t_fails_every_d4_case_with_two_tokens_or_more():
    for case in matrix("D4"):
        p = md.parse_shape(case["shape"])
        if p["s_q"] < 2 or case["splits"] != 1:
            continue
        inputs = md.swa_inputs(case, case_seed("D4", case))
        lens = [int(x) for x in inputs["swa_lens"]]
        valid = md.valid_keys(lens, p["n"], p["s_q"], True)
        ref = lse_only(inputs["Q"], inputs["KV"], valid)
        wrong = lse_only(inputs["Q"], inputs["KV"], valid[:, :1].expand_as(valid))  # WRONG: token 0's keys for every t
        assert _lse_verdict("D4", ref, ref) == "pass"
        assert _lse_verdict("D4", wrong, ref) == "fail", case


def test_planted_sink_in_lse_fails_every_d5_case_of_its_gpu_test():
    for case in matrix("D5"):
        if case["splits"] != 1 or str(case["sink"]) not in ("-5", "0", "5", "inf") or case["branches"] == "0+0" \
                or case["shape"] != "b4s2h128m128n256d512":
            continue
        inputs = md.merge_inputs(case, case_seed("D5", case))
        vm, vs = md.merge_valids(inputs, case)
        ref = lse_only(inputs["Q"], torch.cat([inputs["KV_main"], inputs["KV_swa"]], 1), torch.cat([vm, vs], -1))
        sink = inputs["sink"].double()[None, :, None].expand_as(ref)
        wrong = torch.where(torch.isinf(ref), ref, torch.logaddexp(ref, sink))
        assert _lse_verdict("D5", ref, ref) == "pass"
        assert _lse_verdict("D5", wrong, ref) == "fail", case


def test_lse_only_is_the_oracles_lse():
    case = {"shape": "b4s2h128m128n256d512", "branches": "k+k", "sink": 0, "splits": 1}
    inputs = md.merge_inputs(case, 3)
    vm, vs = md.merge_valids(inputs, case)
    got = lse_only(inputs["Q"], torch.cat([inputs["KV_main"], inputs["KV_swa"]], 1), torch.cat([vm, vs], -1))
    assert torch.equal(torch.isinf(got), torch.isinf(md.merge_reference(inputs, case)["LSE"]))
    fin = torch.isfinite(got)
    assert torch.allclose(got[fin], md.merge_reference(inputs, case)["LSE"][fin], rtol=0, atol=1e-9)


# -- the D5 kernel, compiled (no GPU): ~60 s


def test_d5_builds_one_launch_over_both_branches_q_once_and_combines_with_the_sink(tmp_path):
    """Both branches in one kernel (plus combine), Q by one TMA box per 64 columns; no spills."""
    import re
    import shutil

    from harness.execution.compile import Compiler
    from harness.notebook.inventory import families
    from harness.spec.spec import load_spec

    old = os.environ.get("DSV4_LAB_CACHE")
    os.environ["DSV4_LAB_CACHE"] = str(tmp_path)
    try:
        spec = load_spec(root=ROOT)
        compiler = Compiler(spec.root)
        case = {"shape": "b4s2h128m128n256d512", "branches": "k+k", "sink": 5, "splits": "many"}
        res = compiler.submit(spec.stages["D5"], "sm_90a", case).result()
        compiler.close()
    finally:
        if old is None:
            del os.environ["DSV4_LAB_CACHE"]
        else:
            os.environ["DSV4_LAB_CACHE"] = old
    assert res.ok, res.error
    ptx = Path(res.ptx_path).read_text()
    assert ptx.count(".entry ") == 2  # one launch for both branches
    fam = families(res.inventory)
    assert fam.get("cp.async.bulk.tensor") == 512 // 64 * 3, fam  # Q: 8 boxes; KV: 8 per branch
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    if shutil.which("ptxas"):
        assert res.resources["spill"] == 0, res.resources


@pytest.mark.parametrize("sink", ["none", "-inf", 0, "inf"])
def test_torch_peer_matches_the_oracle_and_never_nans(sink):
    for branches in ("k+k", "0+k", "0+0"):
        case = {"shape": "b4s2h64m128n256d64", "branches": branches, "sink": sink, "splits": 1}
        inputs = md.merge_inputs(case, 3)
        ref = md.merge_reference(inputs, case)
        o, lse = md.torch_merge(inputs, case)
        assert torch.isfinite(o).all(), (branches, sink)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref["LSE"]))
        if ref["O"].abs().sum() > 0:
            assert torch.nn.functional.cosine_similarity(o.double().flatten(), ref["O"].flatten(), dim=0) > 0.9999
        else:
            assert (o == 0).all()


# -- the lonely-row rule is a compile-time switch

_SOFTMAX_PROBE = '''
import os, re
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from stages.common.softmax import OnlineSoftmax


class Probe:
    def __init__(self, lonely):
        self.lonely = lonely

    @cute.jit
    def __call__(self, S: cute.Tensor, A: cute.Tensor, stream):
        self.kernel(S, A).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, S: cute.Tensor, A: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        s = cute.make_rmem_tensor(cute.make_layout((2, 4)), cutlass.Float32)
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(4):
                s[r, j] = S[tidx, r * 4 + j]
        sm = OnlineSoftmax.create(2, 1.4426950408889634, lonely_rows=self.lonely)
        alpha = sm.update(s)
        for r in cutlass.range_constexpr(2):
            A[tidx, r] = alpha[r] + s[r, 0]


for lonely in (True, False):
    S = make_fake_compact_tensor(cutlass.Float32, (32, 8), stride_order=(1, 0), assumed_align=16)
    A = make_fake_compact_tensor(cutlass.Float32, (32, 2), stride_order=(1, 0), assumed_align=16)
    c = cute.compile(Probe(lonely), S, A, make_fake_stream())
    raw = c.__ptx__ or ""
    ptx = open(raw).read() if raw and "\\n" not in raw and os.path.isfile(raw) else raw
    body = ptx[ptx.index(".entry"):]
    print("LONELY" if lonely else "PLAIN", len(re.findall(r"\\bselp\\.(?:f32|b32)", body)))
'''


def test_softmax_lonely_row_select_is_traced_only_when_asked(tmp_path):
    """lonely_rows=True emits one select a row; False none."""
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(_SOFTMAX_PROBE)
    dump = tmp_path / "dump"
    dump.mkdir()
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(dump),
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    assert "LONELY 2" in out and "PLAIN 0" in out, out[-2000:]


# -- the house's planning code over every case


@pytest.mark.parametrize("stage,module", [("D3", "stages.D3_swa.sm90"), ("D4", "stages.D4_causal_swa.sm90"),
                                          ("D5", "stages.D5_sink_merge.sm90")])
def test_house_visits_exactly_the_valid_keys_once_over_all_splits(stage, module):
    """key_limits + visit_plan + mask_boundary visit exactly the oracle's valid keys, each once."""
    Kernel = importlib.import_module(module).Kernel
    for case in matrix(stage):
        params = {k: case[k] for k in ("shape", "splits", "sink") if k in case}
        k = Kernel(**params)
        seed = case_seed(stage, case)
        if stage == "D5":
            lens = md.branch_levels(case, seed)
            p = md.parse_branch_shape(case["shape"])
            caps, causal = (p["n_main"], p["n_swa"]), (False, True)
        else:
            lens = (md.fill_levels(case, seed), None)
            p = md.parse_shape(case["shape"])
            caps, causal = (p["n"],), (stage == "D4",)
        seen = {}
        gx, gy, gz = k.sched.grid
        for bx in range(gx):
            for by in range(gy):
                for bz in range(gz):
                    work = k.sched.work(bx, by, bz)
                    limits = k.key_limits(work, *lens)
                    plan = k.visit_plan(work, limits)
                    for i in range(max(plan.count, 0)):
                        second, tile = plan.tile(i)
                        br = int(second)
                        rem = limits[br] - tile * k.block_n
                        assert rem > 0, (case, work, i)  # a visited tile holds a valid key
                        for j in range(min(rem, k.block_n)):
                            key = (work.batch, work.token, work.head_block, br, tile * k.block_n + j)
                            seen[key] = seen.get(key, 0) + 1
        assert all(v == 1 for v in seen.values()), case
        for br, (n, c) in enumerate(zip(caps, causal)):
            valid = md.valid_keys(lens[br], n, p["s_q"], c)
            want = {(b, t, h, br, j) for b, t, j in valid.nonzero().tolist() for h in range(p["h_q"] // 64)}
            got = {key for key in seen if key[3] == br}
            assert got == want, (case, br, len(got ^ want))
