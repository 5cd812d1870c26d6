"""The attention a PyTorch user writes by hand: matmul, softmax in fp32, matmul (and the LSE).
For sink_decode (stage D5 on): the two key branches side by side, two batched matmuls, the masks,
logsumexp and the sink — `sink_decode` is also the stage's own `peer:` (oracles/masked_decode.py)."""

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


def sink_decode(q, kv_main, kv_swa, main_lens, swa_lens, sink):
    """DSV4 decode over two key branches under one softmax, with the attention sink, in bf16
    PyTorch (two batched matmuls, masks, logsumexp). q [b, s_q, h_q, d]; kv_main [b, n_main, d]
    (key j valid iff j < main_lens[b]); kv_swa [b, n_swa, d] (valid iff j < swa_lens[b] and
    j ≤ swa_lens[b] − s_q + t for query token t); sink [h_q] (NaN: no sink). Returns O
    [b, s_q, h_q, d] and LSE [b, h_q, s_q] (+inf for a row with no valid key, whose O is 0)."""
    import torch

    b, s_q, h_q, d = q.shape
    n_main, n_swa = kv_main.shape[1], kv_swa.shape[1]
    kv = torch.cat([kv_main, kv_swa], dim=1)  # [b, n_main + n_swa, d]
    dev = kv.device
    t = torch.arange(s_q, device=dev)
    js = torch.arange(n_swa, device=dev)
    ml = main_lens.long()[:, None, None]
    sl = swa_lens.long()[:, None, None]
    ok_m = (torch.arange(n_main, device=dev)[None, None, :] < ml).expand(b, s_q, -1)
    ok_s = (js[None, None, :] < sl) & (js[None, None, :] <= sl - s_q + t[None, :, None])
    ok = torch.cat([ok_m, ok_s], dim=-1)  # [b, s_q, n]
    kv = torch.where(ok.any(dim=1)[..., None], kv, torch.zeros_like(kv))  # rows nobody sees may hold NaN
    s = torch.bmm(q.reshape(b, s_q * h_q, d), kv.transpose(1, 2)).float().reshape(b, s_q, h_q, -1) * (1.0 / math.sqrt(d))
    s = s.masked_fill(~ok[:, :, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [b, s_q, h_q]
    prob = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.bmm(prob.reshape(b, s_q * h_q, -1).to(kv.dtype), kv).reshape(b, s_q, h_q, d)
    factor = torch.sigmoid(lse - sink[None, None, :])  # 1 / (1 + e^(sink − lse))
    factor = torch.where(torch.isnan(sink)[None, None, :], torch.ones_like(factor), factor)
    o = o * torch.where(torch.isneginf(lse), torch.zeros_like(factor), factor)[..., None].to(o.dtype)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    return o, lse.permute(0, 2, 1)
