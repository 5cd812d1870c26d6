"""Stage E's peers: sizes, the PyTorch peer vs the oracle, FlashMLA's rules and cache view."""

import math

import pytest
import torch

from harness.peers import flashmla_sparse, torch_sparse
from oracles import kvcache as kc
from oracles import sparse_decode as sd


def _case(config, fmt, scenario="plain", b=2):
    return dict(b=b, config=config, kv_format=fmt, scenario=scenario, splits=1)


@pytest.mark.parametrize("config", ["s2h128_m128bs256_x1024bs64", "s1h128_m128bs256_x1024bs2", "s1h64_m96bs64",
                                    "s2h64_m200bs2_x64bs256"])
@pytest.mark.parametrize("fmt", kc.FORMATS)
def test_dims_read_back_format_and_blocks(config, fmt):
    c = sd.SparseConfig.parse(config)
    dims = torch_sparse.sparse_dims(sd.tensors(_case(config, fmt, b=3)))
    assert (dims["kv_format"], dims["block"], dims["topk"], dims["b"], dims["s_q"], dims["h_q"]) == (fmt, c.block, c.topk, 3, c.s_q, c.h_q)
    assert dims["extra_topk"] == c.extra_topk and (not c.has_extra or dims["extra_block"] == c.extra_block)


def test_dims_tell_nvfp4_from_the_formats_of_the_same_block_bytes():
    """nvfp4 blocks read back as powers of two only; the one collision left is pinned."""
    from oracles import kvcache as kc

    assert kc.block_bytes("v4.1", 256) == kc.block_bytes("nvfp4", 352) and kc.block_size_of("nvfp4", kc.block_bytes("v4.1", 256)) is None
    for fmt, config in (("v4.1", "s2h64_m128bs256_x1024bs64"), ("v4.1", "s1h64_m96bs256"),
                        ("simple", "s2h64_m128bs256_x1024bs64"), ("nvfp4", "s2h64_m128bs256_x1024bs64"),
                        ("nvfp4", "s2h64_m200bs2_x64bs256")):
        dims = torch_sparse.sparse_dims(sd.tensors(_case(config, fmt)))
        assert not isinstance(dims, str) and dims["kv_format"] == fmt, (fmt, config, dims)
    clash = [(f, bs) for f in kc.FORMATS if f != "nvfp4" for bs in range(1, 2049)
             if kc.block_size_of("nvfp4", kc.block_bytes(f, bs))]
    assert clash == [("simple", 381)], clash


def test_dims_refuse_other_tensors():
    specs = sd.tensors(_case("s1h64_m96bs64", "model1"))
    assert isinstance(torch_sparse.sparse_dims(specs[:3]), str)
    from oracles.common import TensorSpec
    bad = [TensorSpec("KV", (3, 1000), "uint8") if s.name == "KV" else s for s in specs]
    assert "format" in torch_sparse.sparse_dims(bad)


@pytest.mark.parametrize("fmt,scenario,config", [("model1", "lonely", "s2h64_m200bs2_x64bs256"),
                                                 ("v4.1", "topk_len", "s1h64_m96bs64"),
                                                 ("simple", "sink_inf", "s2h64_m200bs2_x64bs256"),
                                                 ("model1", "softmax_scale", "s2h64_m200bs2_x64bs256"),
                                                 ("nvfp4", "invalid", "s2h64_m200bs2_x64bs256")])
def test_torch_peer_matches_the_oracle(fmt, scenario, config):
    """… at the inputs' softmax_scale."""
    case = _case(config, fmt, scenario)
    inputs = sd.make_inputs(case, seed=7)
    ref = sd.reference(inputs, case)
    out = torch_sparse.make("sparse_decode", torch_sparse.sparse_dims(sd.tensors(case)), inputs)()
    assert out["O"].dtype == torch.bfloat16 and tuple(out["LSE"].shape) == tuple(ref["LSE"].shape)
    assert torch.equal(out["LSE"] == math.inf, ref["LSE"] == math.inf) and bool(torch.isfinite(out["O"]).all())
    cos = torch.nn.functional.cosine_similarity(out["O"].double().flatten(), ref["O"].flatten(), dim=0)
    assert cos > 0.9999
    fin = torch.isfinite(ref["LSE"])
    assert float((out["LSE"][fin].double() - ref["LSE"][fin]).abs().max()) < 0.05


def test_flashmla_percall_makes_its_metadata_in_every_call_and_the_other_once(monkeypatch):
    """Stand-in flash_mla: metadata once before timing; `flashmla_sparse_percall` each call."""
    import sys
    import types

    from harness.peers import PEERS, adapter, flashmla_sparse_percall

    made, passed = [], []
    fake = types.ModuleType("flash_mla")

    def get_mla_metadata():
        made.append(object())
        return made[-1], None

    def flash_mla_with_kvcache(q, cache, block_table, seqlens, dv, meta, **kw):
        passed.append((meta, kw["softmax_scale"], kw["attn_sink"] is inputs["sink"]))
        return q.new_zeros(q.shape), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    fake.get_mla_metadata, fake.flash_mla_with_kvcache = get_mla_metadata, flash_mla_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_mla", fake)
    case = _case("s2h128_m128bs256_x1024bs64", "model1", "softmax_scale")
    inputs = sd.make_inputs(case, seed=3)
    dims = torch_sparse.sparse_dims(sd.tensors(case))
    scale = float(inputs["softmax_scale"].reshape(-1)[0])
    once = flashmla_sparse.make("sparse_decode", dims, inputs)
    assert len(made) == 1
    once(), once()
    assert [m for m, _, _ in passed] == [made[0], made[0]]
    passed.clear()
    every = adapter("flashmla_sparse_percall").make("sparse_decode", dims, inputs)
    every(), every()
    assert [m for m, _, _ in passed] == made[-2:] and made[-1] is not made[-2]
    assert {(sc, sink) for _, sc, sink in passed} == {(scale, True)} and scale != 512 ** -0.5
    assert PEERS["flashmla_sparse_percall"][0] == flashmla_sparse_percall.__name__
    assert flashmla_sparse_percall.unsupported is flashmla_sparse.unsupported


def test_flashmla_shape_rules_and_view():
    dims = torch_sparse.sparse_dims(sd.tensors(_case("s2h128_m128bs256_x1024bs64", "model1")))
    assert flashmla_sparse.unsupported("sparse_decode", dims, (9, 0)) is None
    assert "sm90" in flashmla_sparse.unsupported("sparse_decode", dims, (10, 0))
    for fmt in ("simple", "v4.1"):
        d = torch_sparse.sparse_dims(sd.tensors(_case("s2h128_m128bs256_x1024bs64", fmt)))
        assert "model1" in flashmla_sparse.unsupported("sparse_decode", d, (9, 0))
    for config, word in (("s2h64_m200bs2_x64bs256", "topk 200"), ("s1h64_m96bs64", "topk 96")):
        d = torch_sparse.sparse_dims(sd.tensors(_case(config, "model1")))
        assert word in flashmla_sparse.unsupported("sparse_decode", d, (9, 0))  # its kernel would assert instead
    cache = torch.zeros(3, kc.block_bytes("model1", 256), dtype=torch.uint8)
    v = kc.model1_flashmla_view(cache, 256)
    assert tuple(v.shape) == (3, 256, 1, 584) and v.stride()[0] == kc.block_bytes("model1", 256)
