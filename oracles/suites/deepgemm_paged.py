"""DeepGEMM's paged MQA-logits test (the decode indexer), ported (read, not copied) against stage I2.

Upstream: deepseek-ai/DeepGEMM@54e2261 and @80ceeb2 tests/test_attention.py (`test_paged_mqa_logits`
as an sm90 machine enumerates it; `kv_cache_cast_to_fp8`, `ref_paged_mqa_logits`).

The case list (`upstream`):
    @54e2261  logits bf16 | fp32 × b 256 | 4096 × next_n 1 | 2 × heads 32 | 64 × avg_kv 8192 | 65536
              (b · avg_kv ≤ 32 M), head_dim 128, block_kv 64, 2-D context lengths: 24 cases
    @80ceeb2  (b, next_n) (64, 1) | (64, 2) | (128, 1) × avg_kv 8192 | 32768; heads 64, head_dim
              128, 1-D context lengths, max_model_len 111000, 333000 cache blocks: 6 cases
The generators (`make_inputs`, seeded by the case's index; `--seed` does not change them):
    q [b, next_n, h, d]   N(0, 1) bf16 → e4m3 (no scale)
    weights [b·next_n, h] N(0, 1) fp32
    context_lens [b]      U[0.7·avg, 1.3·avg) (drawn from the case index, so the shapes are a pure
                          function of the case)
    block_table           54e2261: ⌈ctx/64⌉ blocks a sequence from a permutation of the blocks in
                          use, zeros after; 80ceeb2: from a shuffled pool of 333000 blocks, the
                          table narrowed to the logits' 1735 blocks (111040 columns, 40 −inf)
    kv_cache              N(0, 1) bf16 per token, sf = max(amax, 1e-4) / 448, e4m3(kv · (1 / sf)),
                          fused as [blocks, 64, 1, 132]: 64·128 value bytes, then 64 fp32 scales
    2-D context lengths (@54e2261, `token_lens`): [b, next_n], the last token's the sequence's
                          length, the others int((len + 1) · U[0, 1)) (seeded by the case index);
                          token t sees the keys < its own; passed to I2 as they are (context_2d).
The pass rule (`criterion`): @80ceeb2 the −inf positions equal the reference's (upstream's clean
logits); @54e2261 (clean_logits off) they are not compared; then, −inf → 0 where the
reference is −inf, calc_diff < 1e-3 against the logits of the unquantised bf16 q and cache
(float64 here) and, @54e2261, < 5e-6 against the simulated ones (bf16(e4m3 q), bf16(e4m3 · sf)).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any

from oracles.common import TensorSpec
from oracles.suites.criteria import diff_below
from oracles.suites.deepgemm_mqa import HEAD_DIMS, HEADS, LOGITS, fp8_per_token

UPSTREAM = ("deepseek-ai/DeepGEMM@54e2261 tests/test_attention.py", "deepseek-ai/DeepGEMM@80ceeb2 tests/test_attention.py")
STAGE = "I2"
BLOCK_KV = 64
POOL_80CEEB2 = 333_000  # max_model_len · 3 cache blocks
MAX_MODEL_LEN_80CEEB2 = 111_000

# --- what stage I2 takes today: edit here when it grows an option -------------------------------
CONTEXT_2D = True  # per-token context lengths [b, next_n]
LIMITS = (  # (name, refuses(u), reason)
    ("heads", lambda u: u.heads not in HEADS, "heads {heads}: the indexer takes " + "/".join(map(str, HEADS)) + " only"),
    ("head_dim", lambda u: u.head_dim not in HEAD_DIMS,
     "head_dim {head_dim}: the indexer takes " + "/".join(map(str, HEAD_DIMS)) + " only"),
    ("logits", lambda u: u.logits not in LOGITS, "{logits} logits: the indexer writes " + "/".join(LOGITS) + " only"),
    ("context_2d", lambda u: u.context_2d and u.next_n > 1 and not CONTEXT_2D,
     "per-token context lengths [b, next_n] (token t sees keys < ctx[b, t]): I2 takes [b] with the causal "
     "limit ctx − next_n + t"),
)


@dataclass(frozen=True)
class Upstream:
    commit: str
    b: int
    next_n: int
    heads: int
    head_dim: int
    avg_kv: int
    logits: str = "fp32"
    context_2d: bool = False


@functools.lru_cache(maxsize=1)
def upstream() -> tuple[Upstream, ...]:
    out = []
    for logits in ("bf16", "fp32"):
        for b in (256, 4096):
            for next_n in (1, 2):
                for heads in (32, 64):
                    for avg in (8192, 65536):
                        if b * avg > 32 * 1024 * 1024:
                            continue
                        out.append(Upstream("54e2261", b, next_n, heads, 128, avg, logits, context_2d=True))
    for b, next_n in ((64, 1), (64, 2), (128, 1)):
        for avg in (8192, 32768):
            out.append(Upstream("80ceeb2", b, next_n, 64, 128, avg))
    return tuple(out)


def reasons(u: Any) -> list[str]:
    return [why.format(**vars(u)) for _, refuses, why in LIMITS if refuses(u)]


def cases() -> list[dict[str, Any]]:
    return [{"b": u.b, "next_n": u.next_n, "block_kv": BLOCK_KV, "heads": u.heads, "head_dim": u.head_dim,
             "logits_dtype": u.logits, "context_2d": u.context_2d, "avg_kv": u.avg_kv, "commit": u.commit, "id": i}
            for i, u in enumerate(upstream()) if not reasons(u)]


def _case(case: dict[str, Any]) -> Upstream:
    i, table = case["id"], upstream()
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(table):
        raise ValueError(f"id must be an upstream case index 0 … {len(table) - 1}, got {i!r}")
    u = table[i]
    if (case.get("b"), case.get("next_n")) != (u.b, u.next_n):
        raise ValueError(f"case {i} is b={u.b} next_n={u.next_n} upstream, not b={case.get('b')} next_n={case.get('next_n')}")
    return u


def context_lens(u: Upstream, i: int) -> list[int]:
    rng = random.Random(f"deepgemm-paged|{i}")
    return [rng.randrange(int(0.7 * u.avg_kv), int(1.3 * u.avg_kv)) for _ in range(u.b)]


def token_lens(u: Upstream, i: int) -> list[list[int]]:
    """[b][next_n] per-token context lengths of a 2-D case: the last token's the sequence's
    (context_lens), each other int((len + 1) · U[0, 1)) as upstream draws them (seeded here)."""
    rng = random.Random(f"deepgemm-paged-2d|{i}")
    return [[int((n + 1) * rng.random()) for _ in range(u.next_n - 1)] + [n] for n in context_lens(u, i)]


def limits(u: Upstream, i: int) -> list[list[int]]:
    """[b][next_n]: token t of sequence i sees the keys < limit (2-D: its own length; 1-D: the
    causal len − next_n + t + 1)."""
    if u.context_2d:
        return token_lens(u, i)
    return [[n - u.next_n + t + 1 for t in range(u.next_n)] for n in context_lens(u, i)]


def geometry(u: Upstream, i: int) -> dict[str, int]:
    """{'num_blocks', 'width' (table columns), 'max_len' (logits columns)}."""
    blocks = [math.ceil(n / BLOCK_KV) for n in context_lens(u, i)]
    if u.commit == "80ceeb2":
        width = math.ceil(MAX_MODEL_LEN_80CEEB2 / BLOCK_KV)
        return {"num_blocks": POOL_80CEEB2, "width": width, "max_len": width * BLOCK_KV}
    return {"num_blocks": sum(blocks), "width": max(blocks), "max_len": max(blocks) * BLOCK_KV}


def tensors(case: dict[str, Any]) -> list[TensorSpec]:
    u = _case(case)
    geo = geometry(u, case["id"])
    return [
        TensorSpec("q", (u.b, u.next_n, u.heads, u.head_dim), "float8_e4m3fn"),
        TensorSpec("kv_cache", (geo["num_blocks"], BLOCK_KV, 1, u.head_dim + 4), "uint8"),
        TensorSpec("context_lens", (u.b, u.next_n) if u.context_2d else (u.b,), "int32"),
        TensorSpec("block_table", (u.b, geo["width"]), "int32"),
        TensorSpec("weights", (u.b * u.next_n, u.heads), "float32"),
        TensorSpec("logits", (u.b * u.next_n, geo["max_len"]), "bfloat16" if u.logits == "bf16" else "float32", "out"),
    ]


def _draw(u: Upstream, i: int, device: str):
    """(q bf16, weights fp32, block_table int32, kv bf16 [num_blocks, 64, d]): upstream's draws."""
    import torch

    geo = geometry(u, i)
    g = torch.Generator(device=device).manual_seed(5426 * 100_000 + 50_000 + i)
    q = torch.randn(u.b, u.next_n, u.heads, u.head_dim, generator=g, device=device).to(torch.bfloat16)
    w = torch.randn(u.b * u.next_n, u.heads, generator=g, device=device)
    kv = torch.empty(geo["num_blocks"], BLOCK_KV, u.head_dim, dtype=torch.bfloat16, device=device)
    for c0 in range(0, geo["num_blocks"], 4096):
        c1 = min(c0 + 4096, geo["num_blocks"])
        kv[c0:c1] = torch.randn(c1 - c0, BLOCK_KV, u.head_dim, generator=g, device=device).to(torch.bfloat16)
    cpu = torch.Generator().manual_seed(i)
    pool = torch.randperm(geo["num_blocks"], generator=cpu)
    table = torch.zeros(u.b, geo["width"], dtype=torch.int32)
    at = 0
    for row, n in enumerate(context_lens(u, i)):
        k = math.ceil(n / BLOCK_KV)
        table[row, :k] = pool[at:at + k].to(torch.int32)
        at += k
    return q, w, table.to(device), kv


