"""Issue 33.3's E peers on the CPU: the unfused pass, shape rules, FlashMLA's model1 twin, judging."""

import math

import pytest
import torch

from harness.execution.executor import Checked, peer_verdict
from harness.peers import e_unfused_fp8 as eu
from harness.peers import flashmla_sparse, torch_sparse
from oracles import fp8_epilogue as fe
from oracles import kvcache as kc
from oracles import sparse_decode as sd

PROD = ("s2h128_m128bs256_x1024bs64", "s2h64_m128bs256_x1024bs64")


def _case(config, fmt="model1", epilogue="bf16", b=2, scenario="sink"):
    return dict(b=b, config=config, kv_format=fmt, scenario=scenario, splits="auto", epilogue=epilogue)


def _dims(case):
    dims = torch_sparse.sparse_dims(sd.tensors(case))
    assert not isinstance(dims, str), dims
    return dims


def _random_o(b, s_q, h, seed=0):
    """bf16 O rows at scales 2^−30 … 2^8, and a zero row."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(b, s_q, h, 512, generator=g) * torch.pow(2.0, torch.randint(-30, 9, (b, s_q, h, 1), generator=g).float())
    o[0, 0, 1] = 0.0  # a lonely row: exponent −22, zero bytes
    return o.bfloat16()


@pytest.mark.parametrize("b,s_q,h", [(3, 2, 16), (1, 1, 64), (2, 2, 128)])
def test_the_separate_pass_is_the_oracles_rotation_and_quantisation(b, s_q, h):
    """Bit-exact vs float64 where unambiguous; rope bytes ≤ one e4m3 step off; pads 0."""
    n = b * s_q
    o = _random_o(b, s_q, h)
    cs = fe.make_cos_sin_cache()
    pos = torch.randint(0, fe.MAX_POSITION, (n,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    pos[0] = 0
    out, scales = eu.rope_quantise(o, cs, pos)
    assert out.dtype == torch.float8_e4m3fn and tuple(out.shape) == (h // 8, n, 8, 512)
    assert scales.dtype == torch.int32 and tuple(scales.shape) == (h // 8, 8, fe.align4(n))
    assert not bool(scales[:, :, n:].any())

    rot = fe.rotate(o.reshape(n, h, 512), cs, pos)
    q_ref, e_ref = fe.quantise(rot)
    ref_out, ref_scales = fe.pack(q_ref.view(b, s_q, h, 512), e_ref.view(b, s_q, h, 4), b, s_q, h)
    _, e_got = fe.unpack(out.view(torch.uint8), scales, b, s_q, h)
    sure = (fe.exponent_reference(rot) % 1 == 0).view(b, s_q, h, 4)  # not within BAND of a power of two
    assert bool(sure.float().mean() > 0.9)
    assert torch.equal(e_got[sure], e_ref.view(b, s_q, h, 4)[sure])
    agree = sure.repeat_interleave(128, dim=-1).reshape(n, h // 8, 8, 512).permute(1, 0, 2, 3)
    got_b, ref_b = out.view(torch.uint8).long(), ref_out.long()
    nope = agree[..., :448]
    assert torch.equal(got_b[..., :448][nope], ref_b[..., :448][nope])
    rope = agree[..., 448:]
    gr, rr = got_b[..., 448:][rope], ref_b[..., 448:][rope]
    same_sign = (gr & 0x80) == (rr & 0x80)
    step = (gr & 0x7F) - (rr & 0x7F)
    assert bool((same_sign | ((gr & 0x7F) == 0) | ((rr & 0x7F) == 0)).all()) and int(step.abs().max()) <= 1
    assert float((gr == rr).float().mean()) > 0.99
    vals, _ = fe.unpack(out.view(torch.uint8), scales, b, s_q, h)
    cos = torch.nn.functional.cosine_similarity(vals.flatten(), rot.view(b, s_q, h, 512).flatten(), dim=0)
    assert cos > 0.999
    assert torch.equal(out.view(torch.uint8)[0, 0, 1], torch.zeros(512, dtype=torch.uint8))  # the zero row
    assert int(e_got[0, 0, 1].min()) == int(e_got[0, 0, 1].max()) == fe.ZERO_BLOCK_EXP


def test_the_pass_rotates_the_inverse_way_and_by_each_tokens_own_position():
    """The forward rotation, or one row's position for all, is told apart."""
    b, s_q, h = 2, 2, 8
    o = _random_o(b, s_q, h, seed=3)
    o[0, 0, 1] = 1.0
    cs = fe.make_cos_sin_cache()
    pos = torch.tensor([0, 7, 1000, 4095], dtype=torch.int32)
    vals, _ = fe.unpack(*[t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in eu.rope_quantise(o, cs, pos)],
                        b, s_q, h)
    inv = fe.rotate(o.reshape(4, h, 512), cs, pos).view(b, s_q, h, 512)
    fwd = fe.rotate(o.reshape(4, h, 512), cs, pos, inverse=False).view(b, s_q, h, 512)
    rel = lambda a, r: float((a[..., 448:] - r[..., 448:]).norm() / r[..., 448:].norm())  # noqa: E731
    assert rel(vals, inv) < 0.05 < 0.5 < rel(vals, fwd)


