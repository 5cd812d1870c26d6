"""Stages D3, D4, D5: DSV4 decode attention over MASKED keys — the SWA fill level (D3), causal
SWA (D4), and two key branches under one softmax with an attention sink (D5).

Conventions (issue 13): docs/MASKED_DECODE.md "Keys" and "Outputs" — the fill level
(D3: key j valid iff j < swa_lens[b]; keys past it may hold NaN), causal SWA (D4: token t sees
j ≤ swa_lens[b] − s_q + t), two branches under ONE softmax (D5: main j < main_lens[b], a key in
both counts twice), the sink O · 1 / (1 + exp(sink[h] − lse)) (LSE without it), and the lonely
row O = 0, LSE = +inf, never NaN.

Tensors
    D3, D4   D2's (oracles/decode.py) with swa_lens [b] int32 after KV; `shape` D2's word.
    D5       Q, KV_main [b, n_main, d], KV_swa [b, n_swa, d], main_lens [b], swa_lens [b]
             int32, sink [h_q] fp32, O, LSE, O_part, LSE_part; `shape`
             b{b}s{s_q}h{h_q}m{n_main}n{n_swa}d{d}.

Matrix axes (inputs only, not kernel parameters)
    fill (D3, D4)  batch 0's fill level: an int, "random" (uniform in 1 … n−1), "full" (n),
                   "below" (s_q − 1) or "at" (s_q).  The other batches cycle through
                   0 (lonely), n (full) and a random level — so every case with b ≥ 3 has a
                   lonely batch beside a full one.
    branches (D5)  "{main}+{swa}" with each side 0 (the branch empty in every batch), k (per
                   batch: full, random, 1, 65 cycling) or full.
    sink (D5)      none (the kernel applies no sink; the tensor holds NaN), or a value:
                   -inf, -5, 0, 5, inf.  The kernel takes it as a parameter (present or not).

Inputs: seeded, never zeros: D2's, with three strong keys (· 2) at fill − 1, fill − 70, fill −
1000 per batch (the NEWEST key carries weight: a mask off by one moves O); every key row past
the fill level is NaN.  D5 adds a per-head score offset (key column 0 +4, query column 0
−offset_h · sqrt(d) / 4, offsets over [0, 15]): LSEs span about [−8, 8], so every sink value moves
some heads' O.

The reference: ONE float64 softmax over exactly the valid keys (both branches for D5), from these
definitions, no kernel code.  `merge_branches`: DSV4.md's merge of two separate branches (tested
equal to the union).
"""

from __future__ import annotations

import math
from typing import Any

from oracles.common import TensorSpec
from oracles.decode import Q_SCALE, STRONG_KEY_SCALE, parse_shape
from stages.common.scheduler import MANY_EXTRA, SM_COUNT, BranchShape

SINK_VALUES = {"-inf": -math.inf, "inf": math.inf}
SHIFT_MAX = 15.0  # D5: the largest per-head score offset (the smallest is 0)
SHIFT_KEY = 4.0  # D5: the value of key column 0


# -- cases -----------------------------------------------------------------------------------

def parse_branch_shape(word: str) -> dict[str, int]:
    """{'b', 's_q', 'h_q', 'n_main', 'n_swa', 'd'} of a D5 word b{b}s{s_q}h{h_q}m{n_main}n{n_swa}d{d}."""
    return vars(BranchShape.parse(word)).copy()


