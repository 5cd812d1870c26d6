"""The indexer's logits as a PyTorch user writes them (stages I1, I2): dequantise the keys to
bf16, one bf16 matmul per chunk of query rows (or of sequences), ReLU and the weighted head sum
in fp32, then −inf outside each row's range.  Chunked so the fp32 score block stays under
~2 GiB at DeepGEMM's long-context shapes."""

from __future__ import annotations

from typing import Callable

from harness.peers.base import importable

PROBLEMS = ("mqa_logits", "paged_mqa_logits")
SCORE_BYTES = 2 << 30  # the fp32 score block of one chunk


def installed() -> str | None:
    return importable("torch")


SCORES_LIMIT = 64 << 30  # bytes of fp32 scores over the whole call (the chunks together)


def unsupported(problem: str, dims: dict[str, int], cc: tuple[int, int] | None) -> str | None:
    rows = dims["s"] * dims["h"] if problem == "mqa_logits" else dims["b"] * dims["next_n"] * dims["h"]
    keys = dims["s_kv"] if problem == "mqa_logits" else dims["max_len"]
    if rows * keys * 4 > SCORES_LIMIT:  # chunked it would run, at ~0.2 s a call: too slow to time
        return f"the fp32 scores ({rows} x {keys}) exceed {SCORES_LIMIT >> 30} GiB: too slow to time here"
    return None


def make(problem: str, dims: dict[str, int], inputs: dict) -> Callable[[], dict]:
    import torch

    h = dims["h"]
    out_dtype = torch.bfloat16 if dims.get("logits_bf16") else torch.float32  # the stage's logits' dtype
    if problem == "mqa_logits":
        s, s_kv = dims["s"], dims["s_kv"]
        q = inputs["q"].view(s * h, dims["d"])
        kv, kv_scale, w = inputs["kv"], inputs["kv_scale"], inputs["weights"]
        ks, ke = inputs["ks"], inputs["ke"]
        rows = max(1, min(s, SCORE_BYTES // (h * s_kv * 4)))
        j = torch.arange(s_kv, device=q.device)

        def run() -> dict:
            k = (kv.float() * kv_scale[:, None]).to(torch.bfloat16)
            qb = q.to(torch.bfloat16)
            out = torch.empty(s, s_kv, dtype=torch.float32, device=q.device)
            for r0 in range(0, s, rows):
                r1 = min(s, r0 + rows)
                sc = (qb[r0 * h:r1 * h] @ k.T).float().relu_().view(r1 - r0, h, s_kv)
                out[r0:r1] = torch.einsum("rhk,rh->rk", sc, w[r0:r1])
            valid = (j[None, :] >= ks[:, None]) & (j[None, :] < ke[:, None])
            out = out.masked_fill_(~valid, float("-inf"))
            if dims.get("compressed"):  # [s, W] from ks: column c of row i is key ks[i] + c
                c = ks.long()[:, None] + torch.arange(dims["width"], device=q.device)[None, :]
                inside = (c < ke.long()[:, None]) & (c >= 0) & (c < s_kv)
                out = out.gather(1, c.clamp(0, s_kv - 1)).masked_fill_(~inside, float("-inf"))
            return {"logits": out.to(out_dtype)}

        return run

    b, next_n, d, bk = dims["b"], dims["next_n"], dims["d"], dims["block_kv"]
    max_len = dims["max_len"]
    nb = dims["num_blocks"]
    cache = inputs["kv_cache"].view(nb, bk * (d + 4))
    table, lens, w = inputs["block_table"].long(), inputs["context_lens"], inputs["weights"]
    q = inputs["q"].view(b, next_n * h, d)
    seqs = max(1, min(b, SCORE_BYTES // (next_n * h * max_len * 4)))
    j = torch.arange(max_len, device=q.device)
    if lens.dim() == 2:  # per token: keys < context_lens[i, t]
        pos = lens - 1
    else:
        pos = lens[:, None] - next_n + torch.arange(next_n, device=q.device)[None, :]  # [b, next_n]
    valid = (j[None, None, :] <= pos[..., None]).view(b * next_n, max_len)

    def run_paged() -> dict:
        values = cache[:, : bk * d].view(torch.float8_e4m3fn).view(nb, bk, d)
        scale = cache[:, bk * d:].contiguous().view(torch.float32).view(nb, bk)
        k_all = (values.float() * scale[..., None]).to(torch.bfloat16)  # [nb, bk, d]
        qb = q.to(torch.bfloat16)
        out = torch.empty(b, next_n, max_len, dtype=torch.float32, device=q.device)
        for b0 in range(0, b, seqs):
            b1 = min(b, b0 + seqs)
            k = k_all[table[b0:b1]].view(b1 - b0, max_len, d)
            sc = torch.bmm(qb[b0:b1], k.transpose(1, 2)).float().relu_().view(b1 - b0, next_n, h, max_len)
            out[b0:b1] = torch.einsum("bthk,bth->btk", sc, w[b0 * next_n:b1 * next_n].view(b1 - b0, next_n, h))
        return {"logits": out.view(b * next_n, max_len).masked_fill_(~valid, float("-inf")).to(out_dtype)}

    return run_paged
