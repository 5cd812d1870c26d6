"""Peer adapters: shapes, mapping, PyTorch peers vs oracle; missing packages "not installed"."""

import importlib.util

import pytest

from harness.peers import PROBLEMS, PEER_NAMES, PEERS, adapter, why_not
from harness.peers import flashmla
from harness.peers.base import importable
from harness.peers.problems import problem_dims
from oracles.common import TensorSpec


def attn(m: int, n: int, d: int) -> dict[str, int]:
    from oracles.attention import softmax_tensors

    dims = problem_dims("attention", softmax_tensors({"m": m, "n": n, "hd": d}))
    assert isinstance(dims, dict), dims
    return dims


def mla(b=2, s_q=2, h_q=64, d_qk=576, d_v=512, n=128) -> list[TensorSpec]:
    return [TensorSpec("Q", (b, s_q, h_q, d_qk), "bfloat16"), TensorSpec("KV", (b, n, d_qk), "bfloat16"),
            TensorSpec("O", (b, s_q, h_q, d_v), "bfloat16", "out"), TensorSpec("LSE", (b, h_q, s_q), "float32", "out")]


def test_every_peer_has_an_adapter_with_its_contract():
    for name in PEER_NAMES:
        mod = adapter(name)
        assert mod.PROBLEMS and callable(mod.installed) and callable(mod.unsupported) and callable(mod.make)
        assert PEERS[name][1].startswith(("pip install", "build DeepGEMM from source: git clone"))
        assert set(mod.PROBLEMS) <= set(PROBLEMS), name  # every problem it computes is a known one


def test_every_problem_has_its_dims_reader():
    from harness.peers.problems import DIMS

    assert set(DIMS) == set(PROBLEMS)
    assert problem_dims("gemm", mla()) == "unknown problem gemm"


def test_problem_dims_from_the_stage_tensors():
    assert attn(8192, 4096, 128) == {"m": 8192, "n": 4096, "d": 128}
    assert problem_dims("mla_decode", mla()) == {"b": 2, "s_q": 2, "h_q": 64, "d_qk": 576, "d_v": 512, "n": 128}
    # bad layouts: one phrase
    from oracles.qk import tensors as qk_tensors

    why = problem_dims("attention", qk_tensors({"m": 128, "n": 128, "hd": 64}))
    assert isinstance(why, str) and why
    bad = [TensorSpec("Q", (8, 64), "bfloat16"), TensorSpec("K", (16, 32), "bfloat16"),
           TensorSpec("V", (16, 64), "bfloat16"), TensorSpec("O", (8, 64), "bfloat16", "out")]
    assert "not Q [m, d]" in problem_dims("attention", bad)


@pytest.mark.parametrize("d, cc, ok", [
    (64, (9, 0), True), (128, (9, 0), True), (256, (9, 0), True), (512, (9, 0), False), (72, (9, 0), True),
    (60, (9, 0), False), (128, (10, 0), True), (256, (10, 0), True), (192, (10, 0), False), (128, (8, 0), False),
])
def test_fa4_shapes(d, cc, ok):
    why = why_not("fa4", "attention", attn(1024, 1024, d), cc, probe=False)
    assert (why is None) == ok, why
    if not ok:
        assert why.startswith("unsupported:")


def test_flashmla_takes_the_dense_mla_decode_shape_only():
    dims = problem_dims("mla_decode", mla(h_q=128, n=4096))
    assert why_not("flashmla", "mla_decode", dims, (9, 0), probe=False) is None
    # K = V padded to 576 with zeros
    assert why_not("flashmla", "mla_decode", problem_dims("mla_decode", mla(d_qk=512)), (9, 0), probe=False) is None
    assert "576 / 512" in why_not("flashmla", "mla_decode", problem_dims("mla_decode", mla(d_qk=640)), (9, 0), probe=False)
    assert "64 or 128" in why_not("flashmla", "mla_decode", problem_dims("mla_decode", mla(h_q=16)), (9, 0), probe=False)
    assert "pages" in why_not("flashmla", "mla_decode", problem_dims("mla_decode", mla(n=100)), (9, 0), probe=False)
    assert "sm90" in why_not("flashmla", "mla_decode", dims, (10, 0), probe=False)
    # C and D1: no FlashMLA
    assert "not attention" in why_not("flashmla", "attention", attn(8192, 4096, 128), (9, 0))


def test_missing_package_is_not_installed_not_a_failure(monkeypatch):
    import harness.peers.fa4 as fa4

    monkeypatch.setattr(fa4, "installed", lambda: "missing")
    assert why_not("fa4", "attention", attn(1024, 1024, 128), (9, 0)) == "not installed (pip install flash-attn-4)"
    monkeypatch.setattr(fa4, "installed", lambda: "OSError: libcuda.so.1: cannot open")
    assert why_not("fa4", "attention", attn(1024, 1024, 128), (9, 0)).startswith(
        "not installed (pip install flash-attn-4): OSError")


def test_importable():
    assert importable("json") is None
    assert importable("no_such_package_dsv4") == "missing"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn-4 is installed here")
def test_fa4_not_installed_here():
    assert why_not("fa4", "attention", attn(1024, 1024, 128), (9, 0)).startswith("not installed (pip install flash-attn-4)")
    assert why_not("flashmla", "mla_decode", problem_dims("mla_decode", mla()), (9, 0)).startswith(
        "not installed (pip install --no-deps sgl-flash-mla)")


def test_unknown_problem_and_no_problem():
    assert "not mla_decode" in why_not("fa4", "mla_decode", {}, (9, 0))
    assert "names no problem" in why_not("torch_sdpa", None, {}, (9, 0))
    assert why_not("torch_sdpa", "attention", "Q is [8] float32", (9, 0)) == "unsupported: Q is [8] float32"


