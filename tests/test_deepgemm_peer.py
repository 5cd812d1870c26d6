"""The DeepGEMM peer vs a CPU stand-in for DeepGEMM 54e2261's indexer calls: output = float64 oracle."""

import types

import pytest
import torch

from harness.execution.metrics import compare
from harness.peers import deepgemm
from harness.peers.indexer_problems import problem_dims
from oracles import indexer as ix

NUM_SMS = 132


def _dims(problem, specs):
    return problem_dims(problem, {s.name: s for s in specs})


def _fake_deep_gemm(meta_error: str | None = None) -> types.ModuleType:
    dg = types.ModuleType("deep_gemm")

    def get_num_sms():
        return NUM_SMS

    def fp8_fp4_mqa_logits(q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0, logits_dtype=torch.float32):
        q, q_sf = q  # (values, None): FP8
        assert q_sf is None and logits_dtype in (torch.float32, torch.bfloat16)
        kv_fp, kv_sf = kv  # a (values, scales) pair, not two arguments
        s, h, d = q.shape
        assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and h in (32, 64) and d in (32, 64, 128)
        assert kv_fp.dtype == torch.float8_e4m3fn and kv_fp.is_contiguous() and kv_fp.shape[1] == d
        assert kv_sf.dtype == torch.float32 and kv_sf.is_contiguous() and kv_sf.shape == (kv_fp.shape[0],)
        assert weights.shape == (s, h) and weights.stride(1) == 1 and weights.dtype == torch.float32
        for r in (ks, ke):
            assert r.dtype == torch.int32 and r.is_contiguous() and r.shape == (s,)
        assert max_seqlen_k >= 0 and (max_seqlen_k == 0 or not clean_logits), "DG_HOST_ASSERT(not clean_logits)"
        j = torch.arange(kv_fp.shape[0])
        valid = (j[None, :] >= ks[:, None].long()) & (j[None, :] < ke[:, None].long())
        x = torch.einsum("shd,kd->shk", q.float(), kv_fp.float()) * kv_sf[None, None, :]
        out = (x.relu() * weights[:, :, None]).sum(1)
        if max_seqlen_k:  # past ke − ks unwritten (NaN)
            c = ks.long()[:, None] + torch.arange(max_seqlen_k)[None, :]
            picked = out.gather(1, c.clamp(0, out.shape[1] - 1))
            return picked.masked_fill(c >= ke.long()[:, None], float("nan")).to(logits_dtype)
        assert clean_logits
        return out.masked_fill(~valid, float("-inf")).to(logits_dtype)  # the clean pass

    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None):
        if context_lens.dim() != 2:  # DG_HOST_ASSERT: a RuntimeError in Python
            raise RuntimeError("Assertion failed: context_lens.dim() == 2")
        if meta_error:
            raise RuntimeError(meta_error)
        assert context_lens.dtype == torch.int32 and context_lens.is_contiguous() and block_kv == 64
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                 max_context_len, clean_logits=False, logits_dtype=torch.float32, indices=None):
        q, q_sf = q
        assert q_sf is None and logits_dtype in (torch.float32, torch.bfloat16)
        b, next_n, h, d = q.shape
        assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and next_n in (1, 2)
        nb, bk, one, dsf = kv_cache.shape
        assert kv_cache.dtype == torch.uint8 and one == 1 and dsf == d + 4 and kv_cache.stride(1) == dsf
        assert weights.shape == (b * next_n, h) and weights.is_contiguous() and weights.dtype == torch.float32
        assert context_lens.dim() == 2 and context_lens.shape == (b, next_n) and context_lens.dtype == torch.int32
        assert not clean_logits, "DG_HOST_ASSERT(not is_context_lens_2d)"
        assert block_table.shape[0] == b and block_table.stride(1) == 1 and block_table.dtype == torch.int32
        assert schedule_meta.shape == (NUM_SMS + 1, 2) and schedule_meta.dtype == torch.int32
        raw = kv_cache.reshape(nb, -1)  # bk·d e4m3, then bk fp32 scales
        values = raw[:, : bk * d].contiguous().view(torch.float8_e4m3fn).view(nb, bk, d).float()
        scales = raw[:, bk * d:].contiguous().view(torch.float32).view(nb, bk)
        out = torch.full((b * next_n, max_context_len), float("nan"))  # unwritten
        for i in range(b):
            for t in range(next_n):
                n = int(context_lens[i, t])  # the keys j < n
                blocks = block_table[i, : -(-n // bk)].long()
                k = values[blocks].reshape(-1, d)[:n]
                sf = scales[blocks].reshape(-1)[:n]
                x = (q[i, t].float() @ k.T) * sf[None, :]
                out[i * next_n + t, :n] = (x.relu() * weights[i * next_n + t][:, None]).sum(0)
        return out.to(logits_dtype)

    dg.get_num_sms = get_num_sms
    dg.fp8_fp4_mqa_logits = fp8_fp4_mqa_logits
    dg.get_paged_mqa_logits_metadata = get_paged_mqa_logits_metadata
    dg.fp8_fp4_paged_mqa_logits = fp8_fp4_paged_mqa_logits
    return dg


OPTIONS = [{}, {"heads": 32, "head_dim": 64}, {"logits_dtype": "bf16"}]


def _option_id(o: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in o.items()) or "default"


@pytest.mark.parametrize("options", OPTIONS + [{"context_2d": True}, {"context_2d": True, "logits_dtype": "bf16"}],
                         ids=_option_id)
@pytest.mark.parametrize("next_n", [1, 2])
def test_paged_adapter_matches_the_oracle(monkeypatch, next_n, options):
    """The stage's options reach DeepGEMM."""
    monkeypatch.setitem(__import__("sys").modules, "deep_gemm", _fake_deep_gemm())
    case = {"b": 3, "next_n": next_n, "ctx": 150, "block_kv": 64, **options}
    ins = ix.paged_make_inputs(case, 0)
    got = deepgemm.make("paged_mqa_logits", _dims("paged_mqa_logits", ix.paged_tensors(case)), ins)()["logits"]
    assert str(got.dtype) == "torch." + ix.logits_dtype(case)
    m = compare(got, ix.paged_reference(ins, case)["logits"])
    assert m.nonfinite == 0 and m.unwritten == 0 and m.cosine > 0.99999, m


def test_per_token_lengths_are_each_tokens_causal_limit():
    lens = torch.tensor([70, 5], dtype=torch.int32)
    assert deepgemm.per_token_context_lens(lens, 2).tolist() == [[69, 70], [4, 5]]
    assert deepgemm.per_token_context_lens(lens, 1).tolist() == [[70], [5]]


@pytest.mark.parametrize("options", OPTIONS + [{"compressed": True}, {"compressed": True, "logits_dtype": "bf16"}],
                         ids=_option_id)
def test_flat_adapter_matches_the_oracle(monkeypatch, options):
    monkeypatch.setitem(__import__("sys").modules, "deep_gemm", _fake_deep_gemm())
    case = {"s": 16, "s_kv": 256, "ranges": "cp", **options}  # ks > ke in row 3, an empty row 5
    ins = ix.make_inputs(case, 0)
    got = deepgemm.make("mqa_logits", _dims("mqa_logits", ix.tensors(case)), ins)()["logits"]
    assert str(got.dtype) == "torch." + ix.logits_dtype(case)
    m = compare(got, ix.reference(ins, case)["logits"])
    assert m.nonfinite == 0 and m.unwritten == 0 and m.cosine > 0.99999, m


def test_deepgemm_error_is_reported_as_is(monkeypatch):
    """A failing metadata call surfaces with its own message, no retry masking it."""
    monkeypatch.setitem(__import__("sys").modules, "deep_gemm", _fake_deep_gemm("NVCC compilation failed"))
    case = {"b": 3, "next_n": 2, "ctx": 150, "block_kv": 64}
    with pytest.raises(RuntimeError, match="NVCC compilation failed"):
        deepgemm.make("paged_mqa_logits", _dims("paged_mqa_logits", ix.paged_tensors(case)), ix.paged_make_inputs(case, 0))


def test_shape_rules_of_the_built_source():
    paged = {"b": 64, "next_n": 2, "h": 64, "d": 128, "num_blocks": 9000, "block_kv": 64, "max_blocks": 140,
             "max_len": 8960}
    assert deepgemm.unsupported("paged_mqa_logits", paged, (9, 0)) is None
    assert "next_n 3" in deepgemm.unsupported("paged_mqa_logits", {**paged, "next_n": 3}, (9, 0))
    assert deepgemm.unsupported("paged_mqa_logits", {**paged, "next_n": 3}, (10, 0)) is None
    flat = {"s": 8, "s_kv": 64, "h": 8, "d": 128}
    assert deepgemm.unsupported("mqa_logits", flat, (10, 0)) is None
    assert "h 8" in deepgemm.unsupported("mqa_logits", flat, (9, 0))
    assert "h 128" in deepgemm.unsupported("mqa_logits", {**flat, "h": 128}, (10, 0))
