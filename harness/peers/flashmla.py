"""FlashMLA (`sgl-flash-mla`, install with --no-deps) for the decode stages: its `use_legacy=True`
Hopper kernels — dense bf16 MLA decode (here) and the FP8 sparse decode (flashmla_sparse.py).

Dense call: q [b, s_q, h_q, d_qk] bf16, a paged cache [num_blocks, 64, 1, d_qk] bf16,
block_table [b, blocks] int32, cache_seqlens [b] int32, head_dim_v; metadata from
get_mla_metadata(), filled by the first call. Returns (out [b, s_q, h_q, d_v], lse [b, h_q, s_q]).

FlashMLA's dense kernel takes d_qk 576 only, so DSV4's 512-wide K = V head is given with 64 zero
columns appended to Q and KV and the scale of the real width: scores, O and LSE are the stage's.
`flops` counts its 576-wide work (the µs ratio is the like-for-like comparison)."""

from __future__ import annotations

from typing import Callable

from harness.peers.base import importable

PROBLEMS = ("mla_decode",)
PAGE = 64  # tokens per page block of the dense legacy kernel
D_QK = 576  # the only Q/K width of the dense kernel


def installed() -> str | None:
    return importable("flash_mla")


def unsupported(problem: str, dims: dict[str, int], cc: tuple[int, int] | None) -> str | None:
    if cc is not None and cc[0] != 9:
        return f"compute capability {cc[0]}.{cc[1]}: the legacy dense decode kernels are sm90's"
    if dims["d_qk"] not in (512, D_QK) or dims["d_v"] != 512:
        return f"d_qk {dims['d_qk']} / d_v {dims['d_v']}: FlashMLA's dense decode takes 576 / 512 (or 512 / 512, padded)"
    if dims["h_q"] not in (64, 128):
        return f"h_q {dims['h_q']}: FlashMLA takes 64 or 128 query heads"
    if dims["n"] % PAGE:
        return f"n {dims['n']} is not a whole number of {PAGE}-token pages"
    return None


def flops(problem: str, dims: dict[str, int]) -> float:
    """The work FlashMLA does: Q·Kᵀ at its 576 width, P·V at d_v."""
    return 2.0 * dims["b"] * dims["s_q"] * dims["h_q"] * dims["n"] * (D_QK + dims["d_v"])


def make(problem: str, dims: dict[str, int], inputs: dict) -> Callable[[], dict]:
    import math

    import torch
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    b, n, d_qk, d_v = dims["b"], dims["n"], dims["d_qk"], dims["d_v"]
    q, kv = inputs["Q"], inputs["KV"]
    if d_qk < D_QK:  # zero columns change no score
        q = torch.nn.functional.pad(q, (0, D_QK - d_qk)).contiguous()
        kv = torch.nn.functional.pad(kv, (0, D_QK - d_qk)).contiguous()
    blocks = n // PAGE
    cache = kv.view(b * blocks, PAGE, 1, D_QK)  # sequence i owns pages i*blocks ... (i+1)*blocks-1
    block_table = torch.arange(b * blocks, dtype=torch.int32, device=q.device).view(b, blocks)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=q.device)
    meta, _ = get_mla_metadata()

    def run() -> dict:
        out, lse = flash_mla_with_kvcache(q, cache, block_table, seqlens, d_v, meta, causal=False,
                                          softmax_scale=1.0 / math.sqrt(d_qk), use_legacy=True)
        return {"O": out, "LSE": lse}

    return run
