"""Stage A: S = Q·Kᵀ in fp32, no scale.

Inputs are bf16 draws of N(0, 1); the reference is computed in float64 from the same
bf16 values, so the only error the kernel may add is its fp32 accumulation order.
"""

from __future__ import annotations

from typing import Any

from oracles.common import TensorSpec


def tensors(case: dict[str, Any]) -> list[TensorSpec]:
    m, n, hd = case["m"], case["n"], case["hd"]
    return [
        TensorSpec("Q", (m, hd), "bfloat16"),
        TensorSpec("K", (n, hd), "bfloat16"),
        TensorSpec("S", (m, n), "float32", "out"),
    ]


def make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    m, n, hd = case["m"], case["n"], case["hd"]
    q = torch.randn(m, hd, generator=g).to(torch.bfloat16)
    k = torch.randn(n, hd, generator=g).to(torch.bfloat16)
    return {"Q": q.to(device), "K": k.to(device)}


def reference(inputs: dict, case: dict[str, Any]) -> dict:
    q, k = inputs["Q"].double(), inputs["K"].double()
    return {"S": q @ k.T}


def flops(case: dict[str, Any]) -> float:
    return 2.0 * case["m"] * case["n"] * case["hd"]
