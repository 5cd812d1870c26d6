"""Stage E: DSV4's decode attention over an FP8 paged cache, sparse indices, two branches, sink.

Tensors (in the kernel's argument order):
    Q            [b, s_q, h_q, 512]        bf16   query heads of each token
    KV           [nb, block_bytes]         uint8  main cache, format `kv_format` (oracles/kvcache.py)
    idx          [b, s_q, topk]            int32  block_id · block_size + offset; −1 = invalid
    topk_length  [b]                       int32  entries of idx at positions ≥ it are ignored,
                                                  whatever they hold (INT_MAX, −5, …)
    KV_extra     [nb_x, block_bytes_x]     uint8  the SWA ("extra") cache, same format, own block size
    idx_extra    [b, s_q, extra_topk]      int32
    extra_length [b]                       int32
    sink         [h_q]                     fp32   attention sink logit per head
    softmax_scale [1]                      fp32   the scale on Q·Kᵀ, a runtime value (DEFAULT_SCALE
                                                  = 1/sqrt(512) but in scenario softmax_scale)
    cos_sin_cache [max_position, 64]       fp32   epilogue fp8_rope: [cos θ_0..31, sin θ_0..31] a
                                                  position (oracles/fp8_epilogue.py); bf16: [1, 64]
    positions    [b · s_q]                 int32  the position of token (i, t) at i · s_q + t
    O            [b, s_q, h_q, 512]        bf16   (out) epilogue bf16; fp8_rope: [8] scratch, unused
    LSE          [b, h_q, s_q]             fp32   (out) natural log, the keys only (no sink)
    O_fp8        [h_q/8, b·s_q, 8, 128]    fp32   (out) epilogue fp8_rope: e4m3 [h_q/8, b·s_q, 8, 512]
                                                  as float32 words; bf16: [4] scratch, unused
    O_scale      [h_q/8, 8, align4(b·s_q)] fp32   (out) fp8_rope: int32 words of 4 UE8M0 exponents
                                                  as float32; bf16: [4] scratch, unused
    O_part       [cap, b, s_q, h_q, 512]   fp32   (scratch) split-KV partials
    LSE_part     [cap, b, s_q, h_q]        fp32   (scratch)

Semantics (DSV4.md): one softmax over the valid keys of BOTH branches (scores Q·Kᵀ ·
softmax_scale); a key is valid iff its list position is < the branch's length and its index is
not −1; a key indexed twice counts twice; O is scaled by 1 / (1 + exp(sink[h] − lse)); a row
with no valid key: O = 0, LSE = +inf.  The API's optional pieces are always-present tensors:
no topk_length = topk, no sink = −inf, no extra branch (a config without `_x…`) = a 1-block
extra cache, idx_extra [b, s_q, 1] = −1, extra_length 0 (a peer is called without them).

Matrix axes
    b          batch size (an int, so `bench` may sweep it)
    config     s{s_q}h{h_q}_m{topk}bs{block}[_x{extra_topk}bs{extra_block}], e.g.
               s2h128_m128bs256_x1024bs64 (FlashMLA's MODEL1 CONFIG2)
    kv_format  simple | model1 | v4.1 | nvfp4
    scenario   which inputs (input-only; every scenario poisons the unindexed cache tokens with
               0xFF bytes = NaN in every field):
                 plain      every index valid, full lengths, no sink
                 sink       finite sinks around the rows' LSE (the factor matters)
                 sink_inf   per head: −inf, +inf or finite sinks
                 invalid    ~30 % of the indices −1, sink on
                 topk_len   random lengths in [1, topk) per batch and branch (the last batch 0, the
                            second, when b > 2, the full length); past the length: stale entries
                            (real tokens of the list: honouring them is a wrong row, not a crash)
                            and garbage INT_MAX / −7 / 2^30; sink on
                 lonely     batch 0's last token has every index −1 in both branches (s_q > 1),
                            batch 1 has both lengths 0; sink_inf's sinks
                 extreme    extreme scales written into indexed tokens: e8m0 2^−20 … 2^15
                            (simple: fp32 2^−20 … 2^15), tiny/huge payloads to match
                 dup        duplicated indices within each branch (a key counted twice)
                 softmax_scale  sink's inputs with softmax_scale = ALT_SCALE = 512^−0.55 (FlashMLA's
                            tests' d^−0.55) instead of 1/sqrt(512): O and LSE both move (issue 35)
    epilogue   bf16 (the default) | fp8_rope (oracles/fp8_epilogue.py; `decode` turns its words
               into what is compared)
    splits     1 | auto | an int: sm90's persistent parts (part_scheduler.py), sm100's split-KV

The scratch capacity `cap`: the larger of the two kernels' needs — sm100: 1 for splits = 1, for
auto 1 when the row blocks fill the GPU, else one split per 64-key tile up to AUTO_SPLITS (32;
docs/STAGE_E.md), an int k: k; sm90: the most partials its parts cut a sequence into
(PartGrid.capacity).

The reference (`reference`): float64 dequantise-and-attend — each branch's indexed tokens read
from the cache bytes (kvcache.read_tokens), invalid keys masked, one logsumexp over both.
"""

