"""FlashMLA's sparse-decoding test, ported (read, not copied) against stage E.

Upstream: deepseek-ai/FlashMLA@9241ae3 tests/test_flash_mla_sparse_decoding.py (`gen_testcase`),
tests/lib.py (`generate_testcase_for_decode`), tests/quant.py (MODEL1: oracles/kvcache.py's
writer), tests/ref.py (`ref_sparse_attn_decode`), tests/kernelkit/compare.py (the pass rule).

The case list (`upstream`, upstream's order): correctness cases (d_qk 576 and 512; with and
without the extra branch, topk lengths, extra topk lengths; h_q 64/128; eight (s_k, topk, block)
triples per branch; b 4/74/321; s_q 1/3; b 74 also not varlen), corner cases (all indices
invalid / zero-length sequences / sink on or off; two triples), and the performance cases
(V3.2 and MODEL1 CONFIG1–4 at their batch sizes, topk 16384 peak cases) — every one checked.

The generators (`make_inputs`, seeded by the case's index; `--seed` does not change them):
    q       N(0, 1) in bf16, clamped to [−1, 1]                          [b, s_q, h_q, 512]
    sink    N(0, 1) per head; a second N(0, 1) draw > 0.5 makes it +inf, < −0.5 −inf (sink on;
            off: −inf everywhere, E's "no sink")
    per branch (main, extra):
      seqlen   s_k, or varlen: max(N(s_k, s_k/2), s_q), clamped here at 2·s_k (the cache is
               sized for it); zero-length cases: N(0, 1) > 0 → 0
      blocks   a random permutation of b·P physical blocks, P = ⌈2·s_k / (4·block)⌉·4 per sequence
      indices  per (sequence, token): topk distinct positions in [0, seqlen) in random order, −1
               after them when seqlen < topk; all −1 in the all-invalid cases; then block_table
               → block · block + offset (E's index form)
      length   U{0 … topk} per sequence where upstream passes topk lengths, else topk (none)
      values   N(0, 1) bf16 / 10 clamped to [−1, 1] for every token a valid entry reads,
               quantised to MODEL1 (oracles/kvcache.py: e8m0 tile scales, bf16 rope); every
               other token is NaN (upstream: NaN before quantising; here 0xFF bytes)
    softmax_scale  upstream's d_qk^−0.55 (512^−0.55), stage E's `softmax_scale` input; Q unscaled.
The reference: sparse_decode.py's float64 `reference` on the same bytes and scale (upstream: fp32
from the dequantised bf16 cache; the same masking, sink and lonely rows).
The pass rule (`criterion`, upstream's tolerances): O (bf16, the reference rounded to bf16 as
upstream compares) allclose abs 1e-3, rel 2.01/128, cos_diff 5e-6; LSE allclose abs 1e-6,
rel 8.01/65536, cos_diff 1e-7 (kernelkit's default); +inf/−inf/NaN positions exactly.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Any

from oracles import kvcache as kc
from oracles.common import TensorSpec
from oracles.suites.criteria import allclose

UPSTREAM = ("deepseek-ai/FlashMLA@9241ae3 tests/test_flash_mla_sparse_decoding.py",
            "deepseek-ai/FlashMLA@9241ae3 tests/lib.py", "deepseek-ai/FlashMLA@9241ae3 tests/ref.py",
            "deepseek-ai/FlashMLA@9241ae3 tests/quant.py", "deepseek-ai/FlashMLA@9241ae3 tests/kernelkit/compare.py")
STAGE = "E"
KV_FORMAT = "model1"  # FlashMLA's MODEL1_FP8Sparse: the d_qk 512 cases' cache
SPLITS = "auto"
D = kc.D

# --- what stage E takes today: edit here when the kernel grows an option -----------------------
MAX_TOPK = 32768  # per branch: E streams a long segment's index entries through shared memory (docs/STAGE_E.md)
LIMITS = (  # (name, refuses(u), reason)
    ("d_qk", lambda u: u.d_qk != 512,
     "DeepSeek-V3.2 layout (d_qk 576: 512 e4m3 + 4 fp32 scales + 64 bf16 rope, 656 B a token): out of DSV4's scope"),
    ("topk", lambda u: max(u.topk, u.extra_topk or 0) > MAX_TOPK,
     f"topk > {MAX_TOPK}: stage E takes at most {MAX_TOPK} entries a list"),
)
SOFTMAX_EXP = -0.55  # upstream: sm_scale = d_qk ** -0.55


@dataclass(frozen=True)
class Upstream:
    """One upstream case (RawTestParamForDecode's fields that matter; h_kv 1, d_v 512)."""

    b: int
    h_q: int
    s_q: int
    s_k: int
    varlen: bool
    topk: int
    all_invalid: bool = False
    zero_seqlen: bool = False
    topk_len: bool = False
    sink: bool = True
    extra_s_k: int | None = None
    extra_topk: int | None = None
    block: int = 64
    extra_block: int | None = None
    extra_topk_len: bool = False
    d_qk: int = 576
    group: str = "correctness"

    @property
    def config(self) -> str:
        """Stage E's config word."""
        word = f"s{self.s_q}h{self.h_q}_m{self.topk}bs{self.block}"
        return word + (f"_x{self.extra_topk}bs{self.extra_block}" if self.extra_topk else "")

    @property
    def softmax_scale(self) -> float:
        return self.d_qk ** SOFTMAX_EXP


TRIPLES = ((512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 2), (1024, 576, 61),
           (2046, 2048, 2), (2046, 2048, 64), (2046, 2048, 576))  # (s_k, topk, block)
CORNER_TRIPLES = ((512, 64, 61), (650, 576, 53))
BATCHES = (4, 74, 321)
PRODUCTION = (  # (h_q, topk, extra_topk, block, extra_block, extra_topk_len, d_qk), batches
    ((128, 2048, None, 64, None, False, 576), (2, 64, 74, 128)),  # V3.2
    ((64, 128, 512, 256, 64, False, 512), (2, 64, 74, 128, 148, 256)),  # MODEL1 CONFIG1
    ((128, 128, 1024, 256, 64, False, 512), (2, 64, 74, 128, 148, 256)),  # CONFIG2
    ((64, 128, 1024, 256, 2, True, 512), (2, 64, 74, 128, 148, 256)),  # CONFIG3
    ((128, 128, 1024, 256, 2, True, 512), (2, 64, 74, 128, 148, 256)),  # CONFIG4
)


@functools.lru_cache(maxsize=1)
def upstream() -> tuple[Upstream, ...]:
    """Every case of upstream's gen_testcase(), in its order."""
    out: list[Upstream] = []
    corner: list[Upstream] = []
    for d_qk in (576, 512):
        for extra in ((False, True) if d_qk == 512 else (False,)):
            for xlen in ((False, True) if extra else (False,)):
                for tlen in ((False, True) if d_qk == 512 else (False,)):
                    for h_q in (64, 128):
                        def varlens(b: int) -> tuple[bool, ...]:
                            return (True, False) if (b == 74 and not tlen and not xlen) else (True,)

                        for s_k, topk, block in TRIPLES:
                            for xs in (TRIPLES if extra else (None,)):
                                for b in BATCHES:
                                    for s_q in (1, 3):
                                        for vl in varlens(b):
                                            out.append(Upstream(b, h_q, s_q, s_k, vl, topk, topk_len=tlen,
                                                                extra_s_k=xs and xs[0], extra_topk=xs and xs[1],
                                                                block=block, extra_block=xs and xs[2],
                                                                extra_topk_len=xlen, d_qk=d_qk))
                        for s_k, topk, block in CORNER_TRIPLES:
                            for xs in (CORNER_TRIPLES if extra else (None,)):
                                for b in BATCHES:
                                    for vl in varlens(b):
                                        for inv in (True, False):
                                            for zero in (True, False):
                                                for sink in (True, False):
                                                    if inv or zero or sink:
                                                        corner.append(Upstream(
                                                            b, h_q, 3, s_k, vl, topk, all_invalid=inv,
                                                            zero_seqlen=zero, topk_len=tlen, sink=sink,
                                                            extra_s_k=xs and xs[0], extra_topk=xs and xs[1],
                                                            block=block, extra_block=xs and xs[2],
                                                            extra_topk_len=xlen, d_qk=d_qk, group="corner"))
    perf: list[Upstream] = []
    for (h_q, topk, xtopk, block, xblock, xlen, d_qk), batches in PRODUCTION:
        s_k = 32768 if d_qk == 576 else 16384
        for b in batches:
            perf.append(Upstream(b, h_q, 2, s_k, True, topk, extra_s_k=s_k if xtopk else None, extra_topk=xtopk,
                                 block=block, extra_block=xblock, extra_topk_len=xlen, d_qk=d_qk, group="performance"))
    for h_q in (64, 128):
        for d_qk in (512, 576):
            perf.append(Upstream(148, h_q, 2, 32768, True, 16384, d_qk=d_qk, group="performance"))
    return tuple(out + corner + perf)


def reasons(u: Upstream) -> list[str]:
    """Why stage E cannot run upstream case `u` today (LIMITS); [] when it can."""
    return [why for _, refuses, why in LIMITS if refuses(u)]


def cases() -> list[dict[str, Any]]:
    """The supported upstream cases as stage E cases (the suite stage's case list)."""
    return [{"b": u.b, "config": u.config, "kv_format": KV_FORMAT, "splits": SPLITS, "group": u.group, "id": i}
            for i, u in enumerate(upstream()) if not reasons(u)]


def _case(case: dict[str, Any]) -> Upstream:
    i = case["id"]
    table = upstream()
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(table):
        raise ValueError(f"id must be an upstream case index 0 … {len(table) - 1}, got {i!r}")
    u = table[i]
    if (case.get("b"), case.get("config")) != (u.b, u.config):
        raise ValueError(f"case {i} is b={u.b} config={u.config} upstream, not b={case.get('b')} "
                         f"config={case.get('config')}")
    return u


def seq_capacity(s_k: int, block: int) -> int:
    """Tokens per sequence in a branch's cache: 2·s_k, padded to 4 blocks as upstream pads."""
    unit = 4 * block
    return max(1, -(-2 * s_k // unit)) * unit


# ---------------------------------------------------------------------------------------------
# The contract


def tensors(case: dict[str, Any]) -> list[TensorSpec]:
    """Stage E's tensors (oracles/sparse_decode.py), the caches sized as upstream's pools."""
    from oracles import sparse_decode as sd

    u = _case(case)
    specs = sd.tensors(case)
    fmt = case["kv_format"]
    kv = (u.b * seq_capacity(u.s_k, u.block) // u.block, kc.block_bytes(fmt, u.block))
    out = []
    for s in specs:
        if s.name == "KV":
            s = TensorSpec("KV", kv, "uint8")
        elif s.name == "KV_extra" and u.extra_topk:
            assert u.extra_s_k is not None and u.extra_block is not None
            s = TensorSpec("KV_extra", (u.b * seq_capacity(u.extra_s_k, u.extra_block) // u.extra_block,
                                        kc.block_bytes(fmt, u.extra_block)), "uint8")
        out.append(s)
    return out


def _seqlens(rng: random.Random, g, u: Upstream, s_k: int) -> list[int]:
    import torch

    if u.varlen:
        lens = [int(min(2 * s_k, max(rng.normalvariate(s_k, s_k / 2), u.s_q))) for _ in range(u.b)]
    else:
        lens = [s_k] * u.b
    if u.zero_seqlen:
        zero = torch.randn(u.b, generator=g) > 0
        lens = [0 if z else n for n, z in zip(lens, zero.tolist())]
    return lens


def _branch(rng: random.Random, g, u: Upstream, s_k: int, topk: int, block: int, with_len: bool):
    """(idx int32 [b, s_q, topk] in E's form, length int32 [b], cache tokens, valid mask)."""
    import torch

    b, s_q = u.b, u.s_q
    lens = _seqlens(rng, g, u, s_k)
    per_seq = seq_capacity(s_k, block) // block
    table = torch.randperm(b * per_seq, generator=g).view(b, per_seq)
    if u.all_invalid:
        pos = torch.full((b, s_q, topk), -1, dtype=torch.long)
    else:
        span = max(max(lens), topk)
        seqlen = torch.tensor(lens).repeat_interleave(s_q).view(b * s_q, 1)
        r = torch.rand(b * s_q, span, generator=g)
        r[torch.arange(span)[None, :] >= seqlen] = -math.inf
        pos = r.topk(topk, dim=-1, sorted=True).indices
        pos[pos >= seqlen] = -1
        pos = pos.view(b, s_q, topk)
    safe = pos.clamp(min=0)
    idx = torch.gather(table, 1, (safe // block).view(b, -1)).view(b, s_q, topk) * block + safe % block
    idx = torch.where(pos < 0, torch.full_like(idx, -1), idx).to(torch.int32)
    length = (torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32) if with_len
              else torch.full((b,), topk, dtype=torch.int32))
    return idx, length, b * per_seq


def _fill(g_dev, cache, block: int, idx, length, device: str) -> None:
    """Values for every token a valid entry reads (N(0,1) bf16 / 10, clamped), quantised to
    MODEL1; the rest of the cache stays 0xFF (NaN)."""
    import torch

    topk = idx.shape[-1]
    live = (torch.arange(topk)[None, None, :] < length[:, None, None].long()) & (idx != -1)
    used = torch.unique(idx[live].long())
    chunk = 1 << 15
    for c0 in range(0, used.numel(), chunk):
        tok = used[c0:c0 + chunk]
        x = torch.randn(tok.numel(), D, generator=g_dev, device=device).to(torch.bfloat16)
        x = (x / 10).clamp_(-1.0, 1.0)
        kc.write_tokens(cache, KV_FORMAT, block, tok.to(device), x)


def make_inputs(case: dict[str, Any], seed: int, device: str = "cpu") -> dict:
    """Upstream's generators for case `case["id"]` (see the module doc); `seed` is not used."""
    import torch

    u = _case(case)
    base = 9241 * 100_000 + case["id"]
    rng = random.Random(base)
    g = torch.Generator().manual_seed(base)
    g_dev = torch.Generator(device=device).manual_seed(base)
    q = torch.randn(u.b, u.s_q, u.h_q, D, generator=g).to(torch.bfloat16).clamp_(-1.0, 1.0)
    if u.sink:
        sink = torch.randn(u.h_q, generator=g)
        kind = torch.randn(u.h_q, generator=g)
        sink[kind > 0.5] = math.inf
        sink[kind < -0.5] = -math.inf
    else:
        sink = torch.full((u.h_q,), -math.inf)
    specs = {s.name: s for s in tensors(case)}
    idx, length, _ = _branch(rng, g, u, u.s_k, u.topk, u.block, u.topk_len)
    kv = torch.full(specs["KV"].shape, 0xFF, dtype=torch.uint8, device=device)
    _fill(g_dev, kv, u.block, idx, length, device)
    if u.extra_topk:
        assert u.extra_s_k is not None and u.extra_block is not None
        idxx, lengthx, _ = _branch(rng, g, u, u.extra_s_k, u.extra_topk, u.extra_block, u.extra_topk_len)
        kvx = torch.full(specs["KV_extra"].shape, 0xFF, dtype=torch.uint8, device=device)
        _fill(g_dev, kvx, u.extra_block, idxx, lengthx, device)
    else:
        kvx = torch.full(specs["KV_extra"].shape, 0xFF, dtype=torch.uint8, device=device)
        idxx = torch.full((u.b, u.s_q, 1), -1, dtype=torch.int32)
        lengthx = torch.zeros(u.b, dtype=torch.int32)
    out = {"Q": q, "KV": kv, "idx": idx, "topk_length": length, "KV_extra": kvx, "idx_extra": idxx,
           "extra_length": lengthx, "sink": sink,
           "softmax_scale": torch.tensor([u.softmax_scale], dtype=torch.float32),
           # stage E's fused FP8 epilogue's inputs (epilogue bf16 here: unread)
           "cos_sin_cache": torch.zeros(specs["cos_sin_cache"].shape), "positions": torch.zeros(specs["positions"].shape, dtype=torch.int32)}
    return {k: v.to(device).contiguous() for k, v in out.items()}


REFERENCE_KV_BYTES = 1 << 31  # the float64 keys one batch chunk of the reference gathers
BATCH_INPUTS = ("Q", "idx", "topk_length", "idx_extra", "extra_length")  # [b, …]; the caches, sink, scale are shared


def reference(inputs: dict, case: dict[str, Any]) -> dict:
    """float64 O and LSE: stage E's reference on the same bytes and scale, in batch chunks under
        REFERENCE_KV_BYTES of gathered keys (the b 148 × topk 16384 cases would need 20 GB)."""
    import torch

    from oracles import sparse_decode as sd

    c = sd.SparseConfig.parse(case["config"])
    b, s_q = inputs["Q"].shape[:2]
    keys = c.topk + (c.extra_topk if c.has_extra else 0)
    chunk = max(1, REFERENCE_KV_BYTES // (s_q * keys * D * 8))
    parts = [sd.reference({k: v[b0:b0 + chunk] if k in BATCH_INPUTS else v for k, v in inputs.items()}, case)
             for b0 in range(0, b, chunk)]
    return {name: torch.cat([p[name] for p in parts]) for name in ("O", "LSE")}


def flops(case: dict[str, Any]) -> float:
    from oracles import sparse_decode as sd

    return sd.flops(case)


def criterion(outputs: dict, ref: dict, case: dict[str, Any]) -> dict[str, dict]:
    """Upstream's pass rule per output (see the module doc)."""
    import torch

    return {
        "O": allclose(outputs["O"], ref["O"].to(torch.bfloat16), abs_tol=1e-3, rel_tol=2.01 / 128, cos_diff_tol=5e-6),
        "LSE": allclose(outputs["LSE"], ref["LSE"].to(torch.float32), abs_tol=1e-6, rel_tol=8.01 / 65536,
                        cos_diff_tol=1e-7),
    }
