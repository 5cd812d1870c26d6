"""The peers' suites (oracles/suites/): case lists, generators, pass rules, executor, bad blocks."""

import json
import math
from collections import Counter

import pytest

from harness.spec.spec import load_spec
from tests.conftest import ROOT, run_cli


def _find(module, **want):
    for i, u in enumerate(module.upstream()):
        if all(getattr(u, k) == v for k, v in want.items()):
            return i, u
    raise AssertionError(f"no upstream case with {want}")


def _case(module, i: int) -> dict:
    return next(c for c in module.cases() if c["id"] == i)


# The case lists against upstream's


def _set(monkeypatch, mod, **values) -> None:
    for name, value in values.items():
        monkeypatch.setattr(mod, name, value)


def _fp32_only(monkeypatch, m, p) -> None:
    _set(monkeypatch, m, LOGITS=("fp32",), COMPRESSED=False)
    _set(monkeypatch, p, LOGITS=("fp32",), CONTEXT_2D=False)


def _why(*mods) -> Counter:
    return Counter(r.split(":")[0] for mod in mods for u in mod.upstream() for r in mod.reasons(u))


def test_flashmla_case_list_matches_upstream_gen_testcase():
    """FlashMLA@9241ae3: 3680 + 1036 + 32 cases; 246 at d_qk 576, 4 at topk 16384."""
    from oracles.suites import flashmla_sparse as f

    u = f.upstream()
    assert len(u) == 4748
    assert Counter(x.group for x in u) == {"correctness": 3680, "corner": 1036, "performance": 32}
    assert sum(x.d_qk == 576 for x in u) == 246
    reasons = Counter(r.split(" (")[0].split(":")[0] for x in u for r in f.reasons(x))
    assert reasons == {"DeepSeek-V3.2 layout": 246}  # topk 16384: streamed
    listed = f.cases()
    assert len(listed) == 4502 == sum(not f.reasons(x) for x in u)
    assert len({(c["b"], c["config"]) for c in listed}) == 926
    assert {c["config"] for c in listed if c["group"] == "performance" and c["b"] == 148 and "m16384" in c["config"]} \
        == {"s2h64_m16384bs64", "s2h128_m16384bs64"}
    assert all(c["kv_format"] == "model1" for c in listed)
    # corner: all-invalid, zero-length or sink
    assert all(x.all_invalid or x.zero_seqlen or x.sink for x in u if x.group == "corner")
    # E's production config
    assert any(c["config"] == "s2h128_m128bs256_x1024bs64" and c["b"] == 148 for c in listed)


def test_deepgemm_case_lists_match_upstream(monkeypatch):
    """DeepGEMM@54e2261 + @80ceeb2: 246 cases, 41 in reach of I1/I2, per reason."""
    from oracles.suites import deepgemm_mqa as m, deepgemm_paged as p

    for mod in (m, p):  # the tables before issue 35
        _set(monkeypatch, mod, HEADS=(64,), HEAD_DIMS=(128,))
    _fp32_only(monkeypatch, m, p)
    assert (len(m.upstream()), len(p.upstream())) == (216, 30)
    assert Counter(u.commit for u in m.upstream()) == {"54e2261": 192, "80ceeb2": 24}
    assert Counter(u.commit for u in p.upstream()) == {"54e2261": 24, "80ceeb2": 6}
    assert (len(m.cases()), len(p.cases())) == (32, 9)
    why = _why(m, p)
    assert why["heads 32"] == 108 and why["bf16 logits"] == 108
    assert why["compressed logits ([s, max(ke − ks)] indexed from ks)"] == 96
    assert why["head_dim 32"] == 64 and why["head_dim 64"] == 64
    assert why["per-token context lengths [b, next_n] (token t sees keys < ctx[b, t])"] == 12
    assert sum(not (m.reasons(u)) for u in m.upstream()) + sum(not p.reasons(u) for u in p.upstream()) == 246 - 205


