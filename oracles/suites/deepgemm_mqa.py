"""DeepGEMM's MQA-logits test (the flat indexer), ported (read, not copied) against stage I1.

Upstream: deepseek-ai/DeepGEMM@54e2261 and @80ceeb2 tests/test_attention.py (`test_mqa_logits`,
as an sm90 machine enumerates it: arch major 9, no FP4), deep_gemm/utils `per_custom_dims_cast_to_fp8`
(the key quantiser) and deep_gemm/testing `calc_diff` (the metric).

The case list (`upstream`):
    @54e2261  logits bf16 | fp32 × (compressed, clean) (no, yes) | (yes, no) × s 2048 | 8192 ×
              s_kv 8192 | 65536 × heads 32 | 64 × head_dim 32 | 64 | 128 × cp | not: 192 cases
    @80ceeb2  s 2048 | 4096 × s_kv 4096 … 131072 (6) × cp | not; heads 64, head_dim 128, fp32:
              24 cases (upstream checks only s_kv < 32768; the port checks every one)
The generators (`make_inputs`, seeded by the case's index; `--seed` does not change them):
    q [s, h, d]  N(0, 1) bf16, then e4m3 as is (no scale)
    kv [s_kv, d] N(0, 1) bf16; per token sf = max(amax, 1e-4) / 448, e4m3(kv · (1 / sf))
    weights [s, h] N(0, 1) fp32
    ranges  not cp: ks = 0, ke = i + s_kv − s;  cp: chunk = s/2, cp_size = s_kv / s, rank
            cp_size // 3: ks = 0, ke[i] = rank·chunk + i, ke[i + chunk] = (2·cp_size − 1 − rank)·chunk + i
The pass rule (`criterion`): the −inf positions equal the reference's; calc_diff < 1e-3 against
the logits of the unquantised bf16 q, kv (float64 here; upstream fp32) and, @54e2261, calc_diff
< 5e-6 (fp32 logits and weights; 3e-5 with bf16) against the "simulated" logits of bf16(e4m3 q)
and bf16(e4m3 kv · sf).  The stage reference (`reference`, the record's metrics) is I1's float64
logits of the exact dequantised bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from oracles.common import TensorSpec
from oracles.suites.criteria import diff_below

UPSTREAM = ("deepseek-ai/DeepGEMM@54e2261 tests/test_attention.py", "deepseek-ai/DeepGEMM@80ceeb2 tests/test_attention.py",
            "deepseek-ai/DeepGEMM@54e2261 deep_gemm/utils/math.py", "deepseek-ai/DeepGEMM@54e2261 deep_gemm/testing/numeric.py")
STAGE = "I1"

# --- what the indexer stages take today: edit here when they grow an option --------------------
HEADS = (32, 64)
HEAD_DIMS = (32, 64, 128)
LOGITS = ("fp32", "bf16")
COMPRESSED = True  # the [s, max(ke − ks)] form indexed from ks
LIMITS = (  # (name, refuses(u), reason)
    ("heads", lambda u: u.heads not in HEADS, "heads {heads}: the indexer takes " + "/".join(map(str, HEADS)) + " only"),
    ("head_dim", lambda u: u.head_dim not in HEAD_DIMS,
     "head_dim {head_dim}: the indexer takes " + "/".join(map(str, HEAD_DIMS)) + " only"),
    ("logits", lambda u: u.logits not in LOGITS, "{logits} logits: the indexer writes " + "/".join(LOGITS) + " only"),
    ("compressed", lambda u: u.compressed and not COMPRESSED,
     "compressed logits ([s, max(ke − ks)] indexed from ks): I1 writes full [s, s_kv] rows only"),
)


@dataclass(frozen=True)
class Upstream:
    commit: str
    s: int
    s_kv: int
    heads: int
    head_dim: int
    cp: bool
    logits: str = "fp32"
    compressed: bool = False
    checked: bool = True  # upstream checks the result (80ceeb2: s_kv < 32768 only)


@functools.lru_cache(maxsize=1)
def upstream() -> tuple[Upstream, ...]:
    out = []
    for logits in ("bf16", "fp32"):
        for compressed in (False, True):
            for s in (2048, 8192):
                for s_kv in (8192, 65536):
                    for heads in (32, 64):
                        for d in (32, 64, 128):
                            for cp in (True, False):
                                if cp and (s_kv % s or s % 2):
                                    continue
                                out.append(Upstream("54e2261", s, s_kv, heads, d, cp, logits, compressed))
    for s in (2048, 4096):
        for s_kv in (4096, 8192, 16384, 32768, 65536, 131072):
            for cp in (True, False):
                out.append(Upstream("80ceeb2", s, s_kv, 64, 128, cp, checked=s_kv < 32768))
    return tuple(out)


def reasons(u: Any) -> list[str]:
    return [why.format(**vars(u)) for _, refuses, why in LIMITS if refuses(u)]


def cases() -> list[dict[str, Any]]:
    return [{"s": u.s, "s_kv": u.s_kv, "ranges": "cp" if u.cp else "causal", "heads": u.heads, "head_dim": u.head_dim,
             "logits_dtype": u.logits, "compressed": u.compressed, "commit": u.commit, "id": i}
            for i, u in enumerate(upstream()) if not reasons(u)]


def _case(case: dict[str, Any]) -> Upstream:
    i, table = case["id"], upstream()
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(table):
        raise ValueError(f"id must be an upstream case index 0 … {len(table) - 1}, got {i!r}")
    u = table[i]
    if (case.get("s"), case.get("s_kv")) != (u.s, u.s_kv):
        raise ValueError(f"case {i} is s={u.s} s_kv={u.s_kv} upstream, not s={case.get('s')} s_kv={case.get('s_kv')}")
    return u


def ranges(u: Upstream) -> tuple[list[int], list[int]]:
    """Upstream's (ks, ke)."""
    if not u.cp:
        return [0] * u.s, [i + u.s_kv - u.s for i in range(u.s)]
    chunk, cp_size = u.s // 2, u.s_kv // u.s
    rank = cp_size // 3
    ke = [0] * u.s
    for i in range(chunk):
        ke[i] = rank * chunk + i
        ke[i + chunk] = (2 * cp_size - 1 - rank) * chunk + i
    return [0] * u.s, ke


