"""Per-output metrics (cosine, relative L2, max abs error, non-finite and unwritten counts),
poisoning of outputs before a launch, and the tolerance check.

Poison is a NaN with a payload no arithmetic produces (CUDA's canonical NaN is 0x7fffffff),
so an element still holding it was never written: that is counted apart from NaNs the
kernel computed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from harness.spec.spec import Tolerance

if TYPE_CHECKING:  # torch stays out of the import path of the gate and the dashboard
    import torch

POISON_BITS = {  # dtype name -> bit pattern of the poison value
    "float32": 0x7FA5A5A5,
    "bfloat16": 0x7FA5,
    "float16": 0x7E5A,
}


@dataclass
class Metrics:
    cosine: float | None
    rel_l2: float | None
    max_abs: float | None
    nonfinite: int
    unwritten: int

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def _int_view(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _poison_value(dtype: "torch.dtype") -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in POISON_BITS:
        raise TypeError(f"no poison value for outputs of dtype {name}")
    bits = POISON_BITS[name]
    return bits - (1 << 32) if bits >= 1 << 31 and name == "float32" else bits


def poison_(t: "torch.Tensor") -> "torch.Tensor":
    """Fill an output with the poison NaN, in place."""
    _int_view(t).fill_(_poison_value(t.dtype))
    return t


def unwritten_mask(t: "torch.Tensor") -> "torch.Tensor":
    return _int_view(t) == _poison_value(t.dtype)


def compare(out: "torch.Tensor", ref: "torch.Tensor") -> Metrics:
    """Metrics of `out` against the oracle's `ref` (same shape) in float64.  Elements where the oracle
        is not finite (LSE = +inf of a keyless query) must match exactly and are left out of
        cosine / L2 / max-abs."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)} != oracle shape {tuple(ref.shape)}")
    unwritten = unwritten_mask(out)
    o = out.detach().to(torch.float64)
    r = ref.detach().to(o.device, torch.float64)
    ref_finite = torch.isfinite(r)
    bad = (~torch.isfinite(o) & ref_finite & ~unwritten) | (~ref_finite & ~unwritten & (o != r) & ~(o.isnan() & r.isnan()))
    o_f = torch.where(ref_finite, o, torch.zeros_like(o))
    r_f = torch.where(ref_finite, r, torch.zeros_like(r))
    n_unwritten = int(unwritten.sum())
    n_bad = int(bad.sum())
    if n_unwritten or n_bad:
        # A NaN anywhere makes the norms meaningless; report what we can.
        finite = torch.isfinite(o_f)
        diff = (o_f - r_f)[finite]
        max_abs = float(diff.abs().max()) if diff.numel() else None
        return Metrics(cosine=None, rel_l2=None, max_abs=max_abs, nonfinite=n_bad, unwritten=n_unwritten)
    diff = o_f - r_f
    ref_norm = float(torch.linalg.vector_norm(r_f))
    out_norm = float(torch.linalg.vector_norm(o_f))
    if ref_norm == 0.0 and out_norm == 0.0:
        cosine, rel = 1.0, 0.0
    else:
        cosine = float((o_f * r_f).sum()) / (ref_norm * out_norm) if ref_norm and out_norm else 0.0
        rel = float(torch.linalg.vector_norm(diff)) / ref_norm if ref_norm else math.inf
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    return Metrics(cosine=cosine, rel_l2=rel, max_abs=max_abs, nonfinite=0, unwritten=0)


def violations(m: dict, tol: Tolerance) -> list[str]:
    """Why an output's metrics miss its tolerance (empty: pass).  Every bound is checked as `value
        meets bound`, so a missing or NaN value or bound fails."""
    why = []
    if m.get("unwritten"):
        why.append(f"{m['unwritten']} unwritten")
    if m.get("nonfinite"):
        why.append(f"{m['nonfinite']} NaN/Inf")
    cos, rel, mx = m.get("cosine"), m.get("rel_l2"), m.get("max_abs")
    if tol.cosine_min is not None and not (_num(cos) and cos >= tol.cosine_min):
        why.append(f"cosine {_f(cos)} < {tol.cosine_min:g}")
    if tol.rel_l2_max is not None and not (_num(rel) and rel <= tol.rel_l2_max):
        why.append(f"rel_l2 {_f(rel)} > {tol.rel_l2_max:g}")
    if tol.max_abs_max is not None and not (_num(mx) and mx <= tol.max_abs_max):
        why.append(f"max_abs {_f(mx)} > {tol.max_abs_max:g}")
    if tol.suite and m.get("suite_ok") != 1:  # a suite stage: the upstream rule must have said ok
        why.append("fails the suite's pass rule" if m.get("suite_ok") == 0 else "the suite's pass rule gave no verdict")
    return why


def judge(tolerances: dict[str, Tolerance], metrics: dict[str, dict]) -> tuple[str, str | None]:
    """("pass", None) when every declared output meets its tolerance, else ("fail", why).  A declared
        output the case lacks fails; a stage with no tolerance proves nothing and fails; tolerances
        still holding `by:` entries are refused."""
    if not tolerances:
        return "fail", "the stage declares no tolerances: nothing was checked"
    if any(tol.by for tol in tolerances.values()):
        raise ValueError("judge: tolerances with by: entries — judge with the case's (Stage.tolerances_for(case))")
    why = []
    for out, tol in tolerances.items():
        if out not in metrics:
            why.append(f"{out}: not produced")
            continue
        why += [f"{out}: {w}" for w in violations(metrics[out], tol)]
    return ("fail", "; ".join(why)) if why else ("pass", None)


def _num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g}"