def test_peer_rules():
    """e_unfused_fp8 takes fp8_rope on sm90; FlashMLA and PyTorch refuse it; FlashMLA takes nvfp4."""
    fp8, bf16 = _dims(_case(PROD[0], epilogue="fp8_rope")), _dims(_case(PROD[0]))
    assert fp8["epilogue"] == "fp8_rope" and bf16["epilogue"] == "bf16"
    assert eu.unsupported("sparse_decode", fp8, (9, 0)) is None and eu.unsupported("sparse_decode", fp8, None) is None
    assert "sm90" in eu.unsupported("sparse_decode", fp8, (10, 0))
    assert "fp8_rope" in eu.unsupported("sparse_decode", bf16, (9, 0))
    for mod in (flashmla_sparse, torch_sparse):
        assert "epilogue fp8_rope" in mod.unsupported("sparse_decode", fp8, (9, 0))
        assert mod.unsupported("sparse_decode", bf16, (9, 0)) is None
    nv = _dims(_case(PROD[1], "nvfp4"))
    assert flashmla_sparse.unsupported("sparse_decode", nv, (9, 0)) is None
    assert flashmla_sparse.check_cosine("sparse_decode", nv) == flashmla_sparse.NVFP4_COSINE_MIN
    assert flashmla_sparse.check_cosine("sparse_decode", bf16) is None
    for fmt in ("simple", "v4.1"):
        assert "reads model1" in flashmla_sparse.unsupported("sparse_decode", _dims(_case(PROD[0], fmt)), (9, 0))
    bad = [s for s in sd.tensors(_case(PROD[0], epilogue="fp8_rope")) if s.name != "positions"]
    assert "positions" in torch_sparse.sparse_dims(bad)


@pytest.mark.parametrize("config", [*PROD, "s1h64_m96bs64", "s2h64_m200bs2_x64bs256"])
def test_the_config_is_rebuilt_from_the_sizes(config):
    assert eu.config_of(_dims(_case(config, epilogue="fp8_rope"))) == config
    assert eu._bf16_case(_dims(_case(config, epilogue="fp8_rope")))["epilogue"] == "bf16"


