#!/usr/bin/env python3
"""GPU smoke test of stage D2 on sm_90a: one call, as much debugging information as it can give.

On the GPU machine, in the lab root:

    python3 scripts/d2_smoke.py                 # run the D2 matrix through the lab, then diagnose
    python3 scripts/d2_smoke.py --where splits=1   # a filtered run (passed to `cli run --where`)
    python3 scripts/d2_smoke.py --no-run        # diagnose the failures of the newest D2 run
    python3 scripts/d2_smoke.py --case shape=b1s1h64n256d512,splits=1   # diagnose one case

1. `python3 -m cli run stage-D2 --arch sm_90a` (records written as usual), its output streamed.
2. The newest run's records: every case's status and metrics, failures first.
3. For up to --max-diagnose failing cases (smallest first, one split before several), each in a
   process of its own with a timeout (a crash or hang cannot stop the others): the cached
   kernel is launched on the case's inputs (same seed as the lab) with poisoned outputs and
   scratch, and the script prints
     O:   rows (batch, token, head) that are wrong — counted per batch, token, head block and
          head row within the block (the wgmma fragment rows), their error and norm ratio, which
          32-column blocks are wrong (warpgroup 0 owns [0, d/2), warpgroup 1 [d/2, d)), unwritten
          (poison) elements, and for a few bad rows the reference row they resemble most;
     LSE: wrong entries per batch / head block / token, and the typical offset;
     split partials (splits > 1): per split, the partial LSE and partial O against float64
          partials over that split's keys (from the kernel's own scheduler), and whether empty
          splits wrote LSE = −∞ and O = 0 — main kernel or combine, whichever is wrong.
Exit status: 0 when every case of the run passed (or the diagnosed case is right), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ARCH = "sm_90a"
STAGE = "D2"
FAILING = ("fail", "crash", "timeout", "compile_error")


def parse_case(text: str) -> dict:
    case: dict = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        case[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return case


def case_text(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in case.items())


# -- the run and its records -------------------------------------------------------------------


def run_lab(where: str | None) -> int:
    cmd = [sys.executable, "-m", "cli", "run", f"stage-{STAGE}", "--arch", ARCH]
    if where:
        cmd += ["--where", where]
    print("$", " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def newest_run_records() -> list[dict]:
    path = ROOT / "results" / "records" / f"{STAGE}.jsonl"
    if not path.is_file():
        return []
    recs = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("arch") == ARCH and r.get("status") not in ("compiled",):
            recs.append(r)
    runs = {r["run"] for r in recs if r.get("status") in ("pass", "fail", "crash", "timeout", "skipped")}
    if not runs:  # only compile-only runs so far
        return []
    newest = max(runs)
    return [r for r in recs if r["run"] == newest]


def size_of(case: dict) -> tuple[int, int]:
    from stages.common.scheduler import DecodeShape

    p = DecodeShape.parse(case["shape"])
    return (0 if case["splits"] == 1 else 1, p.b * p.s_q * p.h_q * p.n * p.d)


def print_records(recs: list[dict]) -> None:
    env = recs[0].get("env") or {}
    print(f"\n== run {recs[0]['run']}: {len(recs)} cases; env " + " ".join(f"{k}={v}" for k, v in env.items()))
    for r in sorted(recs, key=lambda r: (r["status"] == "pass", size_of(r["case"]))):
        m = r.get("metrics") or {}
        parts = []
        for name in ("O", "LSE"):
            x = m.get(name)
            if x:
                cos = "—" if x.get("cosine") is None else f"{x['cosine']:.7f}"
                rel = "—" if x.get("rel_l2") is None else f"{x['rel_l2']:.2e}"
                parts.append(f"{name}: cos {cos} rel {rel} max {x.get('max_abs')} nonfinite {x.get('nonfinite')} unwritten {x.get('unwritten')}")
        err = (r.get("error") or "").splitlines()[0][:200] if r.get("error") else ""
        print(f"  {r['status']:<13} {case_text(r['case']):<42} {' | '.join(parts)} {err}")


# -- diagnosing one case on the GPU ------------------------------------------------------------


def _ranges(xs) -> str:
    xs = sorted(set(int(x) for x in xs))
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out) if out else "none"


def _hist(t, name: str) -> str:
    import torch

    vals, counts = torch.unique(t, return_counts=True)
    return f"{name}: " + " ".join(f"{int(v)}:{int(c)}" for v, c in zip(vals.tolist(), counts.tolist()))


def diagnose(case: dict) -> int:
    os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
    import torch

    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    from harness.compile import compile_case
    from harness.metrics import poison_
    from harness.spec import load_spec
    from oracles import decode
    from oracles.common import case_seed
    from stages.D2_decode.sm90 import Kernel

    if not torch.cuda.is_available():
        print(f"==== diagnose {case_text(case)}: no CUDA device here (run this on the GPU machine)")
        return 1
    print(f"\n==== diagnose {case_text(case)}  ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cutlass-dsl {getattr(cutlass, '__version__', '?')})", flush=True)
    stage = load_spec(root=ROOT).stage(STAGE)
    res = compile_case(ROOT, stage, ARCH, case)
    if not res.ok:
        print("compile error:", res.error)
        print(res.trace or "")
        return 1
    print(f"compiled: regs {res.resources.get('regs')} spill {res.resources.get('spill')} smem {res.resources.get('smem')}")
    kern = Kernel(shape=case["shape"], splits=case["splits"])
    g = kern.sched
    print(f"kernel: block_n {kern.block_n}, {g.num_tiles} KV tiles, splits {kern.splits} (chunk {g.chunk}, "
          f"non-empty {-(-g.num_tiles // g.chunk)}), grid {g.grid}, {kern.THREADS} threads")

    fn = cute.runtime.load_module(res.object_path)[res.prefix]
    specs = decode.tensors(case)
    inputs = decode.make_inputs(case, case_seed(STAGE, case, 0), "cuda")
    outs = {s.name: poison_(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="cuda"))
            for s in specs if s.role != "in"}
    args = [inputs[s.name] if s.role == "in" else outs[s.name] for s in specs]
    try:
        fn(*[from_dlpack(t, assumed_align=16) for t in args], cuda.CUstream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
    except Exception as exc:  # a launch failure / illegal address: say so and stop
        print(f"LAUNCH FAILED: {type(exc).__name__}: {exc}")
        return 1
    ref = decode.reference(inputs, case)
    ok = analyze(case, kern, inputs, outs, ref, stage.tolerances)
    print("diagnosis:", "case is RIGHT" if ok else "case is WRONG")
    return 0 if ok else 1


def analyze(case: dict, kern, inputs: dict, outs: dict, ref: dict, tolerances: dict) -> bool:
    """Print where the kernel's outputs (and split partials) differ from float64; True when
    O and LSE meet the stage's tolerances.  Device-agnostic (the self-test runs it on the CPU)."""
    import torch

    from harness.metrics import compare, unwritten_mask
    from oracles import decode

    g = kern.sched
    ok = True
    for name in ("O", "LSE"):
        m = compare(outs[name], ref[name])
        tol = tolerances[name]
        good = m.cosine is not None and m.cosine >= tol.cosine_min and m.rel_l2 <= tol.rel_l2_max and not m.nonfinite and not m.unwritten
        ok &= good
        print(f"{name}: {'OK ' if good else 'BAD'} {m.to_json()}")

    p = decode.parse_shape(case["shape"])
    b, s_q, h_q, d = p["b"], p["s_q"], p["h_q"], p["d"]

    # -- O, row by row
    o, r = outs["O"].double(), ref["O"]
    unw = unwritten_mask(outs["O"])
    diff = torch.nan_to_num(o - r, nan=1e30, posinf=1e30, neginf=1e30)
    row_rel = diff.norm(dim=-1) / r.norm(dim=-1)  # [b, s_q, h_q]
    bad = (row_rel > 1e-2) | ~torch.isfinite(o).all(dim=-1)
    nb = int(bad.sum())
    print(f"O rows wrong: {nb} of {bad.numel()}   unwritten elements: {int(unw.sum())} "
          f"(rows with any: {int(unw.any(dim=-1).sum())})")
    if nb:
        idx = bad.nonzero()
        print("  " + _hist(idx[:, 0], "per batch"))
        print("  " + _hist(idx[:, 1], "per token"))
        print("  " + _hist(idx[:, 2] // 64, "per head block"))
        print(f"  head rows within the block (fragment rows): {_ranges(idx[:, 2] % 64)}")
        finite = torch.isfinite(o).all(dim=-1) & bad
        if finite.any():
            ratio = o.norm(dim=-1)[finite] / r.norm(dim=-1)[finite]
            print(f"  ‖O‖/‖ref‖ on wrong finite rows: median {ratio.median():.4f} min {ratio.min():.4f} max {ratio.max():.4f}; "
                  f"row rel err median {row_rel[finite].median():.3e}")
        nonfinite_cols = (~torch.isfinite(o)).any(dim=(0, 1, 2)).nonzero().flatten()
        if len(nonfinite_cols):
            print(f"  columns holding NaN/inf: {_ranges(nonfinite_cols)}")
        fin_bad = bad & torch.isfinite(o).all(dim=-1)
        col_err = (diff.abs() * fin_bad[..., None]).sum(dim=(0, 1, 2)) / max(int(fin_bad.sum()), 1)  # [d]
        ref_mag = r.abs().mean()
        wrong_cols = (col_err > 0.05 * ref_mag).nonzero().flatten()
        print(f"  columns wrong on finite wrong rows (mean |err| > 5% of mean |ref|): {_ranges(wrong_cols)} "
              f"(warpgroup 0 owns 0-{d // 2 - 1}, warpgroup 1 {d // 2}-{d - 1}); per 32-col block mean |err|: "
              + " ".join(f"{float(col_err[i:i + 32].mean()):.2g}" for i in range(0, d, 32)))
        flat_r = r.reshape(-1, d)
        for k in range(min(4, len(idx))):
            bi, t, h = (int(x) for x in idx[k])
            row = o[bi, t, h]
            if not torch.isfinite(row).all():
                print(f"  O[{bi},{t},{h}]: {int((~torch.isfinite(row)).sum())} non-finite, first at col "
                      f"{int((~torch.isfinite(row)).nonzero()[0])}")
                continue
            dist = (flat_r - row).norm(dim=-1)
            j = int(dist.argmin())
            jb, jt, jh = j // (s_q * h_q), (j // h_q) % s_q, j % h_q
            print(f"  O[{bi},{t},{h}] rel err {float(row_rel[bi, t, h]):.3e}; closest reference row is "
                  f"[{jb},{jt},{jh}] (rel dist {float(dist[j] / flat_r[j].norm()):.3e})")

    # -- LSE
    lse, lref = outs["LSE"].double(), ref["LSE"]  # [b, h_q, s_q]
    ldiff = torch.nan_to_num(lse - lref, nan=1e30)
    lbad = ldiff.abs() > 1e-3
    print(f"LSE wrong (|diff| > 1e-3): {int(lbad.sum())} of {lbad.numel()}; unwritten {int(unwritten_mask(outs['LSE']).sum())}")
    if lbad.any():
        li = lbad.nonzero()
        print("  " + _hist(li[:, 0], "per batch") + "   " + _hist(li[:, 1] // 64, "per head block") + "   " + _hist(li[:, 2], "per token"))
        fin = torch.isfinite(lse) & lbad
        if fin.any():
            print(f"  diff on wrong finite entries: median {float(ldiff[fin].median()):.5f} min {float(ldiff[fin].min()):.5f} max {float(ldiff[fin].max()):.5f}")

    # -- split partials against float64 partials over each split's keys
    if kern.splits > 1:
        import math

        bn = kern.block_n
        q = inputs["Q"].double()  # [b, s_q, h_q, d]
        kv = inputs["KV"].double()
        scale = 1.0 / math.sqrt(d)
        print(f"split partials (O_part / LSE_part, {kern.splits} of capacity {outs['O_part'].shape[0]}):")
        for s in range(kern.splits):
            w = g.work(0, s, 0)
            lp, op = outs["LSE_part"][s].double(), outs["O_part"][s].double()  # [b, s_q, h_q], [b, s_q, h_q, d]
            if w.tile_begin >= w.tile_end:
                ok_empty = bool((lp == -math.inf).all()) and bool((op == 0).all())
                print(f"  split {s:3d}: empty — LSE all −∞ and O all 0: {ok_empty} "
                      f"(LSE −∞ {int((lp == -math.inf).sum())}/{lp.numel()}, O zeros {int((op == 0).sum())}/{op.numel()})")
                continue
            keys = kv[:, w.tile_begin * bn: w.tile_end * bn]
            sc = torch.einsum("bthd,bnd->bthn", q, keys) * scale
            want_l = torch.logsumexp(sc, dim=-1)
            want_o = torch.einsum("bthn,bnd->bthd", torch.softmax(sc, dim=-1), keys)
            dl = torch.nan_to_num(lp - want_l, nan=1e30).abs()
            do = torch.nan_to_num(op - want_o, nan=1e30)
            rel = float(do.norm() / want_o.norm())
            print(f"  split {s:3d}: tiles [{w.tile_begin}, {w.tile_end})  LSE max|diff| {float(dl.max()):.3e}  "
                  f"O rel {rel:.3e}  unwritten O {int(unwritten_mask(outs['O_part'][s]).sum())} LSE {int(unwritten_mask(outs['LSE_part'][s]).sum())}")
            del sc, want_o
    return ok


def selftest() -> int:
    """CPU check of the analysis itself: the reference with injected faults (one head block
    of one token off by a factor, a NaN column, an unwritten LSE, a wrong split partial, an
    empty split that wrote garbage) must be reported; the clean reference must pass."""
    import math

    import torch

    from harness.metrics import poison_
    from harness.spec import load_spec
    from oracles import decode
    from oracles.common import case_seed
    from stages.D2_decode.sm90 import Kernel

    tolerances = load_spec(root=ROOT).stage(STAGE).tolerances
    case = {"shape": "b2s2h128n256d64p10", "splits": "many"}
    kern = Kernel(shape=case["shape"], splits=case["splits"])
    inputs = decode.make_inputs(case, case_seed(STAGE, case, 0), "cpu")
    ref = decode.reference(inputs, case)
    specs = {s.name: s for s in decode.tensors(case)}

    def fresh():
        outs = {n: ref[n].to(getattr(torch, specs[n].dtype)).clone() for n in ("O", "LSE")}
        for n in ("O_part", "LSE_part"):
            outs[n] = poison_(torch.empty(specs[n].shape, dtype=torch.float32))
        bn, q, kv = kern.block_n, inputs["Q"].double(), inputs["KV"].double()
        for s in range(kern.splits):
            w = kern.sched.work(0, s, 0)
            if w.tile_begin >= w.tile_end:
                outs["LSE_part"][s] = -math.inf
                outs["O_part"][s] = 0.0
                continue
            keys = kv[:, w.tile_begin * bn: w.tile_end * bn]
            sc = torch.einsum("bthd,bnd->bthn", q, keys) / math.sqrt(64)
            outs["LSE_part"][s] = torch.logsumexp(sc, dim=-1).float()
            outs["O_part"][s] = torch.einsum("bthn,bnd->bthd", torch.softmax(sc, dim=-1), keys).float()
        return outs

    print("-- self-test: clean outputs (expect RIGHT)")
    clean = analyze(case, kern, inputs, fresh(), ref, tolerances)
    print("-- self-test: injected faults (expect WRONG, batch 1 token 0 head block 1, col 5, LSE, split 0, an empty split)")
    outs = fresh()
    outs["O"][1, 0, 64:128] *= 1.5
    outs["O"][0, 1, 3, 5] = math.nan
    poison_(outs["LSE"][1, :, 1])
    outs["LSE_part"][0] += 0.5
    outs["O_part"][kern.splits - 1, 0, 0, 0, 0] = 7.0
    faulty = analyze(case, kern, inputs, outs, ref, tolerances)
    good = clean and not faulty
    print("self-test:", "OK" if good else "FAILED")
    return 0 if good else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-run", action="store_true", help="skip the lab run; diagnose the newest run's failures")
    ap.add_argument("--where", help="filters for the lab run, e.g. splits=1")
    ap.add_argument("--case", help="diagnose this one case (shape=...,splits=...) in this process")
    ap.add_argument("--max-diagnose", type=int, default=6)
    ap.add_argument("--selftest", action="store_true", help="CPU: check this script's analysis on injected faults")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per diagnosed case")
    a = ap.parse_args()
    os.chdir(ROOT)
    if a.selftest:
        return selftest()
    if a.case:
        return diagnose(parse_case(a.case))
    if not a.no_run:
        rc = run_lab(a.where)
        print(f"(lab run exit status {rc})")
    recs = newest_run_records()
    if not recs:
        print("no sm_90a run records of stage D2 found")
        return 1
    print_records(recs)
    failing = sorted((r for r in recs if r["status"] in FAILING), key=lambda r: size_of(r["case"]))
    if not failing:
        print("\nall cases pass")
        return 0
    for r in failing[: a.max_diagnose]:
        if r["status"] == "timeout":
            print(f"\n==== {case_text(r['case'])}: timeout in the lab (a barrier or pipeline deadlock?) — "
                  "diagnosing anyway with a timeout")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--case", case_text(r["case"])]
        try:
            subprocess.run(cmd, cwd=ROOT, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(f"  (diagnosis of {case_text(r['case'])} timed out after {a.timeout:.0f} s: the kernel hangs)")
    print(f"\n{len(failing)} of {len(recs)} cases failing")
    return 1


if __name__ == "__main__":
    sys.exit(main())
