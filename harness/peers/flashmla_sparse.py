"""FlashMLA's Hopper FP8 sparse decode for stage E (`sgl-flash-mla`, install with --no-deps):
`flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=…, use_legacy=True, kv_format="V4")`,
the legacy (sm90) kernel on DSV4's model1 layout.

Call (sgl-flash-mla 1.0.0's flash_mla_interface.py): q [b, s_q, h_q, 512] bf16 (h_q 64 or 128);
k_cache [num_blocks, block_size, 1, 584], the strided view of the model1 byte cache
(kvcache.model1_flashmla_view); block_table and cache_seqlens None; head_dim_v 512; metadata
from get_mla_metadata() (filled by the first call, reused only with the same shapes and
lengths); indices [b, s_q, topk] int32 (−1 invalid, no bounds check); attn_sink [h_q] fp32;
extra_k_cache / extra_indices_in_kvcache / topk_length / extra_topk_length the stage's tensors;
softmax_scale the stage's input as a Python float.  Returns (out [b, s_q, h_q, 512] bf16, lse
[b, h_q, s_q] fp32).  The problem's tensors: harness/peers/torch_sparse.py."""

from __future__ import annotations

from typing import Any, Callable

from harness.peers.base import importable

PROBLEMS = ("sparse_decode",)
TOPK_BLOCK = 64  # the legacy kernel asserts topk % 64 == 0 (splitkv_mla.cuh), for both lists


def installed() -> str | None:
    return importable("flash_mla")


def unsupported(problem: str, dims: dict[str, Any], cc: tuple[int, int] | None) -> str | None:
    if cc is not None and cc[0] != 9:
        return f"compute capability {cc[0]}.{cc[1]}: the legacy V4 sparse decode is sm90's"
    if dims["kv_format"] != "model1":
        return f"kv_format {dims['kv_format']}: the legacy kernel reads model1 (kv_format \"V4\") only"
    if dims["h_q"] not in (64, 128):
        return f"h_q {dims['h_q']}: FlashMLA takes 64 or 128 query heads"
    if dims["d"] != 512:
        return f"d {dims['d']}: the V4 layout is 512 wide"
    for name in ("topk", "extra_topk"):
        if dims.get(name) and dims[name] % TOPK_BLOCK:
            return f"{name} {dims[name]}: FlashMLA's legacy sparse decode takes multiples of {TOPK_BLOCK} (its TOPK_BLOCK_SIZE)"
    return None


def make(problem: str, dims: dict[str, Any], inputs: dict, per_call: bool = False) -> Callable[[], dict]:
    """FlashMLA's call on the stage's inputs; its metadata made once and reused (filled by the first
        call), or with `per_call` afresh in every call, as a serving engine does (then timed)."""
    import torch
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    from oracles import kvcache as kc

    cache = kc.model1_flashmla_view(inputs["KV"], dims["block"]).view(torch.float8_e4m3fn)
    extra = None
    if dims["extra_topk"]:
        extra = kc.model1_flashmla_view(inputs["KV_extra"], dims["extra_block"]).view(torch.float8_e4m3fn)
    meta, _ = get_mla_metadata()
    kw = dict(
        softmax_scale=float(inputs["softmax_scale"].reshape(-1)[0]),  # read once, outside the timed call
        is_fp8_kvcache=True, indices=inputs["idx"], attn_sink=inputs["sink"], topk_length=inputs["topk_length"],
        extra_k_cache=extra, extra_indices_in_kvcache=inputs["idx_extra"] if extra is not None else None,
        extra_topk_length=inputs["extra_length"] if extra is not None else None,
        use_legacy=True, kv_format="V4",
    )

    def run() -> dict:
        out, lse = flash_mla_with_kvcache(inputs["Q"], cache, None, None, 512,
                                          get_mla_metadata()[0] if per_call else meta, **kw)
        return {"O": out, "LSE": lse}

    return run
