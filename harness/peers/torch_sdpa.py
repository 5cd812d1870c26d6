"""PyTorch's fused attention (torch.nn.functional.scaled_dot_product_attention), with its own
choice of backend (flash / memory-efficient / cuDNN). O only: SDPA returns no LSE."""

from __future__ import annotations

from typing import Callable

from harness.peers.base import importable

PROBLEMS = ("attention", "mla_decode")


def installed() -> str | None:
    return importable("torch")


def unsupported(problem: str, dims: dict[str, int], cc: tuple[int, int] | None) -> str | None:
    return None


def make(problem: str, dims: dict[str, int], inputs: dict) -> Callable[[], dict]:
    import torch.nn.functional as F

    if problem == "attention":
        q, k, v = (inputs[n][None, None] for n in ("Q", "K", "V"))  # [1, 1, s, d]: one batch, one head

        def run() -> dict:
            return {"O": F.scaled_dot_product_attention(q, k, v)[0, 0]}

        return run
    # mla_decode: MQA; the h_q heads of each token attend one latent head, K = KV, V = KV[..., :d_v]
    b, s_q, h_q, d_v = dims["b"], dims["s_q"], dims["h_q"], dims["d_v"]
    q = inputs["Q"].reshape(b, s_q * h_q, dims["d_qk"])[:, None]  # [b, 1, s_q*h_q, d_qk]
    kv = inputs["KV"][:, None]  # [b, 1, n, d_qk]
    v = kv[..., :d_v]

    def run_mla() -> dict:
        o = F.scaled_dot_product_attention(q, kv, v)  # [b, 1, s_q*h_q, d_v]
        return {"O": o.reshape(b, s_q, h_q, d_v)}

    return run_mla
