"""DeepGEMM's indexer kernels (stages I1, I2): `deep_gemm.fp8_mqa_logits` and
`deep_gemm.fp8_paged_mqa_logits` (DeepGEMM PR #200 and later; their kernels are compiled at run
time).  Built from source on the GPU machine: the PyPI wheel `sgl-deep-gemm` 0.2.5 does not load
with torch 2.11 (OSError on its _C.so).

Flat:  fp8_mqa_logits(q [s, h, d] e4m3, (kv [s_kv, d] e4m3, kv_scale [s_kv] fp32), weights [s, h]
       fp32, ks [s], ke [s] int32, clean_logits=True) -> logits [s, s_kv] fp32 (a view of a
       row-padded buffer), −inf outside [ks, ke) written by DeepGEMM's clean kernel (timed: the
       fill is part of the job).
Paged: get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms) (outside the timing,
       as a serving loop builds it once per step), then fp8_paged_mqa_logits(q [b, next_n, h, d],
       fused cache [num_blocks, block_kv, 1, d + 4] uint8, weights [b·next_n, h], context_lens,
       block_table, schedule_meta, max_context_len).  Recent DeepGEMM takes context_lens per
       token ([b, next_n]: token t sees context_lens[i, t] = len − next_n + t + 1 keys) and
       has no clean pass for that form; the older form takes [b] with clean_logits=True.  With
       the per-token form the adapter writes −inf past each row's limit itself (a masked_fill,
       timed with the call: DeepGEMM leaves those elements unwritten).
On sm90 DeepGEMM takes h ∈ {32, 64}, d ∈ {32, 64, 128} and (paged) block_kv = 64."""

from __future__ import annotations

from typing import Callable

from harness.peers.base import importable

PROBLEMS = ("mqa_logits", "paged_mqa_logits")


def installed() -> str | None:
    return importable("deep_gemm")


def unsupported(problem: str, dims: dict[str, int], cc: tuple[int, int] | None) -> str | None:
    major = cc[0] if cc else 9
    if major not in (9, 10):
        return f"compute capability {major}.x: DeepGEMM's indexer runs on sm90 and sm100"
    if major == 9 and dims["h"] not in (32, 64):
        return f"h {dims['h']}: DeepGEMM on sm90 takes 32 or 64 heads"
    if dims["d"] not in (32, 64, 128):
        return f"d {dims['d']}: DeepGEMM takes 32, 64 or 128"
    if problem == "paged_mqa_logits" and dims["block_kv"] != 64 and (major == 9 or dims["block_kv"] != 32):
        return f"block_kv {dims['block_kv']}: DeepGEMM takes 64 (or 32 on sm100)"
    return None


def make(problem: str, dims: dict[str, int], inputs: dict) -> Callable[[], dict]:
    import deep_gemm
    import torch

    if problem == "mqa_logits":
        q, kv, kv_scale = inputs["q"], inputs["kv"], inputs["kv_scale"]
        w, ks, ke = inputs["weights"], inputs["ks"], inputs["ke"]

        def run() -> dict:
            return {"logits": deep_gemm.fp8_mqa_logits(q, (kv, kv_scale), w, ks, ke, clean_logits=True)}

        return run

    b, next_n, max_len = dims["b"], dims["next_n"], dims["max_len"]
    q, cache, w = inputs["q"], inputs["kv_cache"], inputs["weights"]
    table, lens = inputs["block_table"], inputs["context_lens"]
    num_sms = deep_gemm.get_num_sms()
    per_token = (lens[:, None] - next_n + 1 + torch.arange(next_n, device=q.device)[None, :]).to(torch.int32).contiguous()
    try:  # recent DeepGEMM: per-token context lengths [b, next_n], no clean pass
        meta = deep_gemm.get_paged_mqa_logits_metadata(per_token, dims["block_kv"], num_sms)
        lens_arg, clean = per_token, False
    except RuntimeError:  # older DeepGEMM: [b] context lengths and its own clean pass
        meta = deep_gemm.get_paged_mqa_logits_metadata(lens, dims["block_kv"], num_sms)
        lens_arg, clean = lens, True
    j = torch.arange(max_len, device=q.device)
    invalid = (j[None, :] >= per_token.view(-1, 1))  # [b·next_n, max_len]

    def run_paged() -> dict:
        out = deep_gemm.fp8_paged_mqa_logits(q, cache, w, lens_arg, table, meta, max_len, clean_logits=clean)
        if not clean:
            out = out.masked_fill_(invalid, float("-inf"))
        return {"logits": out}

    return run_paged