def test_a_table_edit_makes_cases_supported(monkeypatch):
    """Reasons come from each module's table."""
    from oracles.suites import flashmla_sparse as f

    assert sum(not f.reasons(u) for u in f.upstream()) == 4502  # topk up to 32768 (issue 35 item 1)
    monkeypatch.setattr(f, "MAX_TOPK", 2048)  # the older table
    assert sum(not f.reasons(u) for u in f.upstream()) == 4500
    assert sum(r.startswith("topk > ") for u in f.upstream() for r in f.reasons(u)) == 4
    from oracles.suites import deepgemm_paged as p

    monkeypatch.setattr(p, "CONTEXT_2D", False)  # one option taken away
    assert sum("per-token" in r for u in p.upstream() for r in p.reasons(u)) == 12


def test_deepgemm_heads_and_head_dims_are_supported_and_reach_the_kernel(monkeypatch):
    """Issue 35.2: heads 32|64, head_dim 32|64|128 supported (84 of 246) and reach the kernel."""
    from oracles.suites import deepgemm_mqa as m, deepgemm_paged as p

    _fp32_only(monkeypatch, m, p)
    assert (len(m.cases()), len(p.cases())) == (72, 12)
    why = _why(m, p)
    assert not any(k.startswith(("heads", "head_dim")) for k in why), why
    assert {(c["heads"], c["head_dim"]) for c in m.cases()} == {(h, d) for h in (32, 64) for d in (32, 64, 128)}
    assert {c["heads"] for c in p.cases()} == {32, 64}
    stages = load_spec(root=ROOT).stages
    for sid, mod in (("I1_DEEPGEMM", m), ("I2_DEEPGEMM", p)):
        assert {"heads", "head_dim"} <= set(stages[sid].kernel_params)
        for c in mod.cases()[::7]:
            q = mod.tensors(c)[0]
            assert q.shape[-2:] == (c["heads"], c["head_dim"]), (sid, c)


def test_deepgemm_bf16_logits_are_supported_and_reach_the_kernel():
    """Issue 35.2: bf16 logits: 138 of 246 supported; the dtype reaches kernel and output."""
    from oracles.suites import deepgemm_mqa as m, deepgemm_paged as p

    assert (len([c for c in m.cases() if not c["compressed"]]),
            len([c for c in p.cases() if not (c["context_2d"] and c["next_n"] > 1)])) == (120, 18)
    why = _why(m, p)
    assert not any("bf16" in k for k in why), why
    stages = load_spec(root=ROOT).stages
    for sid, mod in (("I1_DEEPGEMM", m), ("I2_DEEPGEMM", p)):
        assert "logits_dtype" in stages[sid].kernel_params
        dtypes = {c["logits_dtype"]: mod.tensors(c)[-1].dtype for c in mod.cases()}
        assert dtypes == {"fp32": "float32", "bf16": "bfloat16"}, (sid, dtypes)


def test_deepgemm_compressed_logits_are_supported_and_judged_decompressed():
    """Issue 35.2: compressed: 234 of 246; `compressed` reaches the kernel, judged via `decompress`."""
    import torch

    from oracles import indexer
    from oracles.suites import deepgemm_mqa as m

    assert len(m.cases()) == 216
    assert "compressed" in load_spec(root=ROOT).stages["I1_DEEPGEMM"].kernel_params
    comp = [c for c in m.cases() if c["compressed"]]
    assert len(comp) == 96
    for c in comp[::13]:
        ks, ke = m.ranges(m.upstream()[c["id"]])
        assert m.tensors(c)[-1].shape == (c["s"], max(e - b for b, e in zip(ks, ke))) and max(ke) <= c["s_kv"]
    g = torch.Generator().manual_seed(1)
    full = torch.randn(6, 40, generator=g, dtype=torch.float64)
    ks = torch.tensor([0, 3, 10, 7, 20, 5], dtype=torch.int32)
    ke = torch.tensor([5, 30, 10, 2, 40, 6], dtype=torch.int32)  # an empty row, a row with ks > ke
    j = torch.arange(40)[None, :]
    masked = full.masked_fill(~((j >= ks[:, None]) & (j < ke[:, None])), -math.inf)
    width = indexer.compressed_width(ks.tolist(), ke.tolist())
    assert width == 27
    assert torch.equal(m.decompress(indexer.compress(masked, ks, ke, width), ks, ke, 40), masked)