def test_flashmla_reads_a_model1_cache_of_the_nvfp4_cases_tokens():
    """The model1 twin holds every nvfp4 token; within NVFP4_COSINE_MIN, not 0.9999."""
    case = _case(PROD[1], "nvfp4")
    inputs = sd.make_inputs(case, seed=5)
    c = sd.SparseConfig.parse(case["config"])
    twins = {}
    for kv, idx, block in (("KV", "idx", c.block), ("KV_extra", "idx_extra", c.extra_block)):
        twin = flashmla_sparse.model1_twin(inputs[kv], block, inputs[idx])
        assert twin.shape == (inputs[kv].shape[0], kc.block_bytes("model1", block))
        flat = inputs[idx].reshape(-1).long()
        used = torch.unique(flat[(flat >= 0) & (flat < inputs[kv].shape[0] * block)])
        src = kc.read_tokens(inputs[kv], "nvfp4", block, used)
        assert bool(torch.isfinite(src).all())
        data, scales = kc.encode_tokens(src, "model1")
        back = kc.read_tokens(twin, "model1", block, used)
        assert torch.equal(back, kc.read_tokens(kc.quantize(src.view(-1, 1, 512), "model1"), "model1", 1,
                                                torch.arange(used.numel())))
        others = torch.ones(inputs[kv].shape[0] * block, dtype=torch.bool)
        others[used] = False
        assert bool(torch.isnan(kc.read_tokens(twin, "model1", block, others.nonzero().flatten()[:4096])).all())
        twins[kv] = twin
    ref = sd.reference(inputs, case)
    peer = sd.reference({**inputs, **twins}, {**case, "kv_format": "model1"})
    cos = float(torch.nn.functional.cosine_similarity(peer["O"].flatten(), ref["O"].flatten(), dim=0))
    assert flashmla_sparse.NVFP4_COSINE_MIN < cos < 0.9999, cos


def test_flashmla_nvfp4_call_gets_the_model1_view(monkeypatch):
    """Stand-in flash_mla: an nvfp4 case reaches FlashMLA as model1 bytes."""
    import sys
    import types

    seen = []
    fake = types.ModuleType("flash_mla")
    fake.get_mla_metadata = lambda: (object(), None)

    def flash_mla_with_kvcache(q, cache, block_table, seqlens, dv, meta, **kw):
        seen.append((tuple(cache.shape), cache.stride()[0], tuple(kw["extra_k_cache"].shape)))
        return q.new_zeros(q.shape), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    fake.flash_mla_with_kvcache = flash_mla_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    case = _case(PROD[1], "nvfp4")
    inputs = sd.make_inputs(case, seed=2)
    c = sd.SparseConfig.parse(case["config"])
    flashmla_sparse.make("sparse_decode", _dims(case), inputs)()
    nb, nbx = inputs["KV"].shape[0], inputs["KV_extra"].shape[0]
    assert seen == [((nb, c.block, 1, 584), kc.block_bytes("model1", c.block), (nbx, c.extra_block, 1, 584))]


def _judge(case):
    """The bench job of `case` as bench makes it, and its specs."""
    from harness.execution.bench import _job
    from harness.spec.spec import load_spec
    from tests.conftest import ROOT

    stage = load_spec(root=ROOT).stages["E"]
    return _job(stage, "sm_90a", case, True, 3, 0), sd.tensors(case)


def test_the_bench_judges_the_unfused_pairs_words_through_the_stages_decode():
    """The pair's words decoded as the kernel's pass; with the forward rotation they fail."""
    case = _case("s1h64_m96bs64", epilogue="fp8_rope", b=2)
    inputs = sd.make_inputs(case, seed=4)
    ref = sd.reference(inputs, case)
    bf = sd.reference(inputs, {**case, "epilogue": "bf16"})
    o = bf["O"].bfloat16()
    job, specs = _judge(case)
    chk = Checked(metrics={}, ref=ref, idx=None, sliced=set(), checked="every row")

    def words(o_rows):
        out, scales = eu.rope_quantise(o_rows, inputs["cos_sin_cache"], inputs["positions"])
        ow, sw = fe.words_of(out.view(torch.uint8), scales)
        return {"O_fp8": ow, "O_scale": sw, "LSE": bf["LSE"].float()}

    pm, verdict, why = peer_verdict(job, eu, _dims(case), specs, chk, words(o))
    assert verdict == "pass" and set(pm) == {"O", "LSE", "O_scale"} and pm["O"]["cosine"] > 0.999, why
    c = sd.SparseConfig.parse(case["config"])
    wrong = fe.rotate(o.reshape(-1, c.h_q, 512), inputs["cos_sin_cache"], inputs["positions"], inverse=False)
    wrong = fe.rotate(wrong, inputs["cos_sin_cache"], inputs["positions"], inverse=False)  # twice forward: −2θ off
    pm, verdict, why = peer_verdict(job, eu, _dims(case), specs, chk, words(wrong.view(o.shape).bfloat16()))
    assert verdict == "fail" and "O" in why, why


