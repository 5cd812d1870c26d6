"""The indexer's peers: problems, PyTorch peer vs oracle, DeepGEMM's rules and absence."""

import dataclasses

import pytest

from harness.execution.metrics import compare
from harness.peers import deepgemm, torch_indexer
from harness.peers.indexer_problems import problem_dims
from oracles import indexer as ix

I1_CASE = {"s": 16, "s_kv": 256, "ranges": "cp"}
I2_CASE = {"b": 3, "next_n": 2, "ctx": 150, "block_kv": 64}


def _by(specs):
    return {s.name: s for s in specs}


def test_problem_dims_of_both_stages():
    assert problem_dims("mqa_logits", _by(ix.tensors(I1_CASE))) == {"s": 16, "s_kv": 256, "h": 64, "d": 128,
                                                                     "logits_bf16": 0, "compressed": 0, "width": 256}
    geo = ix.paged_geometry(I2_CASE)
    assert problem_dims("paged_mqa_logits", _by(ix.paged_tensors(I2_CASE))) == {
        "b": 3, "next_n": 2, "h": 64, "d": 128, "num_blocks": geo["num_blocks"], "block_kv": 64,
        "max_blocks": geo["max_blocks"], "max_len": geo["max_len"], "logits_bf16": 0, "context_2d": 0}
    # the stage's options
    opts = {"heads": 32, "head_dim": 64, "logits_dtype": "bf16"}
    assert problem_dims("mqa_logits", _by(ix.tensors({**I1_CASE, **opts}))) == {
        "s": 16, "s_kv": 256, "h": 32, "d": 64, "logits_bf16": 1, "compressed": 0, "width": 256}
    width = ix.compressed_width(*ix.ranges_of(I1_CASE))
    assert 0 < width < 256 and problem_dims("mqa_logits", _by(ix.tensors({**I1_CASE, "compressed": True}))) == {
        "s": 16, "s_kv": 256, "h": 64, "d": 128, "logits_bf16": 0, "compressed": 1, "width": width}
    dims = problem_dims("paged_mqa_logits", _by(ix.paged_tensors({**I2_CASE, **opts})))
    assert (dims["h"], dims["d"], dims["logits_bf16"], dims["context_2d"]) == (32, 64, 1, 0)
    assert problem_dims("paged_mqa_logits", _by(ix.paged_tensors({**I2_CASE, "context_2d": True})))["context_2d"] == 1


def test_problem_dims_refuse_other_layouts():
    specs = ix.tensors(I1_CASE)
    bad = [dataclasses.replace(s, dtype="bfloat16") if s.name == "kv" else s for s in specs]
    assert "kv is [256, 128] bfloat16" in problem_dims("mqa_logits", _by(bad))
    short = [dataclasses.replace(s, shape=(15,)) if s.name == "ke" else s for s in specs]
    assert "not the mqa_logits layout" in problem_dims("mqa_logits", _by(short))
    assert problem_dims("paged_mqa_logits", _by(specs)).startswith("q is [16, 64, 128] float8_e4m3fn (in); paged_mqa_logits wants rank 4")
    assert problem_dims("paged_mqa_logits", _by([s for s in ix.paged_tensors(I2_CASE) if s.name != "kv_cache"])) == "no tensor kv_cache"


@pytest.mark.parametrize("options", [{}, {"heads": 32, "head_dim": 32, "logits_dtype": "bf16"}, {"compressed": True},
                                     {"context_2d": True}],
                         ids=["default", "h32d32bf16", "compressed", "context_2d"])
@pytest.mark.parametrize("problem", ["mqa_logits", "paged_mqa_logits"])
def test_torch_peer_matches_the_oracle(problem, options, monkeypatch):
    monkeypatch.setattr(torch_indexer, "SCORE_BYTES", 1 << 16)  # several chunks
    if problem == "mqa_logits":
        case = {**I1_CASE, **options}
        assert not case.get("compressed") or ix.tensors(case)[-1].shape[1] < case["s_kv"]
        case.pop("context_2d", None)  # I2's option
        specs = ix.tensors(case)
        inputs, ref = ix.make_inputs(case, 3), None
        ref = ix.reference(inputs, case)["logits"]
    else:
        case = {**I2_CASE, **{k: v for k, v in options.items() if k != "compressed"}}  # I1's form only
        specs = ix.paged_tensors(case)
        inputs = ix.paged_make_inputs(case, 3)
        ref = ix.paged_reference(inputs, case)["logits"]
    dims = problem_dims(problem, _by(specs))
    assert torch_indexer.unsupported(problem, dims, (9, 0)) is None
    got = torch_indexer.make(problem, dims, inputs)()["logits"]
    assert str(got.dtype) == "torch." + ix.logits_dtype(case)
    m = compare(got, ref)
    assert m.nonfinite == 0 and m.unwritten == 0 and m.cosine > 0.99999, m


def test_deepgemm_shape_rules_and_absence():
    dims = problem_dims("paged_mqa_logits", _by(ix.paged_tensors(I2_CASE)))
    assert deepgemm.unsupported("paged_mqa_logits", dims, (9, 0)) is None
    assert "block_kv 32" in deepgemm.unsupported("paged_mqa_logits", {**dims, "block_kv": 32}, (9, 0))
    assert deepgemm.unsupported("paged_mqa_logits", {**dims, "block_kv": 32}, (10, 0)) is None
    assert "h 128" in deepgemm.unsupported("mqa_logits", {"s": 8, "s_kv": 64, "h": 128, "d": 128}, (9, 0))
    assert "8.x" in deepgemm.unsupported("mqa_logits", {"s": 8, "s_kv": 64, "h": 64, "d": 128}, (8, 0))
    try:
        import deep_gemm  # noqa: F401
    except Exception:
        assert deepgemm.installed() is not None  # not here: the peer says so instead of failing


def test_torch_peer_declines_the_longest_shapes():
    assert torch_indexer.unsupported("mqa_logits", {"s": 4096, "s_kv": 32768, "h": 64, "d": 128}, (9, 0)) is None
    why = torch_indexer.unsupported("mqa_logits", {"s": 4096, "s_kv": 131072, "h": 64, "d": 128}, (9, 0))
    assert why and "too slow" in why