def _capacity(splits: Any, rows_fill_gpu: bool, n_keys: int) -> int:
    """oracles/decode.py's scratch capacity rule over `n_keys` keys in all."""
    if splits == "auto":
        return 1 if rows_fill_gpu else max(1, n_keys // 64)
    if splits == "many":
        return max(1, n_keys // 64) + MANY_EXTRA
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive int, 'auto' or 'many', got {splits!r}")
    return splits


def sink_value(word: Any) -> float | None:
    """The sink logit a case's `sink` axis names, or None for "none"."""
    if word == "none":
        return None
    if str(word) in SINK_VALUES:
        return SINK_VALUES[str(word)]
    if isinstance(word, bool) or not isinstance(word, (int, float)):
        raise ValueError(f"sink must be none, -inf, inf or a number, got {word!r}")
    return float(word)


def _levels(first: int | None, n: int, b: int, g) -> list[int]:
    """Fill levels of b batches: batch 0 gets `first` (None: random), the rest cycle through
    0 (lonely), n (full) and a random level in 1 … n−1."""
    import torch

    def rand() -> int:
        return int(torch.randint(1, max(2, n), (1,), generator=g)) if n > 1 else n

    out = [rand() if first is None else first]
    for i in range(1, b):
        out.append((0, n, None)[(i - 1) % 3])
        if out[-1] is None:
            out[-1] = rand()
    return out


def fill_levels(case: dict[str, Any], seed: int) -> list[int]:
    """swa_lens of a D3 / D4 case (see the module doc)."""
    import torch

    p = parse_shape(case["shape"])
    n, s_q = p["n"], p["s_q"]
    g = torch.Generator().manual_seed(seed ^ 0x5A5A)
    word = case["fill"]
    named = {"full": n, "below": s_q - 1, "at": s_q, "random": None}
    if isinstance(word, str):
        if word not in named:
            raise ValueError(f"fill must be an int, random, full, below or at, got {word!r}")
        first = named[word]
    elif isinstance(word, bool) or not isinstance(word, int):
        raise ValueError(f"fill must be an int, random, full, below or at, got {word!r}")
    else:
        first = word
    if first is not None and not 0 <= first <= n:
        raise ValueError(f"fill {word!r} = {first} is outside 0 … n = {n}")
    return _levels(first, n, p["b"], g)


def branch_levels(case: dict[str, Any], seed: int) -> tuple[list[int], list[int]]:
    """(main_lens, swa_lens) of a D5 case (see the module doc)."""
    import torch

    p = parse_branch_shape(case["shape"])
    words = str(case["branches"]).split("+")
    if len(words) != 2 or any(w not in ("0", "k", "full") for w in words):
        raise ValueError(f"branches must be <0|k|full>+<0|k|full>, got {case['branches']!r}")
    g = torch.Generator().manual_seed(seed ^ 0xA5A5)
    out = []
    for w, n in zip(words, (p["n_main"], p["n_swa"])):
        if w == "0":
            out.append([0] * p["b"])
        elif w == "full":
            out.append([n] * p["b"])
        else:
            cyc = [n, int(torch.randint(2, max(3, n), (1,), generator=g)), 1, min(65, n)]
            out.append([min(cyc[i % 4], n) for i in range(p["b"])])
    return out[0], out[1]


# -- validity and the reference ----------------------------------------------------------------


def valid_keys(lens: list[int], n: int, s_q: int, causal: bool):
    """Boolean [b, s_q, n]: key j valid for token t of batch b (the conventions above)."""
    import torch

    j = torch.arange(n)
    rows = []
    for L in lens:
        per_t = []
        for t in range(s_q):
            ok = j < L
            if causal:
                ok = ok & (j <= L - s_q + t)
            per_t.append(ok)
        rows.append(torch.stack(per_t))
    return torch.stack(rows)


def masked_attention(q, kvs: list, valids: list, sink=None) -> dict:
    """float64 O [b, s_q, h_q, d] and LSE [b, h_q, s_q]: one softmax over the valid keys of every
        branch (`kvs[i]` [b, n_i, d], `valids[i]` bool [b, s_q, n_i]); lonely rows O = 0, LSE = +inf;
        `sink` [h_q]: O · 1 / (1 + exp(sink − lse))."""
    import torch

    q = q.double()
    d = q.shape[-1]
    scores, values = [], []
    for kv, ok in zip(kvs, valids):
        kv = kv.double().to(q.device)
        kv = torch.where(ok.any(dim=1)[..., None].to(q.device), kv, torch.zeros_like(kv))  # NaN rows never touch the math
        s = torch.einsum("bthd,bnd->bthn", q, kv) / math.sqrt(d)
        s = s.masked_fill(~ok[:, :, None, :].to(q.device), -math.inf)
        scores.append(s)
        values.append(kv)
    s = torch.cat(scores, dim=-1)
    v = torch.cat(values, dim=1)
    lse = torch.logsumexp(s, dim=-1)  # −inf where no key is valid
    lonely = torch.isneginf(lse)
    p = torch.exp(s - torch.where(lonely, torch.zeros_like(lse), lse)[..., None])
    o = torch.einsum("bthn,bnd->bthd", p, v)
    if sink is not None:
        sink = sink.double().to(q.device)
        factor = 1.0 / (1.0 + torch.exp(sink[None, None, :] - torch.where(lonely, torch.zeros_like(lse), lse)))
        o = o * torch.where(lonely, torch.zeros_like(factor), factor)[..., None]
    o = torch.where(lonely[..., None], torch.zeros_like(o), o)
    lse = torch.where(lonely, torch.full_like(lse, math.inf), lse)
    return {"O": o, "LSE": lse.permute(0, 2, 1).contiguous()}


def merge_branches(o1, lse1, o2, lse2):
    """DSV4.md's merge of two separately computed branches (O_i, LSE_i, +inf for an empty branch):
        lse = logaddexp, O = Σ exp(lse_i − lse) · O_i; both empty: O = 0, LSE = +inf."""
    import torch

    l1 = torch.where(torch.isposinf(lse1), torch.full_like(lse1, -math.inf), lse1).double()
    l2 = torch.where(torch.isposinf(lse2), torch.full_like(lse2, -math.inf), lse2).double()
    lse = torch.logaddexp(l1, l2)
    lonely = torch.isneginf(lse)
    safe = torch.where(lonely, torch.zeros_like(lse), lse)
    w1 = torch.exp(l1 - safe).permute(0, 2, 1)[..., None]
    w2 = torch.exp(l2 - safe).permute(0, 2, 1)[..., None]
    o = w1 * o1.double() + w2 * o2.double()
    return o, torch.where(lonely, torch.full_like(lse, math.inf), lse)


# -- D3 and D4 -------------------------------------------------------------------------------


def swa_tensors(case: dict[str, Any]) -> list[TensorSpec]:
    p = parse_shape(case["shape"])
    b, s_q, h_q, n_alloc, d = p["b"], p["s_q"], p["h_q"], p["n_alloc"], p["d"]
    cap = _capacity(case["splits"], p["b"] * p["s_q"] * math.ceil(p["h_q"] / 128) >= SM_COUNT, p["n"])
    return [
        TensorSpec("Q", (b, s_q, h_q, d), "bfloat16"),
        TensorSpec("KV", (b, n_alloc, d), "bfloat16"),
        TensorSpec("swa_lens", (b,), "int32"),
        TensorSpec("O", (b, s_q, h_q, d), "bfloat16", "out"),
        TensorSpec("LSE", (b, h_q, s_q), "float32", "out"),
        TensorSpec("O_part", (cap, b, s_q, h_q, d), "float32", "scratch"),
        TensorSpec("LSE_part", (cap, b, s_q, h_q), "float32", "scratch"),
    ]


def _strong(kv, lens: list[int]) -> None:
    """Three strong keys (× 2) just below each batch's fill level, in place."""
    for i, L in enumerate(lens):
        for j in (L - 1, L - 70, L - 1000):
            if 0 <= j < L:
                kv[i, j] *= STRONG_KEY_SCALE


def _nan_past(kv, lens: list[int]) -> None:
    for i, L in enumerate(lens):
        kv[i, L:] = float("nan")


def swa_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    p = parse_shape(case["shape"])
    b, s_q, h_q, n_alloc, d = p["b"], p["s_q"], p["h_q"], p["n_alloc"], p["d"]
    lens = fill_levels(case, seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h_q, d, generator=g) * Q_SCALE
    kv = torch.randn(b, n_alloc, d, generator=g)
    _strong(kv, lens)
    _nan_past(kv, lens)
    return {
        "Q": q.to(torch.bfloat16).to(device),
        "KV": kv.to(torch.bfloat16).to(device),
        "swa_lens": torch.tensor(lens, dtype=torch.int32).to(device),
    }


def _swa(inputs: dict, case: dict[str, Any], causal: bool) -> dict:
    p = parse_shape(case["shape"])
    lens = [int(x) for x in inputs["swa_lens"].cpu()]
    kv = inputs["KV"][:, : p["n"]]
    return masked_attention(inputs["Q"], [kv], [valid_keys(lens, p["n"], p["s_q"], causal)])


def swa_reference(inputs: dict, case: dict[str, Any]) -> dict:
    """D3: float64 softmax over keys j < swa_lens[b]."""
    return _swa(inputs, case, causal=False)


def causal_swa_reference(inputs: dict, case: dict[str, Any]) -> dict:
    """D4: float64 softmax over keys j ≤ swa_lens[b] − s_q + t."""
    return _swa(inputs, case, causal=True)


def swa_flops(case: dict[str, Any]) -> float:
    """Counted over the window's capacity n (the fill levels are inputs)."""
    p = parse_shape(case["shape"])
    return 4.0 * p["b"] * p["s_q"] * p["h_q"] * p["n"] * p["d"]


# -- D5 ---------------------------------------------------------------------------------------


def merge_tensors(case: dict[str, Any]) -> list[TensorSpec]:
    p = parse_branch_shape(case["shape"])
    b, s_q, h_q, d = p["b"], p["s_q"], p["h_q"], p["d"]
    cap = _capacity(case["splits"], b * s_q * math.ceil(h_q / 128) >= SM_COUNT, p["n_main"] + p["n_swa"])
    return [
        TensorSpec("Q", (b, s_q, h_q, d), "bfloat16"),
        TensorSpec("KV_main", (b, p["n_main"], d), "bfloat16"),
        TensorSpec("KV_swa", (b, p["n_swa"], d), "bfloat16"),
        TensorSpec("main_lens", (b,), "int32"),
        TensorSpec("swa_lens", (b,), "int32"),
        TensorSpec("sink", (h_q,), "float32"),
        TensorSpec("O", (b, s_q, h_q, d), "bfloat16", "out"),
        TensorSpec("LSE", (b, h_q, s_q), "float32", "out"),
        TensorSpec("O_part", (cap, b, s_q, h_q, d), "float32", "scratch"),
        TensorSpec("LSE_part", (cap, b, s_q, h_q), "float32", "scratch"),
    ]


def head_shifts(h_q: int) -> list[float]:
    """D5's per-head score offsets, spread over [0, SHIFT_MAX] (subtracted from every score)."""
    return [SHIFT_MAX * i / max(1, h_q - 1) for i in range(h_q)]


def merge_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    p = parse_branch_shape(case["shape"])
    b, s_q, h_q, d = p["b"], p["s_q"], p["h_q"], p["d"]
    main_lens, swa_lens = branch_levels(case, seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s_q, h_q, d, generator=g) * Q_SCALE
    q[..., 0] = torch.tensor([-s * math.sqrt(d) / SHIFT_KEY for s in head_shifts(h_q)])
    kvs = []
    for n, lens in ((p["n_main"], main_lens), (p["n_swa"], swa_lens)):
        kv = torch.randn(b, n, d, generator=g)
        _strong(kv, lens)
        kv[..., 0] = SHIFT_KEY
        _nan_past(kv, lens)
        kvs.append(kv)
    value = sink_value(case["sink"])
    sink = torch.full((h_q,), math.nan if value is None else value)
    return {
        "Q": q.to(torch.bfloat16).to(device),
        "KV_main": kvs[0].to(torch.bfloat16).to(device),
        "KV_swa": kvs[1].to(torch.bfloat16).to(device),
        "main_lens": torch.tensor(main_lens, dtype=torch.int32).to(device),
        "swa_lens": torch.tensor(swa_lens, dtype=torch.int32).to(device),
        "sink": sink.to(device),
    }


def merge_valids(inputs: dict, case: dict[str, Any]):
    """(valid main [b, s_q, n_main], valid SWA [b, s_q, n_swa]) of a D5 case."""
    p = parse_branch_shape(case["shape"])
    main = [int(x) for x in inputs["main_lens"].cpu()]
    swa = [int(x) for x in inputs["swa_lens"].cpu()]
    return (valid_keys(main, p["n_main"], p["s_q"], causal=False),
            valid_keys(swa, p["n_swa"], p["s_q"], causal=True))


def merge_reference(inputs: dict, case: dict[str, Any]) -> dict:
    """D5: float64 softmax over the union of the valid main and SWA keys, then the sink."""
    vm, vs = merge_valids(inputs, case)
    sink = inputs["sink"] if sink_value(case["sink"]) is not None else None
    return masked_attention(inputs["Q"], [inputs["KV_main"], inputs["KV_swa"]], [vm, vs], sink)


def merge_flops(case: dict[str, Any]) -> float:
    """Counted over both branches' capacities (the fill levels are inputs)."""
    p = parse_branch_shape(case["shape"])
    return 4.0 * p["b"] * p["s_q"] * p["h_q"] * (p["n_main"] + p["n_swa"]) * p["d"]


def torch_merge(inputs: dict, case: dict[str, Any]):
    """Peer for `run --bench`: D5 as PyTorch users write it (`sink_decode`, which torch_plain reuses);
        a NaN sink means "no sink"."""
    return sink_decode(inputs["Q"], inputs["KV_main"], inputs["KV_swa"], inputs["main_lens"], inputs["swa_lens"],
                       inputs["sink"])


def sink_decode(q, kv_main, kv_swa, main_lens, swa_lens, sink):
    """D5 in bf16 PyTorch (two batched matmuls, masks, logsumexp, the sink).  q [b, s_q, h_q, d];
        kv_main [b, n_main, d] (j < main_lens[b]); kv_swa [b, n_swa, d] (j < swa_lens[b], j ≤
        swa_lens[b] − s_q + t); sink [h_q] (NaN: none).  Returns O and LSE (+inf for a keyless row)."""
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
