"""Stages I1 and I2: DSV4's lightning indexer — FP8 MQA logits, flat and paged (docs/INDEXER.md).

    logits[i, j] = Σ_h relu(q[i, h] · k[j] · k_scale[j]) · w[i, h]       (h = 64 heads, d = 128)

Axes of both: `heads` (32 | 64), `head_dim` (32 | 64 | 128) — 64 and 128 below stand for them
(`heads_dim`) — and `logits_dtype` (fp32 | bf16: the reference then the float64 logits rounded
to bf16, `as_output`, so the bounds measure the kernel's error).  I1's `compressed`: DeepGEMM's
max_seqlen_k form, logits [s, W], W = max(ke − ks) (`compressed_width`), column c of row i key
ks[i] + c, −inf outside [ks[i], ke[i]) or [0, s_kv) (`compress`).  I2's `context_2d`: context_lens
[b, next_n], token t seeing keys < context_lens[i, t] (`token_context_lens`, drawn as DeepGEMM's
test draws them).

The reference: float64 from the dequantised fp8 bytes the kernel reads, chunked; −inf outside
each query's range.  Quantisers (as DeepGEMM's tests): keys per token scale = max(amax(k), 1e-4)
/ 448, k8 = e4m3(k / scale); queries q8 = e4m3(q), no scale.

Stage I1 — flat.  Axes: s, s_kv, ranges ('causal' | 'cp').
    q [s, 64, 128] e4m3 · kv [s_kv, 128] e4m3 · kv_scale [s_kv] fp32 · weights [s, 64] fp32 ·
    ks [s], ke [s] int32  →  logits [s, s_kv] fp32, −inf outside [ks[i], ke[i]).
    Ranges (`ranges_of`, pure functions of the case, so `flops` is exact):
      causal   query i sits at position s_kv − s + i and sees [0, pos + 1)
      cp       two disjoint chunks of the sequence (near its start and end, as a CP rank holds
               them); the second sees a sliding window [pos + 1 − s_kv/2, pos + 1)
    Every 37th row (from row 5) is empty (ks = ke), and row 3 of 'cp' has ks > ke: −inf rows.

Stage I2 — paged.  Axes: b, next_n, ctx (the average context length), block_kv.
    q [b, next_n, 64, 128] e4m3 · kv_cache [num_blocks, block_kv, 1, 132] uint8 ·
    context_lens [b] int32 · block_table [b, max_blocks] int32 · weights [b·next_n, 64] fp32
    →  logits [b·next_n, max_len] fp32, max_len = max_blocks · block_kv.
    A block holds block_kv·128 e4m3 values (token-major), then block_kv fp32 scales.  Token t of
    sequence i sits at context_lens[i] − next_n + t and sees the keys at positions ≤ it; key p
    lives in block block_table[i, p // block_kv], slot p % block_kv.  Context lengths are pure
    functions of the case (in [0.7, 1.3]·ctx, never a multiple of block_kv; with b > 1 one is
    next_n + 3); the table is a seeded shuffle.  Every slot past a context (its last block's
    tail, spare blocks, table entries past the sequence) holds NaN: mask by selection."""

from __future__ import annotations

import math
import random
from typing import Any

from oracles.common import TensorSpec

HEADS = 64
DIM = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1.0e-4
EMPTY_EVERY = 37  # every 37th row (from row EMPTY_FIRST) has an empty range
EMPTY_FIRST = 5
SPARE_BLOCKS = 5  # physical blocks of the paged cache no sequence owns (NaN)
NAN_E4M3 = 0x7F  # e4m3 NaN byte


# ----------------------------------------------------------------------------- quantisers


