"""FlashAttention-4 (`flash-attn-4` on PyPI; CuTeDSL kernels, `flash_attn.cute.flash_attn_func`)
for dense attention. q, k, v are [batch, seqlen, heads, head_dim]; it returns (out, lse) with
lse [batch, heads, seqlen] when asked for it. On sm90 it takes head dims 8..256 (multiples of 8);
on sm100 up to 128, or 256, or the (192, 128) and (·, 512) MLA shapes."""

from __future__ import annotations

import warnings
from typing import Callable

from harness.peers.base import importable

PROBLEMS = ("attention",)


def installed() -> str | None:
    return importable("flash_attn.cute")


def unsupported(problem: str, dims: dict[str, int], cc: tuple[int, int] | None) -> str | None:
    d = dims["d"]
    if d % 8:
        return f"head dim {d} is not a multiple of 8"
    major = cc[0] if cc else 9
    if major == 9 and not 8 <= d <= 256:
        return f"head dim {d}: FlashAttention-4 on sm90 takes 8..256"
    if major in (10, 11) and not (8 <= d <= 128 or d == 256):
        return f"head dim {d}: FlashAttention-4 on sm100 takes 8..128 or 256 (with K and V distinct)"
    if major not in (9, 10, 11):
        return f"compute capability {major}.x: FlashAttention-4 runs on sm90 and sm100"
    return None


def make(problem: str, dims: dict[str, int], inputs: dict) -> Callable[[], dict]:
    from flash_attn.cute import flash_attn_func

    m, n, d = dims["m"], dims["n"], dims["d"]
    q = inputs["Q"].view(1, m, 1, d)
    k = inputs["K"].view(1, n, 1, d)
    v = inputs["V"].view(1, n, 1, d)
    if k.data_ptr() == v.data_ptr():  # FA4 reads `k is v` as its MLA formula: give it distinct tensors
        v = v.clone()

    def run() -> dict:
        with warnings.catch_warnings():  # FA4 4.0.0b36 warns on every compile that an aux argument is not a JIT argument
            warnings.filterwarnings("ignore", message="Argument aux_data")
            out, lse = flash_attn_func(q, k, v, causal=False, return_lse=True)
        return {"O": out.view(m, d), "LSE": lse.view(m)}

    return run
