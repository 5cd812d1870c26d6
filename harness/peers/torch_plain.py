"""The attention a PyTorch user writes by hand: matmul, softmax in fp32, matmul (and the LSE).
For sink_decode (stage D5 on): the two key branches side by side, two batched matmuls, the masks,
logsumexp and the sink — oracles/masked_decode.py `sink_decode`, which is also the stage's own
`peer:` (the oracle owns the math; the peer adapter reuses it: harness may import oracles, never
the reverse)."""

from __future__ import annotations

import math
from typing import Callable

from harness.peers.base import importable

PROBLEMS = ("attention", "mla_decode", "sink_decode")


def installed() -> str | None:
    return importable("torch")


def unsupported(problem: str, dims: dict[str, int], cc: tuple[int, int] | None) -> str | None:
    n_rows = dims["m"] if problem == "attention" else dims["b"] * dims["s_q"] * dims["h_q"]
    if problem == "sink_decode":
        return None if n_rows * (dims["n_main"] + dims["n_swa"]) * 4 <= 16 << 30 else "the fp32 score matrix is over 16 GiB"
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
    if problem == "sink_decode":
        from oracles.masked_decode import sink_decode

        names = ("Q", "KV_main", "KV_swa", "main_lens", "swa_lens", "sink")
        return lambda: dict(zip(("O", "LSE"), sink_decode(*(inputs[n] for n in names))))
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