def fp8_per_token(x):
    """(e4m3 values, fp32 scales) as upstream: sf = max(amax, 1e-4) / 448 per row (last dim),
    values = e4m3(x · (1 / sf))."""
    import torch

    sf = x.abs().float().amax(dim=-1, keepdim=True).clamp(1e-4) / 448.0
    return (x * (1.0 / sf)).to(torch.float8_e4m3fn), sf.squeeze(-1)


def _draw(u: Upstream, i: int, device: str):
    """(q bf16 [s, h, d], kv bf16 [s_kv, d], weights fp32 [s, h]): upstream's draws, seeded."""
    import torch

    g = torch.Generator(device=device).manual_seed(5426 * 100_000 + i)
    q = torch.randn(u.s, u.heads, u.head_dim, generator=g, device=device).to(torch.bfloat16)
    kv = torch.randn(u.s_kv, u.head_dim, generator=g, device=device).to(torch.bfloat16)
    w = torch.randn(u.s, u.heads, generator=g, device=device)
    return q, kv, w


def tensors(case: dict[str, Any]) -> list[TensorSpec]:
    """Stage I1's tensors; compressed logits [s, max(ke − ks)] of upstream's ranges."""
    import dataclasses

    from oracles import indexer

    u = _case(case)
    specs = indexer.tensors(case)
    if u.compressed:
        width = indexer.compressed_width(*ranges(u))
        specs = [dataclasses.replace(s, shape=(u.s, width)) if s.name == "logits" else s for s in specs]
    return specs


def make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    """Upstream's generators for case `case["id"]` (see the module doc); `seed` is not used."""
    import torch

    u = _case(case)
    q, kv, w = _draw(u, case["id"], device)
    kv8, sf = fp8_per_token(kv)
    ks, ke = ranges(u)
    return {"q": q.to(torch.float8_e4m3fn), "kv": kv8, "kv_scale": sf.float().contiguous(), "weights": w,
            "ks": torch.tensor(ks, dtype=torch.int32, device=device),
            "ke": torch.tensor(ke, dtype=torch.int32, device=device)}


