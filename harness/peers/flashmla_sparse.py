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
[b, h_q, s_q] fp32).  The problem's tensors: harness/peers/torch_sparse.py.

kv_format nvfp4 (issue 33 item 3): FlashMLA reads no NVFP4, so make() writes, once per input set
and outside the timed call, a model1 cache of the same tokens (every token idx / idx_extra name,
read back from the nvfp4 bytes and written by oracles/kvcache.py's model1 writer; the rest 0xFF):
the two formats' decode speed on one token set.  Its values are model1's re-rounding of the nvfp4
ones (cosine ≈ 0.9987 against the nvfp4 rows), so its check is cosine ≥ NVFP4_COSINE_MIN
(`check_cosine`), not the stage's bound.  Epilogue fp8_rope: unsupported (bf16 O; the unfused
pair is e_unfused_fp8.py)."""

from __future__ import annotations

from typing import Any, Callable

from harness.peers.base import importable

PROBLEMS = ("sparse_decode",)
TOPK_BLOCK = 64  # the legacy kernel asserts topk % 64 == 0 (splitkv_mla.cuh), for both lists
NVFP4_COSINE_MIN = 0.995  # nvfp4 cases: FlashMLA reads the model1 re-encoding of the tokens (the module doc)
READ_CHUNK = 1 << 16  # tokens re-encoded at a time (float64 rows: 256 MiB a chunk)


def installed() -> str | None:
    return importable("flash_mla")


def unsupported(problem: str, dims: dict[str, Any], cc: tuple[int, int] | None) -> str | None:
    if cc is not None and cc[0] != 9:
        return f"compute capability {cc[0]}.{cc[1]}: the legacy V4 sparse decode is sm90's"
    if dims["kv_format"] not in ("model1", "nvfp4"):
        return (f"kv_format {dims['kv_format']}: the legacy kernel reads model1 (kv_format \"V4\") only "
                "(nvfp4: a model1 cache of the same tokens is written for it)")
    if dims.get("epilogue", "bf16") != "bf16":
        return f"epilogue {dims['epilogue']}: the legacy kernel writes bf16 O (the unfused pair is e_unfused_fp8)"
    if dims["h_q"] not in (64, 128):
        return f"h_q {dims['h_q']}: FlashMLA takes 64 or 128 query heads"
    if dims["d"] != 512:
        return f"d {dims['d']}: the V4 layout is 512 wide"
    for name in ("topk", "extra_topk"):
        if dims.get(name) and dims[name] % TOPK_BLOCK:
            return f"{name} {dims[name]}: FlashMLA's legacy sparse decode takes multiples of {TOPK_BLOCK} (its TOPK_BLOCK_SIZE)"
    return None


def check_cosine(problem: str, dims: dict[str, Any]) -> float | None:
    """The cosine this peer's outputs are held to where it is not the stage's bound: nvfp4 cases
    (FlashMLA reads the model1 re-encoding of the same tokens: the module doc)."""
    return NVFP4_COSINE_MIN if dims.get("kv_format") == "nvfp4" else None


def model1_twin(cache, block: int, idx):
    """A model1 byte cache of the same block size and block count holding the tokens of nvfp4
    cache `cache` that `idx` names (entries in range and ≠ −1), each read back from the nvfp4
    bytes and written by the model1 writer; every other token 0xFF (NaN)."""
    import torch

    from oracles import kvcache as kc

    nb = cache.shape[0]
    out = torch.full((nb, kc.block_bytes("model1", block)), 0xFF, dtype=torch.uint8, device=cache.device)
    flat = idx.reshape(-1).long()
    used = torch.unique(flat[(flat >= 0) & (flat < nb * block)])
    for at in range(0, used.numel(), READ_CHUNK):
        rows = used[at:at + READ_CHUNK]
        x = kc.read_tokens(cache, "nvfp4", block, rows)
        ok = torch.isfinite(x).all(dim=1)  # an indexed token the generator left 0xFF stays NaN
        if bool(ok.any()):
            kc.write_tokens(out, "model1", block, rows[ok], x[ok])
    return out


def make(problem: str, dims: dict[str, Any], inputs: dict, per_call: bool = False) -> Callable[[], dict]:
    """FlashMLA's call on the stage's inputs; its metadata made once and reused (filled by the first
        call), or with `per_call` afresh in every call, as a serving engine does (then timed)."""
    import torch
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    from oracles import kvcache as kc

    kv, kv_extra = inputs["KV"], inputs["KV_extra"]
    if dims["kv_format"] == "nvfp4":  # the same tokens in model1, written once, outside the timed call
        kv = model1_twin(kv, dims["block"], inputs["idx"])
        if dims["extra_topk"]:
            kv_extra = model1_twin(kv_extra, dims["extra_block"], inputs["idx_extra"])
    cache = kc.model1_flashmla_view(kv, dims["block"]).view(torch.float8_e4m3fn)
    extra = None
    if dims["extra_topk"]:
        extra = kc.model1_flashmla_view(kv_extra, dims["extra_block"]).view(torch.float8_e4m3fn)
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
