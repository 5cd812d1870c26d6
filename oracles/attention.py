"""Stages B and C: attention of one query tile over one key set, in float64.

Stage B (identity softmax): O = bf16(fp32(Q·Kᵀ)) · V — P the bf16 rounding of the fp32 scores,
as the kernel feeds its second MMA.  Inputs N(0, 1) × 0.25 keep |S| around 0.5 at hd = 64.

Stage C (online softmax): O = softmax(Q·Kᵀ·scale)·V, LSE = logsumexp(Q·Kᵀ·scale) (natural log),
scale = 1/sqrt(hd).  The `scores` axis:
  normal  Q, K, V ~ N(0, 1)
  wide    Q ~ N(0, 1) × 8 and three keys × 4 in the last KV tiles: scaled scores span about
          ±100 and the row max moves late (a skipped rescale or a stale max fails).
`v_is_k` (stage B): V is K's tensor (DSV4's MQA), or an independent draw (reading K for V fails)."""

from __future__ import annotations

import math
from typing import Any

from oracles.common import TensorSpec

B_INPUT_SCALE = 0.25


def _qkv_specs(case: dict[str, Any]) -> list[TensorSpec]:
    m, n, hd = case["m"], case["n"], case["hd"]
    return [TensorSpec("Q", (m, hd), "bfloat16"), TensorSpec("K", (n, hd), "bfloat16"), TensorSpec("V", (n, hd), "bfloat16")]


def _draw(case: dict[str, Any], seed: int, scale: float = 1.0, v_is_k: bool = False):
    import torch

    g = torch.Generator().manual_seed(seed)
    m, n, hd = case["m"], case["n"], case["hd"]
    q = torch.randn(m, hd, generator=g) * scale
    k = torch.randn(n, hd, generator=g) * scale
    v = k if v_is_k else torch.randn(n, hd, generator=g) * scale
    return q, k, v


# -- stage B ------------------------------------------------------------------------------


def identity_tensors(case: dict[str, Any]) -> list[TensorSpec]:
    return _qkv_specs(case) + [TensorSpec("O", (case["m"], case["hd"]), "bfloat16", "out")]


def identity_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    q, k, v = _draw(case, seed, B_INPUT_SCALE, case.get("v_is_k", False))
    q, k = q.to(torch.bfloat16).to(device), k.to(torch.bfloat16).to(device)
    v = k if case.get("v_is_k", False) else v.to(torch.bfloat16).to(device)
    return {"Q": q, "K": k, "V": v}


def identity_reference(inputs: dict, case: dict[str, Any]) -> dict:
    import torch

    s = (inputs["Q"].double() @ inputs["K"].double().T).float()
    p = s.to(torch.bfloat16).double()
    return {"O": p @ inputs["V"].double()}


# -- stage C ------------------------------------------------------------------------------


def softmax_tensors(case: dict[str, Any]) -> list[TensorSpec]:
    m = case["m"]
    return _qkv_specs(case) + [
        TensorSpec("O", (m, case["hd"]), "bfloat16", "out"),
        TensorSpec("LSE", (m,), "float32", "out"),
    ]


def softmax_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    q, k, v = _draw(case, seed)
    if case.get("scores", "normal") == "wide":
        q = q * 8.0
        n = case["n"]
        for j in (n - 1, n - 60, n - 127 if n > 128 else n // 2):
            k[j] *= 4.0
    return {name: t.to(torch.bfloat16).to(device) for name, t in (("Q", q), ("K", k), ("V", v))}


def softmax_reference(inputs: dict, case: dict[str, Any]) -> dict:
    import torch

    scale = 1.0 / math.sqrt(case["hd"])
    s = (inputs["Q"].double() @ inputs["K"].double().T) * scale
    return {"O": torch.softmax(s, dim=-1) @ inputs["V"].double(), "LSE": torch.logsumexp(s, dim=-1)}


def two_gemm_flops(case: dict[str, Any]) -> float:
    return 4.0 * case["m"] * case["n"] * case["hd"]


def torch_attention(inputs: dict, case: dict[str, Any]):
    """Peer for timing: the same attention as PyTorch users write it, in bf16 on the GPU
    (matmul, softmax, matmul, logsumexp)."""
    import torch

    scale = 1.0 / math.sqrt(case["hd"])
    s = (inputs["Q"] @ inputs["K"].T).float() * scale
    o = torch.softmax(s, dim=-1).to(inputs["V"].dtype) @ inputs["V"]
    return o, torch.logsumexp(s, dim=-1)