def reference(inputs: dict, case: dict[str, Any]) -> dict:
    """I1's float64 logits of the exact dequantised bytes (oracles/indexer.py `reference`), on a
    GPU by the fused kernel (`_logits`)."""
    from oracles import indexer

    full = _logits(inputs["q"], indexer.dequantize(inputs["kv"], inputs["kv_scale"]), inputs["weights"],
                   inputs["ks"], inputs["ke"])
    if indexer.is_compressed(case):
        ks, ke = inputs["ks"].tolist(), inputs["ke"].tolist()
        full = indexer.compress(full, inputs["ks"], inputs["ke"], indexer.compressed_width(ks, ke))
    return {"logits": indexer.as_output(full, case)}


def flops(case: dict[str, Any]) -> float:
    """2 · h · d per (query, key) pair inside its range."""
    u = _case(case)
    ks, ke = ranges(u)
    pairs = sum(max(0, min(e, u.s_kv) - max(b, 0)) for b, e in zip(ks, ke))
    return 2.0 * u.heads * u.head_dim * pairs


def _logits(q, k, w, ks, ke):
    """float64 logits over [ks, ke): on a GPU the fused kernel (mqa_fused.py), on a CPU
        indexer.mqa_logits (held equal by tests/test_mqa_fused.py)."""
    import torch

    from oracles import indexer

    q, k, w = q.to(torch.float64), k.to(torch.float64), w.to(torch.float64)
    if q.is_cuda:
        from oracles.mqa_fused import mqa_logits_fused

        return mqa_logits_fused(q, k, w, ks, ke)
    j = torch.arange(k.shape[0], device=q.device)
    valid = (j[None, :] >= ks.long()[:, None]) & (j[None, :] < ke.long()[:, None])
    return indexer.mqa_logits(q, k, w, valid)


def criterion(outputs: dict, ref: dict, case: dict[str, Any]) -> dict[str, dict]:
    """Upstream's pass rule (see the module doc)."""
    import torch

    u = _case(case)
    dev = outputs["logits"].device
    q, kv, w = _draw(u, case["id"], str(dev))
    ks, ke = (torch.tensor(x, dtype=torch.int32, device=dev) for x in ranges(u))
    answer, neginf = outputs["logits"], ref["logits"]
    if u.compressed:  # upstream's post-process: row i's first ke − ks columns back at [ks, ke), −inf elsewhere
        answer, neginf = decompress(answer, ks, ke, u.s_kv), decompress(neginf.to(dev), ks, ke, u.s_kv)
    refs = {"unquantised": (_logits(q.double(), kv.double(), w, ks, ke), 1e-3)}
    if u.commit == "54e2261":
        kv8, sf = fp8_per_token(kv)
        sim_kv = (kv8.float() * sf[:, None]).to(torch.bfloat16)
        sim_q = q.to(torch.float8_e4m3fn).to(torch.bfloat16)
        refs["simulated"] = (_logits(sim_q.double(), sim_kv.double(), w, ks, ke), 3e-5 if u.logits == "bf16" else 5e-6)
    return {"logits": diff_below(answer, refs, neginf_ref=neginf)}


def decompress(logits, ks, ke, s_kv: int):
    """Compressed logits [s, W] (column c of row i: key ks[i] + c) as [s, s_kv]: row i's first
    ke[i] − ks[i] columns at keys [ks[i], ke[i]), −inf elsewhere (upstream's post-process)."""
    import torch

    s, width = logits.shape
    out = torch.full((s, s_kv), float("-inf"), dtype=torch.float64, device=logits.device)
    j = torch.arange(s_kv, device=logits.device)[None, :]
    inside = (j >= ks.long()[:, None]) & (j < ke.long()[:, None])
    col = (j - ks.long()[:, None]).clamp(0, width - 1)
    picked = logits.double().gather(1, col)
    return torch.where(inside, picked, out)
