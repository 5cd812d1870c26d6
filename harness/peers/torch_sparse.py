"""DSV4's sparse FP8 decode (stage E) as a PyTorch user writes it, and the `sparse_decode`
problem's sizes read from a stage's tensors.

Problem `sparse_decode`: oracles/sparse_decode.py's tensors (absent extra branch: one 1-token
block, idx_extra [b, s_q, 1]).  The format and block sizes are read back from the cache's bytes
per block (block_bytes is strictly increasing in the block size for each format).

The peer: the cache is dequantised to bf16 ONCE, outside the timed call (DSV4.md's PyTorch
anchor); each call gathers the indexed rows, masks invalid keys, two bmm with a float32 softmax
between, the sink factor."""

from __future__ import annotations

import math
from typing import Any, Callable

from harness.peers.base import importable

PROBLEMS = ("sparse_decode",)


def sparse_dims(specs: list[Any]) -> dict[str, Any] | str:
    """The `sparse_decode` sizes of a stage's tensor specs (b, s_q, h_q, d, topk, extra_topk, kv_format,
        block, extra_block, num_blocks, extra_num_blocks, epilogue: "fp8_rope" where O_fp8 is an
        output, O then scratch), or one phrase why they are not that problem."""
    from oracles import kvcache as kc

    by = {s.name: s for s in specs}
    fp8 = "O_fp8" in by and by["O_fp8"].role == "out"
    want = {"Q": ("bfloat16", 4), "KV": ("uint8", 2), "idx": ("int32", 3), "topk_length": ("int32", 1),
            "KV_extra": ("uint8", 2), "idx_extra": ("int32", 3), "extra_length": ("int32", 1),
            "sink": ("float32", 1), "softmax_scale": ("float32", 1), "LSE": ("float32", 3),
            **({"O_fp8": ("float32", 4), "O_scale": ("float32", 3), "cos_sin_cache": ("float32", 2),
                "positions": ("int32", 1)} if fp8 else {"O": ("bfloat16", 4)})}
    for name, (dtype, rank) in want.items():
        s = by.get(name)
        if s is None:
            return f"no tensor {name}"
        if s.dtype != dtype or len(s.shape) != rank:
            return f"{name} is {list(s.shape)} {s.dtype}; sparse_decode wants rank {rank} {dtype}"
    b, s_q, h_q, d = by["Q"].shape
    if fp8:
        n, g = b * s_q, h_q // 8
        if (d != kc.D or h_q % 8 or by["LSE"].shape != (b, h_q, s_q) or by["O_fp8"].shape != (g, n, 8, d // 4)
                or by["O_scale"].shape != (g, 8, -(-n // 4) * 4) or by["positions"].shape != (n,)
                or by["cos_sin_cache"].shape[1] != 64):
            return (f"Q {list(by['Q'].shape)}, O_fp8 {list(by['O_fp8'].shape)}, O_scale {list(by['O_scale'].shape)}, "
                    f"positions {list(by['positions'].shape)} are not the fp8_rope epilogue's layout")
    elif d != kc.D or by["O"].shape != (b, s_q, h_q, d) or by["LSE"].shape != (b, h_q, s_q):
        return f"Q {list(by['Q'].shape)}, O {list(by['O'].shape)}, LSE {list(by['LSE'].shape)} are not [b, s_q, h_q, 512] / [b, h_q, s_q]"
    if by["idx"].shape[:2] != (b, s_q) or by["idx_extra"].shape[:2] != (b, s_q) or by["sink"].shape != (h_q,):
        return "idx / idx_extra are not [b, s_q, k] or sink is not [h_q]"
    nb, bb = by["KV"].shape
    fits = [(f, kc.block_size_of(f, bb)) for f in kc.FORMATS if kc.block_size_of(f, bb)]
    if len(fits) != 1:
        return f"a {bb}-byte cache block is {'no' if not fits else 'more than one'} format's block"
    fmt, block = fits[0]
    nbx, bbx = by["KV_extra"].shape
    topk, xt = by["idx"].shape[2], by["idx_extra"].shape[2]
    no_extra = nbx == 1 and xt == 1 and bbx == kc.block_bytes(fmt, 1)
    xblock = 1 if no_extra else kc.block_size_of(fmt, bbx)
    if xblock is None:
        return f"the extra cache's {bbx}-byte block is no {fmt} block"
    return {"b": b, "s_q": s_q, "h_q": h_q, "d": d, "topk": topk, "extra_topk": 0 if no_extra else xt,
            "kv_format": fmt, "block": block, "extra_block": xblock, "num_blocks": nb, "extra_num_blocks": nbx,
            "epilogue": "fp8_rope" if fp8 else "bf16"}


def installed() -> str | None:
    return importable("torch")


def unsupported(problem: str, dims: dict[str, Any], cc: tuple[int, int] | None) -> str | None:
    if dims.get("epilogue", "bf16") != "bf16":
        return f"epilogue {dims['epilogue']}: this peer writes bf16 O (the unfused pair is e_unfused_fp8)"
    keys = dims["topk"] + dims["extra_topk"]
    if dims["b"] * dims["s_q"] * keys * dims["d"] * 2 > 16 << 30:
        return "the gathered bf16 keys would take more than 16 GiB"
    return None


def _bf16_cache(cache, fmt: str, block: int):
    """[num_blocks · block, 512] bf16 of a byte cache (NaN rows stay NaN; masked at use)."""
    from oracles import kvcache as kc

    return kc.dequantize(cache, fmt, block).reshape(-1, kc.D).bfloat16()


def make(problem: str, dims: dict[str, Any], inputs: dict) -> Callable[[], dict]:
    import torch

    b, s_q, h_q, d = dims["b"], dims["s_q"], dims["h_q"], dims["d"]
    fmt = dims["kv_format"]
    branches = [(_bf16_cache(inputs["KV"], fmt, dims["block"]), inputs["idx"], inputs["topk_length"])]
    if dims["extra_topk"]:
        branches.append((_bf16_cache(inputs["KV_extra"], fmt, dims["extra_block"]), inputs["idx_extra"], inputs["extra_length"]))
    q = inputs["Q"].reshape(b * s_q, h_q, d)
    sink = inputs["sink"].float()
    scale = float(inputs["softmax_scale"].reshape(-1)[0])  # the stage's input, read once

    def run() -> dict:
        keys, valid = [], []
        for kv, idx, length in branches:
            k = idx.shape[-1]
            ok = (torch.arange(k, device=idx.device)[None, None, :] < length[:, None, None]) & (idx != -1)
            rows = kv.index_select(0, torch.where(ok, idx, torch.zeros_like(idx)).reshape(-1).long())
            keys.append(torch.where(ok.reshape(-1, 1), rows, torch.zeros_like(rows)).view(b * s_q, k, d))
            valid.append(ok.view(b * s_q, k))
        kv_g = torch.cat(keys, dim=1)
        ok = torch.cat(valid, dim=1)
        s = torch.bmm(q, kv_g.transpose(1, 2)).float() * scale  # [b·s_q, h_q, keys]
        s = s.masked_fill(~ok[:, None, :], -math.inf)
        lse = torch.logsumexp(s, dim=-1)  # −inf: lonely
        lonely = lse == -math.inf
        p = torch.exp(s - torch.where(lonely, torch.zeros_like(lse), lse)[..., None])
        o = torch.bmm(p.to(kv_g.dtype), kv_g).float()
        factor = torch.where(lonely, torch.zeros_like(lse), 1.0 / (1.0 + torch.exp(sink[None, :] - lse)))
        o = (o * factor[..., None]).to(torch.bfloat16).view(b, s_q, h_q, d)
        lse = torch.where(lonely, torch.full_like(lse, math.inf), lse).view(b, s_q, h_q).transpose(1, 2)
        return {"O": o, "LSE": lse}

    return run