def test_deepgemm_context_2d_is_supported_and_reaches_the_kernel():
    """Issue 35.2: 2-D context: all 246; per-token lengths as context_2d; flops per token."""
    from oracles.suites import deepgemm_paged as p

    assert len(p.cases()) == 30 and not any(p.reasons(u) for u in p.upstream())
    assert "context_2d" in load_spec(root=ROOT).stages["I2_DEEPGEMM"].kernel_params
    two = [c for c in p.cases() if c["context_2d"]]
    assert len(two) == 24 and {c["commit"] for c in two} == {"54e2261"}
    c = next(c for c in two if c["next_n"] == 2 and c["b"] == 256)
    u = p.upstream()[c["id"]]
    lens = p.token_lens(u, c["id"])
    assert p.tensors(c)[2].shape == (u.b, 2) and [r[-1] for r in lens] == p.context_lens(u, c["id"])
    assert all(0 <= r[0] <= r[1] for r in lens) and len({r[0] for r in lens}) > 1
    assert p.flops(c) == 2.0 * u.heads * u.head_dim * sum(sum(r) for r in lens)


def test_suite_list_counts_total_supported_and_reasons():
    r = run_cli(["suite", "deepgemm", "--list"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "suite deepgemm: 246 cases, 246 supported" in r.stdout
    assert "216 cases, 216 supported" in r.stdout and "30 cases, 30 supported" in r.stdout
    assert "unsupported: " not in r.stdout.split("oracles.suites.deepgemm_mqa")[1]
    r = run_cli(["suite", "flashmla", "--list"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "4748 cases, 4502 supported over 926 compiled kernels" in r.stdout
    assert "  246  unsupported: DeepSeek-V3.2 layout" in r.stdout
    r = run_cli(["suite", "nosuch", "--list"], cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "dsv4-lab: no suite 'nosuch' — known: deepgemm, flashmla (oracles/suites/__init__.py)"


# The generators


def test_flashmla_generators_follow_upstream_distributions():
    import torch

    from oracles import kvcache as kc
    from oracles.suites import flashmla_sparse as f

    i, u = _find(f, d_qk=512, b=4, s_q=3, s_k=512, block=64, h_q=64, topk_len=True, extra_topk=64, extra_block=64,
                 extra_topk_len=True, group="correctness")
    case = _case(f, i)
    x = f.make_inputs(case, seed=123)
    assert torch.equal(x["Q"], f.make_inputs(case, seed=7)["Q"])  # seeded by the upstream case, not --seed
    # sm_scale = d_qk^-0.55, Q unscaled
    assert x["softmax_scale"].dtype == torch.float32 and tuple(x["softmax_scale"].shape) == (1,)
    assert float(x["softmax_scale"][0]) == float(torch.tensor(512 ** -0.55, dtype=torch.float32))
    q = x["Q"].float()
    assert float(q.abs().max()) == 1.0  # N(0,1) clamped to [-1, 1]
    frac_clamped = float((q.abs() == 1.0).float().mean())  # the clamped ones
    assert 0.28 < frac_clamped < 0.36  # P(|N(0,1)| ≥ 1) = 0.317
    sink = x["sink"]
    assert 10 <= int((sink == math.inf).sum()) <= 30 and 10 <= int((sink == -math.inf).sum()) <= 30  # P = 0.31 each of 64
    for idx_name, len_name, kv_name, block in (("idx", "topk_length", "KV", u.block),
                                               ("idx_extra", "extra_length", "KV_extra", u.extra_block)):
        idx, length, kv = x[idx_name], x[len_name], x[kv_name]
        assert int(length.min()) >= 0 and int(length.max()) <= u.topk
        for row in idx.view(-1, idx.shape[-1]):
            valid = row[row != -1]
            assert valid.numel() == valid.unique().numel()  # distinct positions
            n = valid.numel()
            assert bool((row[n:] == -1).all())  # −1 only after the valid ones (seqlen < topk)
        live = (torch.arange(idx.shape[-1])[None, None, :] < length[:, None, None]) & (idx != -1)
        used = torch.unique(idx[live].long())
        vals = kc.read_tokens(kv, "model1", block, used)
        assert bool(torch.isfinite(vals).all()) and float(vals.abs().max()) <= 1.0
        assert 0.08 < float(vals.std()) < 0.12  # N(0,1)/10, clamped
        others = torch.ones(kv.shape[0] * block, dtype=torch.bool)
        others[used] = False
        assert bool(torch.isnan(kc.read_tokens(kv, "model1", block, others.nonzero().flatten()[:200])).all())
    assert f.tensors(case)[1].shape == tuple(x["KV"].shape)


def test_flashmla_corner_generators():
    from oracles.suites import flashmla_sparse as f

    i, _ = _find(f, d_qk=512, group="corner", b=74, all_invalid=True, sink=False, extra_topk=None, topk_len=False,
                 h_q=64, block=61)
    x = f.make_inputs(_case(f, i), 0)
    assert bool((x["idx"] == -1).all()) and bool((x["sink"] == -math.inf).all())
    i, u = _find(f, d_qk=512, group="corner", b=74, all_invalid=False, zero_seqlen=True, extra_topk=None, topk_len=False,
                 h_q=64, block=61)
    x = f.make_inputs(_case(f, i), 0)
    empty = (x["idx"] == -1).view(u.b, -1).all(dim=1)
    assert 20 < int(empty.sum()) < 54  # about half of 74 empty


def test_deepgemm_generators_follow_upstream():
    import torch

    from oracles.suites import deepgemm_mqa as m, deepgemm_paged as p

    u = m.Upstream("x", 2048, 8192, 64, 128, cp=True)  # cp_size 4, rank 1, chunk 1024
    ks, ke = m.ranges(u)
    assert ks == [0] * 2048 and ke[0] == 1024 and ke[1023] == 2047 and ke[1024] == 6 * 1024 and ke[2047] == 6 * 1024 + 1023
    ks, ke = m.ranges(m.Upstream("x", 2048, 4096, 64, 128, cp=False))
    assert ke[0] == 2048 and ke[-1] == 4095
    x = torch.randn(300, 128).to(torch.bfloat16) * torch.rand(300, 1).to(torch.bfloat16)
    v8, sf = m.fp8_per_token(x)
    assert torch.allclose(v8.float().abs().amax(dim=-1), torch.full((300,), 448.0))  # amax ↦ 448
    assert torch.allclose(sf, x.float().abs().amax(dim=-1).clamp(min=1e-4) / 448)
    for i, u in enumerate(p.upstream()):
        lens = p.context_lens(u, i)
        assert len(lens) == u.b and min(lens) >= int(0.7 * u.avg_kv) and max(lens) < int(1.3 * u.avg_kv)
        geo = p.geometry(u, i)
        if u.commit == "54e2261":
            assert geo["num_blocks"] == sum(math.ceil(n / 64) for n in lens)
        else:
            assert geo["num_blocks"] == 333_000 and geo["max_len"] == 111_040
        assert geo["width"] * 64 >= max(lens)


# The pass rules


def test_flashmla_rule_passes_the_oracle_and_fails_planted_errors():
    import torch

    from oracles.suites import flashmla_sparse as f

    i, _ = _find(f, d_qk=512, b=4, s_q=3, s_k=512, block=64, h_q=64, topk_len=True, extra_topk=64, extra_block=64,
                 extra_topk_len=True, group="correctness")
    case = _case(f, i)
    ref = f.reference(f.make_inputs(case, 0), case)
    good = {"O": ref["O"].to(torch.bfloat16), "LSE": ref["LSE"].float()}
    v = f.criterion(good, ref, case)
    assert v["O"]["suite_ok"] and v["LSE"]["suite_ok"], v
    bad_o = good["O"].clone()
    bad_o.view(-1)[bad_o.view(-1).abs().argmax()] *= 1.05  # one element 5 % off
    v = f.criterion({**good, "O": bad_o}, ref, case)
    assert not v["O"]["suite_ok"] and "1 of" in v["O"]["suite_why"] and v["LSE"]["suite_ok"]
    bad_lse = good["LSE"].clone()
    bad_lse.view(-1)[0] = math.inf  # a lonely row where there is none
    v = f.criterion({**good, "LSE": bad_lse}, ref, case)
    assert not v["LSE"]["suite_ok"] and "+inf at 1 positions" in v["LSE"]["suite_why"]
    bad_lse = good["LSE"] + 2e-4 * good["LSE"].abs()  # beyond rel 8.01/65536
    assert not f.criterion({**good, "LSE": bad_lse}, ref, case)["LSE"]["suite_ok"]


def test_deepgemm_rule_passes_the_reference_and_fails_planted_errors():
    import torch

    from oracles.suites.criteria import calc_diff, diff_below

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 256, generator=g, dtype=torch.float64)
    ref[:, 200:] = -math.inf
    ok = diff_below(ref.float(), {"unquantised": (ref, 1e-3)}, neginf_ref=ref)
    assert ok["suite_ok"] and ok["suite_diff_unquantised"] < 1e-12
    noisy = ref + 0.1 * torch.randn(64, 256, generator=g, dtype=torch.float64)  # calc_diff ≈ 0.005
    bad = diff_below(noisy.float(), {"unquantised": (ref, 1e-3)}, neginf_ref=ref)
    assert not bad["suite_ok"] and "calc_diff vs unquantised" in bad["suite_why"]
    hole = ref.clone()
    hole[0, 0] = -math.inf
    bad = diff_below(hole.float(), {"unquantised": (ref, 1e-3)}, neginf_ref=ref)
    assert not bad["suite_ok"] and "-inf at 3585 positions, the reference at 3584" in bad["suite_why"]
    # 54e2261's paged rule: a hole fails; −inf masked
    assert not diff_below(hole.float().masked_fill(ref == -math.inf, 0), {"u": (ref, 1e-3)})["suite_ok"]
    junk = ref.masked_fill(ref == -math.inf, 5.0)
    assert diff_below(junk.float().masked_fill(ref == -math.inf, 0), {"u": (ref, 1e-3)})["suite_ok"]
    assert calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert not diff_below(torch.full((4,), math.nan), {"u": (torch.ones(4, dtype=torch.float64), 1e-3)})["suite_ok"]


# Suite stages via the executor


SUITE_MODULE = '''
from oracles.add import make_inputs, reference, tensors  # noqa: F401


def cases():
    return [{"n": 16, "id": 0}, {"n": 32, "id": 1}]


def criterion(outputs, ref, case):
    d = float((outputs["out"].double() - ref["out"]).abs().max())
    return {"out": {"suite_ok": d < 1e-6, "suite_why": "" if d < 1e-6 else f"max diff {d:.3g}", "suite_max": d}}


def silent(outputs, ref, case):
    return {}
'''

NUDGE_KERNEL = '''
class Nudge:
    """a + b, 1e-4 relative off: inside cosine 0.9999, outside the suite's rule."""

    def __init__(self, *, n: int):
        self.n = n

    def __call__(self, a, b, out):
        out.copy_((a + b) * (1 + 1e-4))
'''


def _suite_stage(sid: str, entry: str = "Add", criterion: str = "criterion", extra: str = "") -> str:
    return (f"  {sid}:\n"
            f"    title: a suite of the fake lab\n"
            f"    dir: stages/fake\n"
            f"    kernels: {{cpu: {{module: stages.fake.{'cpu' if entry == 'Add' else 'nudge'}, entry: {entry}}}}}\n"
            f"    tensors: oracles.suite_add:tensors\n"
            f"    inputs: oracles.suite_add:make_inputs\n"
            f"    oracle: oracles.suite_add:reference\n"
            f"    suite: {{cases: oracles.suite_add:cases, criterion: oracles.suite_add:{criterion}}}\n"
            f"{extra}"
            f"    kernel_params: [n]\n"
            f"    tolerances: {{out: {{cosine_min: 0.9999}}}}\n"
            f"    timeout_s: 20\n")


@pytest.fixture(autouse=True)
def _fresh_oracles(monkeypatch):
    """Suite cases find the fake lab's `oracles`, not an earlier test's (order-proof)."""
    import sys

    for name in [m for m in sys.modules if m == "oracles" or m.startswith("oracles.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))


@pytest.fixture
def suite_lab(fake_lab):
    (fake_lab / "oracles" / "suite_add.py").write_text(SUITE_MODULE)
    (fake_lab / "stages" / "fake" / "nudge.py").write_text(NUDGE_KERNEL)
    with open(fake_lab / "stages.yaml", "a") as fh:
        fh.write(_suite_stage("SUITE") + _suite_stage("NUDGE", entry="Nudge") + _suite_stage("SILENT", criterion="silent"))
    return fake_lab


def _records(lab, sid):
    return [json.loads(line) for line in (lab / "results" / "records" / f"{sid}.jsonl").read_text().splitlines()]


def test_a_suite_stage_runs_its_listed_cases_and_records_the_rule(suite_lab):
    r = run_cli(["run", "stage-SUITE"], cwd=suite_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = _records(suite_lab, "SUITE")
    assert [(x["case"], x["status"]) for x in recs] == [({"n": 16, "id": 0}, "pass"), ({"n": 32, "id": 1}, "pass")]
    assert all(x["metrics"]["out"]["suite_ok"] == 1 and x["metrics"]["out"]["suite_max"] < 1e-6 for x in recs)
    r = run_cli(["run", "stage-SUITE", "--n", "32"], cwd=suite_lab)  # a filter on a listed key
    assert r.returncode == 0 and len(_records(suite_lab, "SUITE")) == 3


def test_the_suite_rule_fails_a_case_the_bounds_let_through(suite_lab):
    r = run_cli(["run", "stage-NUDGE"], cwd=suite_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    recs = _records(suite_lab, "NUDGE")
    assert [x["status"] for x in recs] == ["fail", "fail"]
    assert recs[0]["metrics"]["out"]["cosine"] > 0.9999  # the stage's bounds alone would pass it
    assert recs[0]["metrics"]["out"]["suite_ok"] == 0
    assert "fails the suite's pass rule" in recs[0]["error"] and "out: max diff" in recs[0]["error"]


def test_a_rule_that_says_nothing_is_a_failure(suite_lab):
    r = run_cli(["run", "stage-SILENT"], cwd=suite_lab)
    assert r.returncode == 1
    assert all(x["status"] == "fail" and "gave no verdict" in x["error"] for x in _records(suite_lab, "SILENT"))


# Bad suite blocks: one line


@pytest.mark.parametrize("body, extra, says", [
    ("def cases():\n    raise KeyError('x')\n", "", "stages.BADSUITE.suite.cases: oracles.bad_suite:cases() failed: "),
    ("def cases():\n    return []\n", "", "returned list (empty), expected a non-empty list of case dicts — "),
    ("def cases():\n    return [{'n': 16}, {'m': 3}]\n", "", "case 1 has keys ['m'], case 0 has ['n'] — give every case"),
    ("def cases():\n    return [{'n': 16, 'id': 'a,b'}]\n", "", "case 0, id: 'a,b' cannot be a case value"),
    ("def cases():\n    return [{'n': 16}, {'n': 16}]\n", "", "case 1 (n=16) is listed twice — list each case once"),
    ("def cases():\n    return [{'n': 16, 'arch': 1}]\n", "", "case key 'arch' is one of the lab's own options — rename it"),
    ("def cases():\n    return [{'n': 16}]\n", "    matrix: {n: [16]}\n",
     "stages.BADSUITE.matrix: a suite stage's cases come from suite.cases — remove matrix"),
])
def test_a_bad_suite_is_one_line(fake_lab, body, extra, says):
    (fake_lab / "oracles" / "bad_suite.py").write_text(
        "from oracles.add import make_inputs, reference, tensors  # noqa: F401\n\n" + body
        + "\n\ndef criterion(outputs, ref, case):\n    return {}\n")
    text = (_suite_stage("BADSUITE", extra=extra).replace("oracles.suite_add", "oracles.bad_suite"))
    with open(fake_lab / "stages.yaml", "a") as fh:
        fh.write(text)
    r = run_cli(["list"], cwd=fake_lab)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("dsv4-lab: stages.yaml:") and says in err, err
    if "failed" in says:
        assert "bad_suite.py:" in err and "KeyError" in err and err.endswith("— fix the suite module")


def test_all_means_the_ladder_not_the_suites(suite_lab):
    """`run --all` runs the ladder; a suite stage runs only when named."""
    from harness.commands.base import stages_of

    spec = load_spec(root=suite_lab)
    assert [st.id for st in stages_of(spec, None, True)] == ["OK", "BAD"]
    assert [st.id for st in stages_of(spec, "stage-SUITE", False)] == ["SUITE"]
    assert spec.stages["SUITE"].suite is not None and spec.stages["SUITE"].matrix == {"n": [16, 32], "id": [0, 1]}


FAKE_SUITES = '''
SUITES = {"fake": ("oracles.suite_add",)}
'''

FAKE_UPSTREAM = '''

UPSTREAM = ("nobody/fake@0000000 tests/test_add.py",)
STAGE = "OK"


def upstream():
    return (16, 32, 48)


def reasons(u):
    return ["n 48: too long for the fake kernel"] if u == 48 else []
'''


def test_suite_command_runs_and_lists_a_suite(suite_lab):
    (suite_lab / "oracles" / "suites").mkdir()
    (suite_lab / "oracles" / "suites" / "__init__.py").write_text(FAKE_SUITES)
    with open(suite_lab / "oracles" / "suite_add.py", "a") as fh:
        fh.write(FAKE_UPSTREAM)
    r = run_cli(["suite", "fake", "--list"], cwd=suite_lab)
    assert r.returncode == 0, r.stderr
    assert "stage-SUITE (on stage-OK): 3 cases, 2 supported over 2 compiled kernels, 1 unsupported" in r.stdout
    assert "        1  unsupported: n 48: too long for the fake kernel" in r.stdout
    assert not (suite_lab / "results" / "records").exists() or not list((suite_lab / "results" / "records").iterdir())
    r = run_cli(["suite", "fake", "--arch", "all", "--n", "32"], cwd=suite_lab)  # every stage of the suite's modules
    assert r.returncode == 1, r.stdout + r.stderr  # NUDGE misses the rule, SILENT gives no verdict
    assert [(x["case"], x["status"]) for x in _records(suite_lab, "SUITE")] == [({"n": 32, "id": 1}, "pass")]
    assert [x["status"] for x in _records(suite_lab, "NUDGE")] == ["fail"]
    r = run_cli(["suite", "fake", "--arch", "all", "--n", "64"], cwd=suite_lab)
    assert r.returncode == 2 and "n=64 is not in the matrix" in r.stderr


@pytest.mark.gpu
def test_deepgemm_mqa_reference_on_the_gpu_equals_the_stage_reference():
    """The suite's GPU reference equals stage I1's on upstream cases."""
    import torch

    from oracles import indexer
    from oracles.suites import deepgemm_mqa as m

    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    picked = {}
    for c in m.cases():
        key = (c["compressed"], c["ranges"], c["heads"], c["head_dim"])
        if c["logits_dtype"] == "fp32" and key in {(True, "cp", 32, 32), (False, "causal", 64, 128)} and c["s_kv"] <= 8192:
            picked.setdefault(key, c)
    assert len(picked) == 2, picked
    for case in picked.values():
        x = m.make_inputs(case, 0, "cuda")
        got, want = m.reference(x, case)["logits"], indexer.reference(x, case)["logits"]
        assert got.shape == want.shape and got.dtype == want.dtype, case
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), case
        fin = torch.isfinite(want)
        assert fin.any() and torch.isfinite(got[fin]).all(), case
        assert torch.allclose(got[fin].double(), want[fin].double(), rtol=1e-10, atol=1e-12), case


def test_flashmla_reference_in_batch_chunks_equals_it_whole(monkeypatch):
    """The chunked reference (REFERENCE_KV_BYTES) equals E's whole-batch one."""
    import torch

    from oracles import sparse_decode as sd
    from oracles.suites import flashmla_sparse as f

    picks = [next(c for c in f.cases() if c["b"] == 4 and "_x" in c["config"] and c["group"] == g
                  and int(c["config"].split("_m")[1].split("bs")[0]) <= 128) for g in ("correctness", "corner")]
    for case in picks:
        x = f.make_inputs(case, 0)
        whole = sd.reference(x, case)
        joined = []  # the pieces torch.cat joins (torch is one module,
        real = torch.cat  # whichever oracles/ is imported)
        monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: joined.append([t.shape[0] for t in ts]) or real(ts, *a, **k))
        monkeypatch.setattr(f, "REFERENCE_KV_BYTES", 1)
        got = f.reference(x, case)
        monkeypatch.undo()
        assert joined.count([1, 1, 1, 1]) == 2, (case, joined)
        assert torch.equal(got["O"], whole["O"]) and torch.equal(got["LSE"], whole["LSE"]), case
    assert torch.isinf(whole["LSE"]).all()  # the corner case: every row lonely
