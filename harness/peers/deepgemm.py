"""DeepGEMM's indexer kernels (stages I1, I2): `deep_gemm.fp8_mqa_logits` and
`deep_gemm.fp8_paged_mqa_logits` as DeepGEMM 54e2261 (2.6.1) defines them (csrc/apis/
attention.hpp), built from source by scripts/build_deepgemm.sh (the `sgl-deep-gemm` 0.2.5 wheel
does not load with torch 2.11).

Both through the fp8_fp4_* entry points (q as (values, None)), so the stage's logits_dtype, the
compressed form (max_seqlen_k = W when W < s_kv) and its 2-D context lengths reach DeepGEMM.
Flat:  fp8_fp4_mqa_logits((q [s, h, d] e4m3, None), (kv [s_kv, d] e4m3, kv_scale [s_kv] fp32),
       weights [s, h] fp32, cu_seq_len_k_start [s], cu_seq_len_k_end [s] int32, clean_logits=True,
       max_seqlen_k=0, logits_dtype) -> logits [s, s_kv] (rows padded to 1 KiB; −inf outside
       [ks, ke) by DeepGEMM's clean kernel, timed).  Compressed: logits [s, W], column c of row i
       key ks[i] + c; clean_logits=False there, so the adapter writes −inf past ke − ks (timed).
Paged: get_paged_mqa_logits_metadata(context_lens [b, next_n] int32, block_kv, num_sms) outside
       the timing, then fp8_fp4_paged_mqa_logits((q [b, next_n, h, d] e4m3, None), fused cache
       [num_blocks, block_kv, 1, d + 4] uint8, weights [b·next_n, h] fp32, context_lens,
       block_table [b, max_blocks] int32, schedule_meta [num_sms + 1, 2], max_context_len,
       clean_logits=False, logits_dtype) -> logits [b·next_n, max_context_len].  Only 2-D context
       lengths (token t sees keys j < context_lens[i, t]) with clean_logits=False: the adapter
       writes −inf past each row's limit (timed).
Shape rules (its host asserts): h ∈ {32, 64} on sm90, {8, 16, 32, 64} on sm100; d ∈ {32, 64, 128};
paged block_kv = 64 on sm90 (32 or 64 on sm100) and next_n ∈ {1, 2} on sm90."""

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
    if major == 10 and dims["h"] not in (8, 16, 32, 64):
        return f"h {dims['h']}: DeepGEMM on sm100 takes 8, 16, 32 or 64 heads"
    if dims["d"] not in (32, 64, 128):
        return f"d {dims['d']}: DeepGEMM takes 32, 64 or 128"
    if problem == "paged_mqa_logits":
        if dims["block_kv"] != 64 and (major == 9 or dims["block_kv"] != 32):
            return f"block_kv {dims['block_kv']}: DeepGEMM takes 64 (or 32 on sm100)"
        if major == 9 and dims["next_n"] not in (1, 2):
            return f"next_n {dims['next_n']}: DeepGEMM on sm90 takes 1 or 2"
    return None


def per_token_context_lens(context_lens, next_n: int):
    """[b] sequence lengths -> DeepGEMM's [b, next_n] int32: token t sees keys j < len_i − next_n + t + 1."""
    import torch

    t = torch.arange(next_n, device=context_lens.device, dtype=torch.int32)
    return (context_lens.to(torch.int32)[:, None] - next_n + 1 + t[None, :]).contiguous()


def make(problem: str, dims: dict[str, int], inputs: dict) -> Callable[[], dict]:
    import deep_gemm
    import torch

    logits_dtype = torch.bfloat16 if dims.get("logits_bf16") else torch.float32
    if problem == "mqa_logits":
        q, kv, kv_scale = inputs["q"], inputs["kv"], inputs["kv_scale"]
        w, ks, ke = inputs["weights"], inputs["ks"], inputs["ke"]

        if dims.get("compressed"):
            width = dims["width"]
            past = torch.arange(width, device=q.device)[None, :] >= (ke - ks)[:, None]  # [s, W]: past ke

            def run_compressed() -> dict:
                out = deep_gemm.fp8_fp4_mqa_logits((q, None), (kv, kv_scale), w, ks, ke, clean_logits=False,
                                                   max_seqlen_k=width, logits_dtype=logits_dtype)
                return {"logits": out.masked_fill_(past, float("-inf"))}

            return run_compressed

        def run() -> dict:
            return {"logits": deep_gemm.fp8_fp4_mqa_logits((q, None), (kv, kv_scale), w, ks, ke, clean_logits=True,
                                                           max_seqlen_k=0, logits_dtype=logits_dtype)}

        return run

    next_n, max_len = dims["next_n"], dims["max_len"]
    q, cache, w = inputs["q"], inputs["kv_cache"], inputs["weights"]
    table = inputs["block_table"]
    if dims.get("context_2d"):  # the stage's own per-token lengths [b, next_n]
        lens = inputs["context_lens"].to(torch.int32).contiguous()
    else:
        lens = per_token_context_lens(inputs["context_lens"], next_n)  # [b, next_n]
    meta = deep_gemm.get_paged_mqa_logits_metadata(lens, dims["block_kv"], deep_gemm.get_num_sms())
    j = torch.arange(max_len, device=q.device)
    invalid = j[None, :] >= lens.view(-1, 1)  # [b·next_n, max_len]: rows i·next_n + t

    def run_paged() -> dict:
        out = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), cache, w, lens, table, meta, max_len, clean_logits=False,
                                                 logits_dtype=logits_dtype)
        return {"logits": out.masked_fill_(invalid, float("-inf"))}

    return run_paged