from __future__ import annotations

import math
from typing import Any

from oracles import fp8_epilogue as fe
from oracles import kvcache as kc
from oracles.common import TensorSpec
from stages.common.part_scheduler import PartGrid, resolve_part_tiles
from stages.common.sparse_config import TILE, SparseConfig  # noqa: F401 (TILE: the oracle's API)
from stages.common.device import sm_count
from stages.common.scheduler import SM_COUNT

D = kc.D
INT_MAX = 2**31 - 1
SCENARIOS = ("plain", "sink", "sink_inf", "invalid", "topk_len", "lonely", "extreme", "dup", "softmax_scale")
DEFAULT_SCALE = 1.0 / math.sqrt(kc.D)  # DSV4's 1/sqrt(512): every scenario but softmax_scale
ALT_SCALE = kc.D ** -0.55  # FlashMLA's tests' d^−0.55 (0.73 × the default): the softmax_scale scenario
Q_SCALE = 2.0  # scores of std ≈ 2: rows are far from uniform, so a dropped or misplaced key shows
KV_SCALE = 1.0
AUTO_SPLITS = 32  # the most partial slots sm100's "auto" is given (the module doc's `cap`)
EPILOGUES = ("bf16", "fp8_rope")


def epilogue_of(case: dict[str, Any]) -> str:
    """The case's `epilogue` (bf16 where the case has no such axis: the suites, older records)."""
    ep = case.get("epilogue", "bf16")
    if ep not in EPILOGUES:
        raise ValueError(f"epilogue must be one of {', '.join(EPILOGUES)}, got {ep!r}")
    return ep