def quantize_per_token(x):
    """(e4m3 values, fp32 scales [rows]) of a [rows, d] tensor: scale = max(amax, 1e-4) / 448
    per row, values = e4m3(x / scale)."""
    import torch

    amax = x.abs().float().amax(dim=-1).clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    q = (x.float() / scale[..., None]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(values, scale):
    """float64 x ≈ values · scale (scale per row of `values`)."""
    import torch

    return values.to(torch.float64) * scale.to(torch.float64)[..., None]


def pack_paged_cache(values, scale):
    """The fused paged cache [num_blocks, block_kv, 1, d + 4] uint8 from e4m3 values
    [num_blocks, block_kv, d] and fp32 scales [num_blocks, block_kv]: per block, the
    block_kv·d value bytes (token-major), then the block_kv scales' bytes."""
    import torch

    nb, bk, d = values.shape
    cache = torch.empty(nb, bk * (d + 4), dtype=torch.uint8, device=values.device)
    cache[:, : bk * d] = values.contiguous().view(torch.uint8).reshape(nb, bk * d)
    cache[:, bk * d:] = scale.to(torch.float32).contiguous().view(torch.uint8).reshape(nb, bk * 4)
    return cache.view(nb, bk, 1, d + 4)


def unpack_paged_cache(cache):
    """(e4m3 values [num_blocks, block_kv, d], fp32 scales [num_blocks, block_kv]) of a fused
    paged cache (the inverse of `pack_paged_cache`)."""
    import torch

    nb, bk, _, d4 = cache.shape
    d = d4 - 4
    flat = cache.reshape(nb, bk * d4)
    values = flat[:, : bk * d].contiguous().view(torch.float8_e4m3fn).reshape(nb, bk, d)
    scale = flat[:, bk * d:].contiguous().view(torch.float32).reshape(nb, bk)
    return values, scale


# ----------------------------------------------------------------------------- the math


def mqa_logits(q, k, w, valid):
    """float64 logits [rows, keys] = Σ_h relu(q[r, h] · k[j]) · w[r, h] where `valid[r, j]`, −inf
        elsewhere; q [rows, h, d], k [keys, d] (dequantised), w [rows, h], one device; chunked so the
        score block stays under ~32 M elements."""
    import torch

    rows, h, _ = q.shape
    keys = k.shape[0]
    q, k, w = q.to(torch.float64), k.to(torch.float64), w.to(torch.float64)
    out = torch.full((rows, keys), float("-inf"), dtype=torch.float64, device=q.device)
    kc = min(keys, 8192) if keys else 1
    rc = max(1, (32 << 20) // (h * kc))
    for r0 in range(0, rows, rc):
        for k0 in range(0, keys, kc):
            s = torch.einsum("rhd,kd->rhk", q[r0:r0 + rc], k[k0:k0 + kc]).clamp_(min=0.0)
            logit = torch.einsum("rhk,rh->rk", s, w[r0:r0 + rc])
            blk = out[r0:r0 + rc, k0:k0 + kc]
            blk.copy_(torch.where(valid[r0:r0 + rc, k0:k0 + kc], logit, blk))
    return out


# ----------------------------------------------------------------------------- stage I1


def heads_dim(case: dict[str, Any]) -> tuple[int, int]:
    """(heads, head_dim) of a case: its `heads` and `head_dim` axes, DSV4's 64 and 128 without them."""
    return int(case.get("heads", HEADS)), int(case.get("head_dim", DIM))


LOGITS_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def logits_dtype(case: dict[str, Any]) -> str:
    """The torch dtype name of the case's logits: its `logits_dtype` axis (fp32 | bf16), fp32 without it."""
    name = case.get("logits_dtype", "fp32")
    if name not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be fp32 or bf16, got {name!r}")
    return LOGITS_DTYPES[name]


def as_output(logits, case: dict[str, Any]):
    """float64 `logits` as the case's output holds them: rounded to bf16 (then back to float64)
    for bf16 logits, unchanged for fp32 (−inf stays −inf)."""
    import torch

    if logits_dtype(case) == "bfloat16":
        return logits.to(torch.bfloat16).to(torch.float64)
    return logits


def is_compressed(case: dict[str, Any]) -> bool:
    """I1's `compressed` axis (false without it)."""
    return bool(case.get("compressed", False))


def compressed_width(ks: list[int], ke: list[int]) -> int:
    """W = max(ke − ks) over the rows (at least 1): the width of the compressed logits."""
    return max([1] + [e - b for b, e in zip(ks, ke)])


def compress(full, ks, ke, width: int):
    """The compressed form [s, width] of full logits [s, s_kv]: column c of row i is full[i, ks[i]
    + c] where ks[i] ≤ ks[i] + c < ke[i] and the key is in [0, s_kv); −inf elsewhere."""
    import torch

    s, s_kv = full.shape
    j = ks.long().to(full.device)[:, None] + torch.arange(width, device=full.device)[None, :]
    ok = (j >= 0) & (j < s_kv) & (j < ke.long().to(full.device)[:, None])
    picked = full.gather(1, j.clamp(0, max(s_kv - 1, 0)))
    return torch.where(ok, picked, torch.full_like(picked, float("-inf")))


def ranges_of(case: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(ks, ke) of stage I1's case: see the module doc.  Plain lists of ints."""
    s, s_kv, kind = int(case["s"]), int(case["s_kv"]), case["ranges"]
    ks, ke = [0] * s, [0] * s
    if kind == "causal":
        for i in range(s):
            pos = s_kv - s + i
            ks[i], ke[i] = 0, pos + 1
    elif kind == "cp":
        half = s // 2
        first = s_kv // 8  # chunk 0 starts here
        second = s_kv - (s - half)  # chunk 1 ends at the last key
        window = s_kv // 2
        for i in range(s):
            if i < half:
                pos = first + i
                ks[i], ke[i] = 0, pos + 1
            else:
                pos = second + (i - half)
                ks[i], ke[i] = max(0, pos + 1 - window), pos + 1
        if s > 3:
            ks[3], ke[3] = ke[3] + 1, ke[3]  # ks > ke: empty
    else:
        raise ValueError(f"ranges must be 'causal' or 'cp', got {kind!r}")
    for i in range(EMPTY_FIRST, s, EMPTY_EVERY):
        ks[i] = ke[i] = min(ke[i], s_kv - 1) // 2  # empty, mid-sequence
    return ks, ke


def tensors(case: dict[str, Any]) -> list[TensorSpec]:
    s, s_kv = int(case["s"]), int(case["s_kv"])
    h, d = heads_dim(case)
    return [
        TensorSpec("q", (s, h, d), "float8_e4m3fn"),
        TensorSpec("kv", (s_kv, d), "float8_e4m3fn"),
        TensorSpec("kv_scale", (s_kv,), "float32"),
        TensorSpec("weights", (s, h), "float32"),
        TensorSpec("ks", (s,), "int32"),
        TensorSpec("ke", (s,), "int32"),
        TensorSpec("logits", (s, compressed_width(*ranges_of(case)) if is_compressed(case) else s_kv),
                   logits_dtype(case), "out"),
    ]


def _keys(g, n: int, d: int = DIM):
    """[n, d] bf16-rounded keys whose magnitude varies per token (so the scales do)."""
    import torch

    k = torch.randn(n, d, generator=g) * torch.exp(0.7 * torch.randn(n, 1, generator=g))
    return k.to(torch.bfloat16)


def make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    s, s_kv = int(case["s"]), int(case["s_kv"])
    h, d = heads_dim(case)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, h, d, generator=g).to(torch.float8_e4m3fn)
    kv, kv_scale = quantize_per_token(_keys(g, s_kv, d))
    weights = torch.randn(s, h, generator=g)
    ks, ke = ranges_of(case)
    return {
        "q": q.to(device), "kv": kv.to(device), "kv_scale": kv_scale.to(device), "weights": weights.to(device),
        "ks": torch.tensor(ks, dtype=torch.int32, device=device),
        "ke": torch.tensor(ke, dtype=torch.int32, device=device),
    }


def reference(inputs: dict, case: dict[str, Any]) -> dict:
    """float64 logits [s, s_kv] from the dequantised values; −inf outside [ks, ke); compressed: [s, W]
    from ks (`compress`)."""
    import torch

    q = inputs["q"].to(torch.float64)
    k = dequantize(inputs["kv"], inputs["kv_scale"])
    j = torch.arange(k.shape[0], device=q.device)
    valid = (j[None, :] >= inputs["ks"].long()[:, None]) & (j[None, :] < inputs["ke"].long()[:, None])
    full = mqa_logits(q, k, inputs["weights"], valid)
    if is_compressed(case):
        full = compress(full, inputs["ks"], inputs["ke"], compressed_width(inputs["ks"].tolist(), inputs["ke"].tolist()))
    return {"logits": as_output(full, case)}


def valid_pairs(case: dict[str, Any]) -> int:
    """(query, key) pairs inside their ranges: the work a kernel must do."""
    s_kv = int(case["s_kv"])
    ks, ke = ranges_of(case)
    return sum(max(0, min(e, s_kv) - max(b, 0)) for b, e in zip(ks, ke))


def flops(case: dict[str, Any]) -> float:
    """2 · h · d per valid (query, key) pair (DeepGEMM's count; the masked-out pairs are free)."""
    h, d = heads_dim(case)
    return 2.0 * h * d * valid_pairs(case)


def torch_logits(inputs: dict, case: dict[str, Any]):
    """Peer for `run --bench`: the same logits as a PyTorch user writes them (dequantise to
    bf16, one matmul, ReLU, weighted head sum, mask)."""
    import torch

    q = inputs["q"].to(torch.bfloat16)
    k = (inputs["kv"].float() * inputs["kv_scale"][:, None]).to(torch.bfloat16)
    s = torch.einsum("shd,kd->shk", q, k).float().relu_()
    logits = torch.einsum("shk,sh->sk", s, inputs["weights"])
    j = torch.arange(k.shape[0], device=q.device)
    valid = (j[None, :] >= inputs["ks"][:, None]) & (j[None, :] < inputs["ke"][:, None])
    logits = logits.masked_fill_(~valid, float("-inf"))
    if is_compressed(case):
        logits = compress(logits, inputs["ks"], inputs["ke"], compressed_width(inputs["ks"].tolist(), inputs["ke"].tolist()))
    return logits.to(getattr(torch, logits_dtype(case)))


# ----------------------------------------------------------------------------- stage I2


def context_lens_of(case: dict[str, Any]) -> list[int]:
    """Stage I2's context lengths: a pure function of the case (see the module doc)."""
    b, next_n, ctx, bk = int(case["b"]), int(case["next_n"]), int(case["ctx"]), int(case["block_kv"])
    rng = random.Random(f"I2|{b}|{next_n}|{ctx}|{bk}")
    lens = []
    for _ in range(b):
        n = rng.randint(max(next_n, int(0.7 * ctx)), max(next_n, int(1.3 * ctx)))
        lens.append(n + 1 if n % bk == 0 else n)
    if b > 1:
        lens[1] = next_n + 3 if (next_n + 3) % bk else next_n + 4
    return lens


def is_context_2d(case: dict[str, Any]) -> bool:
    """I2's `context_2d` axis (false without it)."""
    return bool(case.get("context_2d", False))


def token_context_lens(case: dict[str, Any]) -> list[list[int]]:
    """[b][next_n] per-token context lengths of a context_2d case: the last token sees the whole
        context, token t < next_n − 1 the keys < an integer in [0, that length] (as DeepGEMM draws)."""
    b, next_n, ctx = int(case["b"]), int(case["next_n"]), int(case["ctx"])
    rng = random.Random(f"I2-2d|{b}|{next_n}|{ctx}|{case['block_kv']}")
    return [[rng.randint(0, n) for _ in range(next_n - 1)] + [n] for n in context_lens_of(case)]


def token_limits(inputs: dict, next_n: int) -> list[list[int]]:
    """[b][next_n]: token t of sequence i sees the keys < limit — from 2-D context_lens as they
    are, from 1-D ones len − next_n + t + 1 (the causal limit)."""
    lens = inputs["context_lens"]
    if lens.dim() == 2:
        return lens.tolist()
    return [[n - next_n + t + 1 for t in range(next_n)] for n in lens.tolist()]


def paged_geometry(case: dict[str, Any]) -> dict[str, int]:
    """{'max_blocks', 'max_len', 'num_blocks'} of stage I2's case: the table has one block
    beyond the longest context (so every row ends in −inf), the cache the sequences' blocks
    plus SPARE_BLOCKS."""
    bk = int(case["block_kv"])
    lens = context_lens_of(case)
    max_blocks = max(math.ceil(n / bk) for n in lens) + 1
    used = sum(math.ceil(n / bk) for n in lens)
    return {"max_blocks": max_blocks, "max_len": max_blocks * bk, "num_blocks": used + SPARE_BLOCKS}


def paged_tensors(case: dict[str, Any]) -> list[TensorSpec]:
    b, next_n, bk = int(case["b"]), int(case["next_n"]), int(case["block_kv"])
    h, d = heads_dim(case)
    geo = paged_geometry(case)
    return [
        TensorSpec("q", (b, next_n, h, d), "float8_e4m3fn"),
        TensorSpec("kv_cache", (geo["num_blocks"], bk, 1, d + 4), "uint8"),
        TensorSpec("context_lens", (b, next_n) if is_context_2d(case) else (b,), "int32"),
        TensorSpec("block_table", (b, geo["max_blocks"]), "int32"),
        TensorSpec("weights", (b * next_n, h), "float32"),
        TensorSpec("logits", (b * next_n, geo["max_len"]), logits_dtype(case), "out"),
    ]


def paged_make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    b, next_n, bk = int(case["b"]), int(case["next_n"]), int(case["block_kv"])
    geo = paged_geometry(case)
    lens = context_lens_of(case)
    nb = geo["num_blocks"]
    h, d = heads_dim(case)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, next_n, h, d, generator=g).to(torch.float8_e4m3fn)
    values, scale = quantize_per_token(_keys(g, nb * bk, d))
    values, scale = values.view(nb, bk, d), scale.view(nb, bk)
    weights = torch.randn(b * next_n, h, generator=g)

    order = torch.randperm(nb, generator=g).tolist()  # physical blocks, shuffled
    owned, spare = order[: nb - SPARE_BLOCKS], order[nb - SPARE_BLOCKS:]
    table = torch.empty(b, geo["max_blocks"], dtype=torch.int32)
    vbytes = values.view(torch.uint8)  # NaN planted through the bytes
    at = 0
    for i, n in enumerate(lens):
        nblk = math.ceil(n / bk)
        for blk in range(geo["max_blocks"]):
            if blk < nblk:
                table[i, blk] = owned[at]
                at += 1
            else:  # past the sequence: a spare (NaN) block
                table[i, blk] = spare[(i + blk) % len(spare)]
        last, used = int(table[i, nblk - 1]), n - (nblk - 1) * bk
        vbytes[last, used:] = NAN_E4M3
        scale[last, used:] = float("nan")
    for blk in spare:
        vbytes[blk] = NAN_E4M3
        scale[blk] = float("nan")
    return {
        "q": q.to(device),
        "kv_cache": pack_paged_cache(values, scale).to(device),
        "context_lens": torch.tensor(token_context_lens(case) if is_context_2d(case) else lens, dtype=torch.int32,
                                     device=device),
        "block_table": table.to(device),
        "weights": weights.to(device),
    }


def paged_reference(inputs: dict, case: dict[str, Any]) -> dict:
    """float64 logits [b·next_n, max_len]: gather each sequence's keys through its block
    table, dequantise, and keep the positions ≤ each query token's position (2-D context
    lengths: < the token's own length)."""
    import torch

    q = inputs["q"]
    b, next_n = q.shape[0], q.shape[1]
    table = inputs["block_table"]
    values, scale = unpack_paged_cache(inputs["kv_cache"])
    bk = values.shape[1]
    max_len = table.shape[1] * bk
    out = torch.full((b * next_n, max_len), float("-inf"), dtype=torch.float64, device=q.device)
    for i, limits in enumerate(token_limits(inputs, next_n)):
        n = max(0, min(max(limits), max_len))  # the keys any token of the sequence sees
        nblk = math.ceil(n / bk)
        blocks = table[i, :nblk].long()
        k = dequantize(values[blocks].reshape(nblk * bk, -1)[:n], scale[blocks].reshape(-1)[:n])
        j = torch.arange(n, device=q.device)
        valid = j[None, :] < torch.tensor(limits, device=q.device)[:, None]
        rows = slice(i * next_n, (i + 1) * next_n)
        out[rows, :n] = mqa_logits(q[i].to(torch.float64), k, inputs["weights"][rows], valid)
    return {"logits": as_output(out, case)}


def paged_flops(case: dict[str, Any]) -> float:
    """2 · h · d per (query token, visible key) pair."""
    next_n = int(case["next_n"])
    if is_context_2d(case):
        pairs = sum(sum(row) for row in token_context_lens(case))
    else:
        pairs = sum(sum(n - next_n + t + 1 for t in range(next_n)) for n in context_lens_of(case))
    h, d = heads_dim(case)
    return 2.0 * h * d * pairs


def torch_paged_logits(inputs: dict, case: dict[str, Any]):
    """Peer for `run --bench`: gather the blocks, dequantise to bf16, one batched matmul,
    ReLU, weighted head sum, causal mask."""
    import torch

    q = inputs["q"]
    b, next_n = q.shape[0], q.shape[1]
    table = inputs["block_table"]
    values, scale = unpack_paged_cache(inputs["kv_cache"])
    bk = values.shape[1]
    max_len = table.shape[1] * bk
    k = (values[table.long()].float() * scale[table.long()][..., None]).to(torch.bfloat16)  # [b, blocks, bk, d]
    k = k.reshape(b, max_len, -1)
    s = torch.einsum("bthd,bkd->bthk", q.to(torch.bfloat16), k).float().relu_()
    logits = torch.einsum("bthk,bth->btk", s, inputs["weights"].view(b, next_n, -1))
    lens = inputs["context_lens"]
    if lens.dim() == 2:  # per token: keys < context_lens[i, t]
        pos = lens - 1
    else:
        pos = lens[:, None] - next_n + torch.arange(next_n, device=q.device)[None, :]
    j = torch.arange(max_len, device=q.device)
    valid = j[None, None, :] <= pos[..., None]
    out = logits.masked_fill_(~valid, float("-inf")).reshape(b * next_n, max_len)
    return out.to(getattr(torch, logits_dtype(case)))