def test_the_bench_holds_flashmla_to_its_own_bound_on_nvfp4():
    """FlashMLA's O on the model1 twin passes check_cosine's bound, fails 0.9999."""
    case = _case(PROD[1], "nvfp4")
    inputs = sd.make_inputs(case, seed=5)
    c = sd.SparseConfig.parse(case["config"])
    twins = {"KV": flashmla_sparse.model1_twin(inputs["KV"], c.block, inputs["idx"]),
             "KV_extra": flashmla_sparse.model1_twin(inputs["KV_extra"], c.extra_block, inputs["idx_extra"])}
    ref = sd.reference(inputs, case)
    peer = sd.reference({**inputs, **twins}, {**case, "kv_format": "model1"})
    got = {"O": peer["O"].bfloat16(), "LSE": peer["LSE"].float()}
    job, specs = _judge(case)
    chk = Checked(metrics={}, ref=ref, idx=None, sliced=set(), checked="every row")
    assert peer_verdict(job, flashmla_sparse, _dims(case), specs, chk, got)[1] == "pass"
    assert peer_verdict(job, torch_sparse, _dims(case), specs, chk, got)[1] == "fail"  # no check_cosine: 0.9999
    assert not math.isnan(float(ref["O"].abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("config", PROD)
def test_gpu_the_unfused_pair_agrees_with_the_fp8_rope_oracle(config):
    """On an H100/H200: the pair at b 2 meets the fp8_rope bounds, and its pass is torch.compile's."""
    case = _case(config, epilogue="fp8_rope", b=2)
    inputs = sd.make_inputs(case, seed=11, device="cuda")
    run = eu.make("sparse_decode", _dims(case), inputs)
    got = run()
    torch.cuda.synchronize()
    dec = sd.decode(got, case)
    ref = sd.reference(inputs, case)
    cos = float(torch.nn.functional.cosine_similarity(dec["O"].double().flatten(), ref["O"].flatten(), dim=0))
    rel = float((dec["O"].double() - ref["O"]).norm() / ref["O"].norm())
    sure = ref["O_scale"] % 1 == 0
    print("e_unfused_fp8", config, eu.PASS, f"cos {cos:.6f} rel_l2 {rel:.2e}")
    assert cos >= 0.999 and rel <= 4e-2, (cos, rel)
    assert torch.equal(dec["O_scale"].double()[sure], ref["O_scale"][sure])
    assert eu.PASS["kind"] == "torch.compile"
    again = run()  # a second call: same bytes
    torch.cuda.synchronize()
    assert torch.equal(again["O_fp8"].view(torch.int32), got["O_fp8"].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("config", PROD)
def test_gpu_flashmla_on_the_model1_twin_of_an_nvfp4_case(config):
    """On an H100/H200 with sgl-flash-mla: FlashMLA on an nvfp4 case passes the peer's own bound."""
    from harness.peers import flashmla_sparse_percall

    if flashmla_sparse.installed():
        pytest.skip("sgl-flash-mla is not installed (pip install --no-deps sgl-flash-mla)")
    case = _case(config, "nvfp4", b=2)
    inputs = sd.make_inputs(case, seed=13, device="cuda")
    ref = sd.reference(inputs, case)
    for mod in (flashmla_sparse, flashmla_sparse_percall):
        out = mod.make("sparse_decode", _dims(case), inputs)()
        torch.cuda.synchronize()
        cos = float(torch.nn.functional.cosine_similarity(out["O"].double().flatten(), ref["O"].flatten(), dim=0))
        print(mod.__name__, config, f"cos {cos:.6f}")
        assert flashmla_sparse.NVFP4_COSINE_MIN <= cos < 1.0, cos
