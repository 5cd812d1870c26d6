"""The attention a PyTorch user writes by hand: matmul, softmax in fp32, matmul (and the LSE)."""

from __future__ import annotations

import math
from typing import Callable

from harness.peers.base import importable

PROBLEMS = ("attention", "mla_decode")


def installed() -> str | None:
    return importable("torch")


def unsupported(problem: str, dims: dict[str, int], cc: tuple[int, int] | None) -> str | None:
    n_rows = dims["m"] if problem == "attention" else dims["b"] * dims["s_q"] * dims["h_q"]
    if n_rows * dims["n"] * 4 > 16 << 30:
        return f"the fp32 score matrix ({n_rows} x {dims['n']}) would take more than 16 GiB"
    return None


def make(problem: str, dims: dict[str, int], inputs: dict) -> Callable[[], dict]:
    import torch

    if problem == "attention":
        q, k, v = inputs["Q"], inputs["K"], inputs["V"]
        scale = 1.0 / math.sqrt(dims["d"])

        def run() -> dict:
            s = (q @ k.T).float() * scale
            o = torch.softmax(s, dim=-1).to(v.dtype) @ v
            return {"O": o, "LSE": torch.logsumexp(s, dim=-1)}

        return run
    b, s_q, h_q, d_v = dims["b"], dims["s_q"], dims["h_q"], dims["d_v"]
    q = inputs["Q"].reshape(b, s_q * h_q, dims["d_qk"])
    kv = inputs["KV"]
    scale = 1.0 / math.sqrt(dims["d_qk"])

    def run_mla() -> dict:
        s = torch.bmm(q, kv.transpose(1, 2)).float() * scale  # [b, s_q*h_q, n]
        o = torch.bmm(torch.softmax(s, dim=-1).to(kv.dtype), kv[..., :d_v])
        lse = torch.logsumexp(s, dim=-1).reshape(b, s_q, h_q).transpose(1, 2)
        return {"O": o.reshape(b, s_q, h_q, d_v), "LSE": lse}

    return run_mla