def test_torch_plain_refuses_a_score_matrix_too_big():
    assert "16 GiB" in why_not("torch_plain", "attention", attn(1 << 20, 1 << 13, 64), (9, 0), probe=False)


def _cos(a, b) -> float:
    import torch

    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


@pytest.mark.parametrize("peer", ["torch_sdpa", "torch_plain"])
def test_torch_peers_agree_with_the_oracle(peer):
    from oracles.attention import softmax_inputs, softmax_reference

    case = {"m": 32, "n": 64, "hd": 16}
    ins = softmax_inputs(case, seed=1)
    ref = softmax_reference(ins, case)
    out = adapter(peer).make("attention", attn(32, 64, 16), ins)()
    assert tuple(out["O"].shape) == (32, 16) and _cos(out["O"], ref["O"]) > 0.999
    if "LSE" in out:
        assert (out["LSE"].double() - ref["LSE"]).abs().max() < 1e-2  # plain PyTorch: a bf16 score matrix


def test_torch_peers_agree_on_mla_decode():
    import torch

    g = torch.Generator().manual_seed(0)
    b, s_q, h_q, d_qk, d_v, n = 2, 2, 4, 24, 16, 32
    ins = {"Q": torch.randn(b, s_q, h_q, d_qk, generator=g).bfloat16(), "KV": torch.randn(b, n, d_qk, generator=g).bfloat16()}
    dims = problem_dims("mla_decode", mla(b, s_q, h_q, d_qk, d_v, n))
    plain = adapter("torch_plain").make("mla_decode", dims, ins)()
    sdpa = adapter("torch_sdpa").make("mla_decode", dims, ins)()
    # independent float64 reference
    q, kv = ins["Q"].double(), ins["KV"].double()
    s = torch.einsum("bthd,bnd->bthn", q, kv) / d_qk ** 0.5
    ref = torch.einsum("bthn,bnd->bthd", torch.softmax(s, -1), kv[..., :d_v])
    assert plain["O"].shape == sdpa["O"].shape == ref.shape
    assert _cos(plain["O"], ref) > 0.999 and _cos(sdpa["O"], ref) > 0.999
    assert torch.allclose(plain["LSE"].double(), torch.logsumexp(s, -1).permute(0, 2, 1), atol=1e-2)


def test_flashmla_counts_its_own_576_wide_work():
    """TFLOP/s of what it computed (576 / 512 columns)."""
    dims = problem_dims("mla_decode", mla(d_qk=512, h_q=128, n=4096))
    assert flashmla.flops("mla_decode", dims) == 2.0 * dims["b"] * dims["s_q"] * 128 * 4096 * (576 + 512)


def test_flashmla_pads_a_512_head_to_the_same_answer(monkeypatch):
    """Zero-padded columns change no score; the scale is the real width's."""
    import math
    import sys
    import types

    import torch

    seen = {}

    def fake(q, cache, block_table, seqlens, d_v, meta, causal=False, softmax_scale=None, use_legacy=False):
        seen.update(q=q.shape, cache=cache.shape, scale=softmax_scale, legacy=use_legacy)
        b, s_q, h_q, d = q.shape
        kv = cache.reshape(b, -1, d).double()
        s = torch.einsum("bthd,bnd->bthn", q.double(), kv) * softmax_scale
        return torch.einsum("bthn,bnd->bthd", s.softmax(-1), kv[..., :d_v]), s.logsumexp(-1).transpose(1, 2)

    monkeypatch.setitem(sys.modules, "flash_mla", types.SimpleNamespace(
        flash_mla_with_kvcache=fake, get_mla_metadata=lambda: (object(), None)))
    dims = {"b": 2, "s_q": 2, "h_q": 64, "d_qk": 512, "d_v": 512, "n": 128}
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 64, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(2, 128, 512, generator=g).to(torch.bfloat16)
    got = flashmla.make("mla_decode", dims, {"Q": q, "KV": kv})()
    assert seen["q"] == (2, 2, 64, 576) and seen["cache"] == (4, 64, 1, 576) and seen["legacy"]
    assert seen["scale"] == 1.0 / math.sqrt(512)
    s = torch.einsum("bthd,bnd->bthn", q.double(), kv.double()) / math.sqrt(512)
    want = torch.einsum("bthn,bnd->bthd", s.softmax(-1), kv.double())
    assert torch.allclose(got["O"], want, atol=1e-9) and torch.allclose(got["LSE"], s.logsumexp(-1).transpose(1, 2))


def test_sink_decode_peer_matches_the_d5_oracle():
    """torch_plain's sink_decode vs the oracle: lonely batch, sink, NaN rows past the fill."""
    import torch

    from oracles import masked_decode as md

    case = {"shape": "b4s2h64m128n256d64", "branches": "k+k", "sink": 5, "splits": 1}
    specs = md.merge_tensors(case)
    dims = problem_dims("sink_decode", specs)
    assert dims == {"b": 4, "s_q": 2, "h_q": 64, "d": 64, "n_main": 128, "n_swa": 256}
    inputs = md.merge_inputs(case, 3)
    want = md.merge_reference(inputs, case)
    got = adapter("torch_plain").make("sink_decode", dims, {k: v.float() if v.dtype == torch.bfloat16 else v
                                                            for k, v in inputs.items()})()
    assert torch.equal(torch.isinf(got["LSE"]), torch.isinf(want["LSE"]))
    fin = torch.isfinite(want["LSE"])
    assert torch.allclose(got["LSE"][fin].double(), want["LSE"][fin], atol=1e-4)
    assert torch.allclose(got["O"].double(), want["O"], atol=1e-4)
    assert not torch.isnan(got["O"]).any()
