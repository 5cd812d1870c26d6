"""The peers' pass rules, ported (read, not copied) — each returns a verdict dict that goes into
the output's metrics: {"suite_ok": bool, "suite_why": str (empty when ok), and its numbers}.

FlashMLA (deepseek-ai/FlashMLA@9241ae3 tests/kernelkit/compare.py `check_is_allclose`):
    1. anomalies: the positions of +inf, −inf and NaN in the answer must be those of the
       reference, each kind exactly (then they count as 0);
    2. element-wise: every element has |a − r| < abs_tol  or  |a − r| / (|r| + 1e-6) < rel_tol;
    3. cosine difference 1 − 2·Σ a·r / Σ (a² + r²) (0 when Σ r² < 1e-12) at most cos_diff_tol.
DeepGEMM (deepseek-ai/DeepGEMM@54e2261 and @80ceeb2 tests/test_attention.py with
deep_gemm/testing `calc_diff`):
    the −inf positions of the answer equal the reference's (where upstream asserts it), then
    with −inf set to 0 in both: calc_diff = 1 − 2·Σ a·r / Σ (a² + r²) (0 when both are all 0)
    below the case's bound.
"""

from __future__ import annotations

from typing import Any


def _f(x: float) -> float:
    return float(f"{x:.6g}")


def cos_diff(a, r) -> float:
    """FlashMLA's cosine difference (float64): 0 when the reference is (nearly) all zero."""
    a, r = a.double(), r.double()
    if float((r * r).sum()) < 1e-12:
        return 0.0
    return 1.0 - 2.0 * float((a * r).sum()) / float((a * a + r * r).sum())


def calc_diff(a, r) -> float:
    """DeepGEMM's calc_diff (float64): 0 when both are all zero."""
    a, r = a.double(), r.double()
    den = float((a * a + r * r).sum())
    if den == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((a * r).sum()) / den


def allclose(ans, ref, abs_tol: float, rel_tol: float, cos_diff_tol: float) -> dict[str, Any]:
    """FlashMLA's check_is_allclose on `ans` against `ref` (both compared as float32, as upstream
    does after its `.to(torch.float)`)."""
    import torch

    a = ans.detach().to(ref.device).float().clone()
    r = ref.detach().float().clone()
    why = []
    for name, hit in (("+inf", lambda t: t == float("inf")), ("-inf", lambda t: t == float("-inf")),
                      ("nan", lambda t: t != t)):
        ma, mr = hit(a), hit(r)
        if not torch.equal(ma, mr):
            why.append(f"{name} at {int(ma.sum())} positions, the reference at {int(mr.sum())}")
        a[ma] = 0.0
        r[mr] = 0.0
    raw_abs = (a - r).abs()
    raw_rel = raw_abs / (r.abs() + 1e-6)
    ok = (raw_abs < abs_tol) | (raw_rel < rel_tol)
    bad = int((~ok).sum())
    cd = cos_diff(a, r)
    out: dict[str, Any] = {"suite_cos_diff": _f(cd), "suite_mismatch": bad}
    if bad:
        worst = int(torch.argmax(torch.where(ok, torch.zeros_like(raw_abs), raw_abs)))
        why.append(f"{bad} of {ok.numel()} elements off by ≥ {abs_tol:g} abs and ≥ {rel_tol:.4g} rel "
                   f"(worst {float(a.view(-1)[worst]):.6g} vs {float(r.view(-1)[worst]):.6g})")
    if not abs(cd) <= cos_diff_tol:
        why.append(f"cos_diff {cd:.3g} > {cos_diff_tol:g}")
    out.update(suite_ok=not why, suite_why="; ".join(why))
    return out


def diff_below(ans, refs: dict[str, tuple[Any, float]], neginf_ref=None) -> dict[str, Any]:
    """DeepGEMM's rule: when `neginf_ref` (the reference whose −inf positions the answer must
    share) is given, they must be equal; then, −inf → 0 where that reference is −inf, each
    calc_diff(ans, ref) < bound for `refs` {name: (ref, bound)}."""
    import torch

    a = ans.detach().double()
    why = []
    out: dict[str, Any] = {}
    mask = None
    if neginf_ref is not None:
        mask = neginf_ref.to(a.device) == float("-inf")
        got = a == float("-inf")
        if not torch.equal(got, mask):
            why.append(f"-inf at {int(got.sum())} positions, the reference at {int(mask.sum())}")
    for name, (ref, bound) in refs.items():
        r = ref.to(a.device).double()
        m = mask if mask is not None else (r == float("-inf"))
        d = calc_diff(a.masked_fill(m, 0.0), r.masked_fill(m, 0.0))
        out[f"suite_diff_{name}"] = _f(d)
        if not d < bound:  # NaN fails
            why.append(f"calc_diff vs {name} {d:.3g} ≥ {bound:g}")
    out.update(suite_ok=not why, suite_why="; ".join(why))
    return out