def split_capacity(case: dict[str, Any]) -> int:
    """The partial slots (O_part, LSE_part) a case declares: the module doc's `cap`."""
    c = SparseConfig.parse(case["config"])
    splits = case["splits"]
    head_blocks = -(-c.h_q // 64)
    if splits == "auto":
        ctas = case["b"] * c.s_q * head_blocks
        cap = 1 if ctas >= SM_COUNT else max(1, min(c.tiles(), AUTO_SPLITS))  # sm100 caps "auto" to it
    elif isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be a positive int or 'auto', got {splits!r}")
    else:
        cap = splits
    # the sm90 kernel's persistent parts may cut a sequence into more pieces
    part_tiles = resolve_part_tiles(splits, head_blocks=head_blocks, tokens=c.s_q, batches=case["b"], num_tiles=c.tiles(),
                                    sm_count=sm_count("sm_90a"))  # the SMs the kernel's parts fill (this GPU's)
    return max(cap, PartGrid(head_blocks, c.s_q, case["b"], c.tiles(), part_tiles).capacity)


def tensors(case: dict[str, Any]) -> list[TensorSpec]:
    c = SparseConfig.parse(case["config"])
    fmt, b = case["kv_format"], case["b"]
    cap = split_capacity(case)
    xtopk, xblock = (c.extra_topk, c.extra_block) if c.has_extra else (1, 1)
    fp8 = epilogue_of(case) == "fp8_rope"
    n, groups = b * c.s_q, c.h_q // fe.GROUP_HEADS
    return [
        TensorSpec("Q", (b, c.s_q, c.h_q, D), "bfloat16"),
        TensorSpec("KV", (c.num_blocks(b, False), kc.block_bytes(fmt, c.block)), "uint8"),
        TensorSpec("idx", (b, c.s_q, c.topk), "int32"),
        TensorSpec("topk_length", (b,), "int32"),
        TensorSpec("KV_extra", (c.num_blocks(b, True), kc.block_bytes(fmt, xblock)), "uint8"),
        TensorSpec("idx_extra", (b, c.s_q, xtopk), "int32"),
        TensorSpec("extra_length", (b,), "int32"),
        TensorSpec("sink", (c.h_q,), "float32"),
        TensorSpec("softmax_scale", (1,), "float32"),
        TensorSpec("cos_sin_cache", (fe.MAX_POSITION if fp8 else 1, 2 * fe.ROPE_PAIRS), "float32"),
        TensorSpec("positions", (b * c.s_q,), "int32"),
        TensorSpec("O", (b, c.s_q, c.h_q, D) if not fp8 else (8,), "bfloat16", "scratch" if fp8 else "out"),
        TensorSpec("LSE", (b, c.h_q, c.s_q), "float32", "out"),
        TensorSpec("O_fp8", (groups, n, fe.GROUP_HEADS, D // 4) if fp8 else (4,), "float32", "out" if fp8 else "scratch"),
        TensorSpec("O_scale", (groups, fe.GROUP_HEADS, fe.align4(n)) if fp8 else (4,), "float32",
                   "out" if fp8 else "scratch"),
        TensorSpec("O_part", (cap, b, c.s_q, c.h_q, D), "float32", "scratch"),
        TensorSpec("LSE_part", (cap, b, c.s_q, c.h_q), "float32", "scratch"),
    ]


# ---------------------------------------------------------------------------------------------
# Inputs


def _branch(g, b: int, s_q: int, topk: int, block: int, nb: int, scenario: str, fmt: str):
    """One branch: (cache uint8, idx int32 [b, s_q, topk], length int32 [b]), CPU.  Sequence i's
        blocks are a random permutation of blocks 0 … nb − 2 (the last a spare); each (i, t) indexes
        `topk` distinct positions (dup: some repeated); unindexed tokens are 0xFF."""
    import torch

    seq = max(2 * topk, block)
    seq = -(-seq // block) * block
    blocks_per_seq = seq // block
    table = torch.randperm(nb - 1, generator=g)[: b * blocks_per_seq].view(b, blocks_per_seq)
    pos = torch.argsort(torch.rand(b, s_q, seq, generator=g), dim=-1)[..., :topk]  # distinct positions
    if scenario == "dup" and topk > 1:
        k = max(1, topk // 4)
        src = torch.randint(0, topk, (b, s_q, k), generator=g)
        dst = torch.randint(0, topk, (b, s_q, k), generator=g)
        pos.scatter_(2, dst, torch.gather(pos, 2, src))
    idx = (torch.gather(table, 1, (pos // block).view(b, -1)).view(b, s_q, topk) * block + pos % block).to(torch.int32)
    length = torch.full((b,), topk, dtype=torch.int32)

    if scenario in ("invalid", "lonely", "topk_len", "sink", "sink_inf"):
        drop = torch.rand(b, s_q, topk, generator=g) < (0.3 if scenario == "invalid" else 0.1)
        idx[drop] = -1
    if scenario == "lonely":
        if s_q > 1:
            idx[0, -1] = -1  # the last token of batch 0 sees nothing (in both branches)
        if b > 1:
            length[1] = 0  # batch 1: both lengths 0; the other batches keep their keys
    if scenario == "topk_len":
        length = torch.randint(1, max(2, topk), (b,), generator=g, dtype=torch.int32).clamp(max=topk)
        if b > 1:
            length[-1] = 0
        if b > 2:
            length[1] = topk
        past = (torch.arange(topk)[None, None, :] >= length[:, None, None].long()).expand(b, s_q, topk)
        # past the length: stale entries (real, written tokens of the same batch's live list: a
        # kernel that honours them computes a wrong row, no crash) or garbage (INT_MAX, −7, 2^30)
        garbage = torch.tensor([INT_MAX, -7, 2**30, INT_MAX - 1], dtype=torch.int32)
        junk = garbage[torch.randint(0, len(garbage), (b, s_q, topk), generator=g)]
        for i in range(b):
            live = idx[i][~past[i] & (idx[i] != -1)]
            if live.numel():
                stale = live[torch.randint(0, live.numel(), (s_q, topk), generator=g)]
                junk[i] = torch.where(torch.rand(s_q, topk, generator=g) < 0.5, stale, junk[i])
        idx = torch.where(past, junk, idx)

    cache = torch.full((nb, kc.block_bytes(fmt, block)), 0xFF, dtype=torch.uint8)
    live = _live(idx, length)
    used = torch.unique(idx[live].long()) if bool(live.any()) else torch.zeros(0, dtype=torch.long)
    # per token, every 32-column group × 2^k, k ∈ {−2 … 1}: the scale groups differ, so a scale
    # taken from the wrong group changes the values
    # (nvfp4: every 16-column group, its scale group, so a neighbouring group's scale is wrong
    # by up to 8×, not by one group's amax against another's)
    width = kc.NVFP4_GROUP if fmt == "nvfp4" else 32
    spread = torch.pow(2.0, torch.randint(-2, 2, (used.numel(), D // width), generator=g).float()).repeat_interleave(width, dim=1)
    x = torch.randn(used.numel(), D, generator=g) * KV_SCALE * spread
    if used.numel():
        kc.write_tokens(cache, fmt, block, used, x)
    if scenario == "extreme" and used.numel():
        _write_extremes(g, cache, fmt, block, used)
    return cache, idx, length


def _live(idx, length):
    """Valid keys: list position < length[b] and index ≠ −1."""
    import torch

    topk = idx.shape[-1]
    inside = torch.arange(topk, device=idx.device)[None, None, :] < length.to(idx.device)[:, None, None].long()
    return inside & (idx != -1)


_EXTREME_EXPS = (-20, 15, -17, 12, -9, 6, -14, 9, -20, 15, -3, 1, -11, 13, -19, 4)
VALUE_CAP = 4.0  # |q · 2^e| of an extreme-scale payload stays ≤ this (or is one of 4 tiny subnormal columns)


def _write_extremes(g, cache, fmt: str, block: int, used) -> None:
    """Every 4th indexed token gets extreme scales: per group an exponent from _EXTREME_EXPS (2^−20 …
        2^15) and payloads keeping |q · 2^e| ≤ 4; where no nonzero e4m3 is that small, the group is 0
        but for 4 smallest subnormals (a wrong group's scale still moves the scores)."""
    import torch

    flat = cache.view(-1)
    tokens = used[::4]
    d0, s0 = kc.token_offsets(fmt, block, tokens)
    if fmt == "nvfp4":
        _write_nvfp4_extremes(g, flat, d0, s0)
        return
    n_groups = {"simple": 1, "model1": kc.MODEL1_TILES, "v4.1": kc.V41_SCALES}[fmt]
    group = {"simple": D, "model1": kc.MODEL1_TILE, "v4.1": kc.V41_GROUP}[fmt]
    table = kc.e4m3_decode(torch.arange(0x7F).to(torch.uint8))  # bytes 0 … 0x7E, non-negative
    for j, (dd, ss) in enumerate(zip(d0.tolist(), s0.tolist())):
        exps = [_EXTREME_EXPS[(j + k) % len(_EXTREME_EXPS)] for k in range(n_groups)]
        for k, e in enumerate(exps):
            allowed = torch.nonzero((table > 0) & (table * 2.0 ** e <= VALUE_CAP)).flatten()
            if allowed.numel():
                q = allowed[torch.randint(0, allowed.numel(), (group,), generator=g)].to(torch.uint8)
            else:
                q = torch.zeros(group, dtype=torch.uint8)
                q[torch.randperm(group, generator=g)[:4]] = torch.randint(1, 3, (4,), generator=g).to(torch.uint8)
            q |= (torch.rand(group, generator=g) < 0.5).to(torch.uint8) << 7  # sign
            flat[dd + k * group : dd + (k + 1) * group] = q
        if fmt == "simple":
            flat[ss : ss + 4] = torch.tensor([2.0 ** exps[0]], dtype=torch.float32).view(torch.uint8)
        else:
            flat[ss : ss + n_groups] = kc.e8m0_encode_exponent(torch.tensor(exps))


# nvfp4's extreme e4m3 group scales: the subnormals 2^−9 and 7·2^−9, the smallest normal 2^−6,
# 0.75, 1.875 (below 4: the sm90 kernel's one-multiply path) and 4, 64, 120, 448 (its two-multiply
# path); bytes 0x01, 0x07, 0x08, 0x34, 0x3F, 0x48, 0x68, 0x6F, 0x7E
_NVFP4_EXTREME_SCALES = (0x01, 0x7E, 0x07, 0x68, 0x08, 0x6F, 0x34, 0x48, 0x3F)


def _write_nvfp4_extremes(g, flat, d0, s0) -> None:
    """nvfp4's `extreme`: every 4th indexed token's group scales cycle through _NVFP4_EXTREME_SCALES,
        codes random with |code · scale| ≤ VALUE_CAP; where only zero fits, 4 columns of ±0.5."""
    import torch

    mags = torch.tensor(kc.E2M1_VALUES, dtype=torch.float64)
    for j, (dd, ss) in enumerate(zip(d0.tolist(), s0.tolist())):
        sc = [_NVFP4_EXTREME_SCALES[(j + k) % len(_NVFP4_EXTREME_SCALES)] for k in range(kc.NVFP4_SCALES)]
        codes = torch.zeros(kc.D_NOPE, dtype=torch.int64)
        for k, byte in enumerate(sc):
            s = float(kc.e4m3_decode(torch.tensor([byte], dtype=torch.uint8))[0])
            allowed = torch.nonzero((mags > 0) & (mags * s <= VALUE_CAP)).flatten()
            if allowed.numel():
                q = allowed[torch.randint(0, allowed.numel(), (kc.NVFP4_GROUP,), generator=g)]
            else:
                q = torch.zeros(kc.NVFP4_GROUP, dtype=torch.int64)
                q[torch.randperm(kc.NVFP4_GROUP, generator=g)[:4]] = 1
            q |= (torch.rand(kc.NVFP4_GROUP, generator=g) < 0.5).to(torch.int64) << 3  # sign
            codes[k * kc.NVFP4_GROUP : (k + 1) * kc.NVFP4_GROUP] = q
        flat[dd : dd + kc.NVFP4_NOPE] = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)
        flat[ss : ss + kc.NVFP4_SCALES] = torch.tensor(sc, dtype=torch.uint8)


def scenario_scale(scenario: str) -> float:
    """The softmax scale a scenario's inputs carry."""
    return ALT_SCALE if scenario == "softmax_scale" else DEFAULT_SCALE


def make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    import torch

    c = SparseConfig.parse(case["config"])
    fmt, b, scenario = case["kv_format"], case["b"], case["scenario"]
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, c.s_q, c.h_q, D, generator=g) * Q_SCALE).to(torch.bfloat16)
    scenario = "sink" if scenario == "softmax_scale" else scenario  # sink's inputs, another scale
    kv, idx, length = _branch(g, b, c.s_q, c.topk, c.block, c.num_blocks(b, False), scenario, fmt)
    if c.has_extra:
        kvx, idxx, lengthx = _branch(g, b, c.s_q, c.extra_topk, c.extra_block, c.num_blocks(b, True), scenario, fmt)
        if scenario == "lonely":
            if c.s_q > 1:
                idxx[0, -1] = -1
            if b > 1:
                lengthx[1] = 0
    else:
        kvx = torch.full((1, kc.block_bytes(fmt, 1)), 0xFF, dtype=torch.uint8)
        idxx = torch.full((b, c.s_q, 1), -1, dtype=torch.int32)
        lengthx = torch.zeros(b, dtype=torch.int32)
    sink = _sink(g, c.h_q, scenario, c.topk + c.extra_topk)
    # drawn last: the inputs before them are the same in either epilogue; position 0 (no
    # rotation) among them, the rest anywhere in the cache
    positions = torch.randint(0, fe.MAX_POSITION, (b * c.s_q,), generator=g, dtype=torch.int32)
    positions[0] = 0
    fp8 = epilogue_of(case) == "fp8_rope"
    out = {"Q": q, "KV": kv, "idx": idx, "topk_length": length, "KV_extra": kvx, "idx_extra": idxx,
           "extra_length": lengthx, "sink": sink,
           "softmax_scale": torch.tensor([scenario_scale(case["scenario"])], dtype=torch.float32),
           "cos_sin_cache": fe.make_cos_sin_cache() if fp8 else torch.zeros(1, 2 * fe.ROPE_PAIRS),
           "positions": positions}
    return {k: v.to(device) for k, v in out.items()}


def _sink(g, h_q: int, scenario: str, keys: int):
    """Sinks [h_q]: −inf for plain, dup, extreme; N(0, 1) + ln(keys) + 2 (about a row's LSE) for
        sink, invalid, topk_len; sink_inf and lonely cycle −inf, +inf and such a value."""
    import torch

    if scenario in ("plain", "dup", "extreme"):
        return torch.full((h_q,), -math.inf)
    finite = torch.randn(h_q, generator=g) + math.log(keys) + Q_SCALE**2 / 2
    if scenario in ("sink_inf", "lonely"):
        cyc = torch.tensor([-math.inf, math.inf, 0.0])
        kind = torch.arange(h_q) % 3
        return torch.where(kind < 2, cyc[kind], finite)
    return finite


# ---------------------------------------------------------------------------------------------
# Reference


def branch_keys(cache, fmt: str, block: int, idx, length):
    """(kv float64 [b, s_q, k, 512] with invalid keys zeroed, valid bool [b, s_q, k])."""
    import torch

    valid = _live(idx, length)
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    kv = kc.read_tokens(cache, fmt, block, safe.reshape(-1)).view(*idx.shape, D)
    kv = torch.where(valid[..., None], kv, torch.zeros_like(kv))
    return kv, valid


def softmax_scale_of(inputs: dict) -> float:
    """The fp32 softmax scale the inputs carry (their `softmax_scale` tensor's one value)."""
    return float(inputs["softmax_scale"].reshape(-1)[0])


def reference(inputs: dict, case: dict[str, Any]) -> dict:
    """float64: O [b, s_q, h_q, 512], LSE [b, h_q, s_q] (see the module doc)."""
    import torch

    c = SparseConfig.parse(case["config"])
    fmt = case["kv_format"]
    kv, valid = branch_keys(inputs["KV"], fmt, c.block, inputs["idx"], inputs["topk_length"])
    if c.has_extra:
        kvx, validx = branch_keys(inputs["KV_extra"], fmt, c.extra_block, inputs["idx_extra"], inputs["extra_length"])
        kv, valid = torch.cat([kv, kvx], dim=2), torch.cat([valid, validx], dim=2)
    q = inputs["Q"].double()
    s = torch.einsum("bthd,btkd->bthk", q, kv) * softmax_scale_of(inputs)
    s = s.masked_fill(~valid[:, :, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # [b, s_q, h_q]; −inf for a lonely row
    lonely = lse == -math.inf
    p = torch.exp(s - torch.where(lonely, torch.zeros_like(lse), lse)[..., None])  # 0 on a lonely row
    o = torch.einsum("bthk,btkd->bthd", p, kv)
    sink = inputs["sink"].double().to(o.device)[None, None, :]
    factor = 1.0 / (1.0 + torch.exp(sink - lse))  # sink = −inf → 1, +inf → 0
    o = torch.where(lonely[..., None], torch.zeros_like(o), o * factor[..., None])
    lse = torch.where(lonely, torch.full_like(lse, math.inf), lse)
    if epilogue_of(case) == "fp8_rope":  # the fused epilogue's rows: O inverse-rotated, its block exponents
        b = o.shape[0]
        o = fe.rotate(o.reshape(b * c.s_q, c.h_q, D), inputs["cos_sin_cache"], inputs["positions"]).view(o.shape)
        return {"O": o, "LSE": lse.permute(0, 2, 1).contiguous(), "O_scale": fe.exponent_reference(o)}
    return {"O": o, "LSE": lse.permute(0, 2, 1).contiguous(), "O_scale": o.new_zeros(0)}


def decode(outputs: dict, case: dict[str, Any]) -> dict:
    """What is compared (the stage's `decode`): bf16 — O and LSE as they are; fp8_rope — O
        dequantised from O_fp8 and O_scale, O_scale the exponents (fp8_epilogue.decode_words)."""
    if epilogue_of(case) != "fp8_rope":
        return {"O": outputs["O"], "LSE": outputs["LSE"], "O_scale": outputs["LSE"].new_zeros(0)}
    c = SparseConfig.parse(case["config"])
    o, e = fe.decode_words(outputs["O_fp8"], outputs["O_scale"], case["b"], c.s_q, c.h_q)
    return {"O": o, "LSE": outputs["LSE"], "O_scale": e}


def flops(case: dict[str, Any]) -> float:
    """2 · h_q · s_q · (d_qk + d_v) · (topk + extra_topk) per sequence (DSV4.md's count)."""
    c = SparseConfig.parse(case["config"])
    keys = c.topk + (c.extra_topk if c.has_extra else 0)
    return 2.0 * case["b"] * c.h_q * c.s_q * (D + D) * keys
