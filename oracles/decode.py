"""Stage D2: DSV4 decode attention — batches, tokens, MQA head packing, split-KV.

Tensors (DSV4's, from D2 on):
    Q   [b, s_q, h_q, d]  bf16    query heads of each token of each sequence
    KV  [b, n_alloc, d]   bf16    ONE latent KV head per sequence: K and V are this tensor
    O   [b, s_q, h_q, d]  bf16    O = softmax(Q·Kᵀ · scale) · V over the first n keys
    LSE [b, h_q, s_q]     fp32    natural-log logsumexp of the scaled scores
    O_part   [cap, b, s_q, h_q, d] fp32   scratch: split-KV partial outputs
    LSE_part [cap, b, s_q, h_q]    fp32   scratch: split-KV partial LSEs
scale = 1/sqrt(d).  Rows n … n_alloc−1 (a `p` pad) hold NaN and must not reach the output.

Matrix axes.  `shape` b{b}s{s_q}h{h_q}n{n}d{d}[p{pad}] (n_alloc = n + pad), e.g.
b4s2h64n1152d512p100; `splits` 1, "auto" or "many" (more splits than KV tiles).  The scratch's
capacity `cap`: 1 for splits = 1; "auto": 1 when 128-row blocks fill the GPU, else n // 64;
"many": n // 64 + MANY_EXTRA; an int k: k.  A kernel that wants more raises at trace time.

Inputs: Q ~ N(0, 1) · 1.5, KV ~ N(0, 1), three keys · 2 placed late (n − 1, n − 70, n − 1000):
the row max moves in a late tile or split for some rows, and no key dominates a row, so a
skipped rescale, a misweighted split or a dropped tile fails (tests/test_d2.py).  The reference
is float64 softmax attention, independent of kernel code."""

from __future__ import annotations

import math
from typing import Any

from oracles.common import TensorSpec
from stages.common.scheduler import MANY_EXTRA, SM_COUNT, DecodeShape

Q_SCALE = 1.5
STRONG_KEY_SCALE = 2.0


def parse_shape(word: str) -> dict[str, int]:
    """{'b', 's_q', 'h_q', 'n', 'd', 'n_alloc'} of a shape word (see the module doc)."""
    return vars(DecodeShape.parse(word)).copy()


def split_capacity(case: dict[str, Any]) -> int:
    """The number of split partials the scratch tensors hold (see the module doc)."""
    p, splits = parse_shape(case["shape"]), case["splits"]
    if splits == "auto":
        fewest_ctas = p["b"] * p["s_q"] * math.ceil(p["h_q"] / 128)
        return 1 if fewest_ctas >= SM_COUNT else max(1, p["n"] // 64)
    if splits == "many":
        return max(1, p["n"] // 64) + MANY_EXTRA
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive int, 'auto' or 'many', got {splits!r}")
    return splits


def tensors(case: dict[str, Any]) -> list[TensorSpec]:
    p = parse_shape(case["shape"])
    b, s_q, h_q, n_alloc, d = p["b"], p["s_q"], p["h_q"], p["n_alloc"], p["d"]
    cap = split_capacity(case)
    return [
        TensorSpec("Q", (b, s_q, h_q, d), "bfloat16"),
        TensorSpec("KV", (b, n_alloc, d), "bfloat16"),
        TensorSpec("O", (b, s_q, h_q, d), "bfloat16", "out"),
        TensorSpec("LSE", (b, h_q, s_q), "float32", "out"),
        TensorSpec("O_part", (cap, b, s_q, h_q, d), "float32", "scratch"),
        TensorSpec("LSE_part", (cap, b, s_q, h_q), "float32", "scratch"),
    ]


def strong_keys(n: int) -> list[int]:
    return sorted({j for j in (n - 1, n - 70, n - 1000) if 0 <= j < n})


def make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    p = parse_shape(case["shape"])
    b, s_q, h_q, n, n_alloc, d = p["b"], p["s_q"], p["h_q"], p["n"], p["n_alloc"], p["d"]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h_q, d, generator=g) * Q_SCALE
    kv = torch.randn(b, n_alloc, d, generator=g)
    for j in strong_keys(n):
        kv[:, j] *= STRONG_KEY_SCALE
    kv[:, n:] = float("nan")  # beyond the attended range: must not leak
    return {"Q": q.to(torch.bfloat16).to(device), "KV": kv.to(torch.bfloat16).to(device)}


def reference(inputs: dict, case: dict[str, Any]) -> dict:
    """float64 softmax attention: O [b, s_q, h_q, d], LSE [b, h_q, s_q]."""
    import torch

    p = parse_shape(case["shape"])
    n, d = p["n"], p["d"]
    q = inputs["Q"].double()
    kv = inputs["KV"][:, :n].double()
    s = torch.einsum("bthd,bnd->bthn", q, kv) * (1.0 / math.sqrt(d))
    o = torch.einsum("bthn,bnd->bthd", torch.softmax(s, dim=-1), kv)
    lse = torch.logsumexp(s, dim=-1).permute(0, 2, 1).contiguous()
    return {"O": o, "LSE": lse}


def flops(case: dict[str, Any]) -> float:
    p = parse_shape(case["shape"])
    return 4.0 * p["b"] * p["s_q"] * p["h_q"] * p["n"] * p["d"]


def torch_decode(inputs: dict, case: dict[str, Any]):
    """Peer for timing: the same decode as PyTorch users write it, bf16 on the GPU (two
    batched matmuls with a softmax between, and the logsumexp)."""
    import torch

    p = parse_shape(case["shape"])
    b, s_q, h_q, n, d = p["b"], p["s_q"], p["h_q"], p["n"], p["d"]
    q = inputs["Q"].reshape(b, s_q * h_q, d)
    kv = inputs["KV"][:, :n]
    s = torch.bmm(q, kv.transpose(1, 2)).float() * (1.0 / math.sqrt(d))
    o = torch.bmm(torch.softmax(s, dim=-1).to(kv.dtype), kv).reshape(b, s_q, h_q, d)
    lse = torch.logsumexp(s, dim=-1).reshape(b, s_q, h_q).permute(0, 2, 1)
    return o, lse