def make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    """Upstream's generators for case `case["id"]` (see the module doc); `seed` is not used."""
    import torch

    u = _case(case)
    q, w, table, kv = _draw(u, case["id"], device)
    nb = kv.shape[0]
    cache = torch.empty(nb, BLOCK_KV * (u.head_dim + 4), dtype=torch.uint8, device=device)
    for c0 in range(0, nb, 4096):
        v8, sf = fp8_per_token(kv[c0:c0 + 4096])
        n = v8.shape[0]
        cache[c0:c0 + n, :BLOCK_KV * u.head_dim] = v8.view(torch.uint8).reshape(n, -1)
        cache[c0:c0 + n, BLOCK_KV * u.head_dim:] = sf.float().contiguous().view(torch.uint8).reshape(n, -1)
    return {"q": q.to(torch.float8_e4m3fn), "kv_cache": cache.view(nb, BLOCK_KV, 1, u.head_dim + 4),
            "context_lens": torch.tensor(token_lens(u, case["id"]) if u.context_2d else context_lens(u, case["id"]),
                                         dtype=torch.int32, device=device),
            "block_table": table, "weights": w}


def reference(inputs: dict, case: dict[str, Any]) -> dict:
    """float64 logits of the exact dequantised bytes (stage I2's reference)."""
    from oracles import indexer

    return indexer.paged_reference(inputs, case)


def flops(case: dict[str, Any]) -> float:
    u = _case(case)
    return 2.0 * u.heads * u.head_dim * sum(sum(row) for row in limits(u, case["id"]))


def _paged_logits(q, kv, w, table, lens, max_len: int):
    """float64 logits [b·next_n, max_len] of keys `kv` [blocks, 64, d] (any float); `lens` the
    per-token limits [b, next_n] (token t of sequence i sees the keys < lens[i, t])."""
    import torch

    from oracles import indexer

    b, next_n = q.shape[0], q.shape[1]
    out = torch.full((b * next_n, max_len), float("-inf"), dtype=torch.float64, device=q.device)
    for i, lim in enumerate(lens.tolist()):
        n = max(lim)
        k = kv[table[i, :math.ceil(n / BLOCK_KV)].long()].reshape(-1, kv.shape[-1])[:n]
        valid = torch.arange(n, device=q.device)[None, :] < torch.tensor(lim, device=q.device)[:, None]
        rows = slice(i * next_n, (i + 1) * next_n)
        out[rows, :n] = indexer.mqa_logits(q[i].double(), k.double(), w[rows], valid)
    return out


def criterion(outputs: dict, ref: dict, case: dict[str, Any]) -> dict[str, dict]:
    """Upstream's pass rule (see the module doc)."""
    import torch

    u = _case(case)
    dev = str(outputs["logits"].device)
    q, w, table, kv = _draw(u, case["id"], dev)
    lens = torch.tensor(limits(u, case["id"]), device=dev)
    max_len = outputs["logits"].shape[1]
    refs = {"unquantised": (_paged_logits(q, kv, w, table, lens, max_len), 1e-3)}
    if u.commit == "54e2261":
        v8, sf = fp8_per_token(kv)
        sim = (v8.float() * sf[..., None]).to(torch.bfloat16)
        refs["simulated"] = (_paged_logits(q.to(torch.float8_e4m3fn).to(torch.bfloat16), sim, w, table, lens, max_len),
                             3e-5 if u.logits == "bf16" else 5e-6)
    # the mask: where upstream compares it (clean logits, @80ceeb2), the answer's −inf must be
    # the reference's; @54e2261 only the reference's −inf positions are set to 0 in both
    if u.commit == "80ceeb2":
        return {"logits": diff_below(outputs["logits"], refs, neginf_ref=ref["logits"])}
    mask = ref["logits"].to(dev) == float("-inf")
    return {"logits": diff_below(outputs["logits"].masked_fill(mask, 0.0), refs)}
