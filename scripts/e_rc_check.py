"""Stage E's `resident_combine` build (stages/common/resident_combine.py: the pieces of a cut
sequence combine it inside the attention kernel) on a few cases, checked against the oracle, for
compute-sanitizer (issue 30).  The lab's runner builds the default kernel, so this compiles the
option itself (as scripts/e_small_timeline.py does) and runs each case once per scenario.  On the
GPU machine:

    compute-sanitizer --tool synccheck python3 scripts/e_rc_check.py
    python3 scripts/e_rc_check.py --case b3:s2h64_m200bs2_x64bs256:2 --scenarios sink,lonely

Prints each case × scenario's check; exit 0 only when every case built the in-kernel combine
(grid resident) and every check passed (under the sanitizer its own summary — "ERROR SUMMARY:
0 errors" — is what the run is about)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CASES = [
    "b2:s2h64_m128bs256_x1024bs64:auto",   # 9 pieces a sequence, one CTA a part
    "b2:s2h128_m128bs256_x1024bs64:auto",  # … with the cluster pair
    "b3:s2h64_m200bs2_x64bs256:2",         # pieces of 2 and 3
]


def _parse(text: str) -> tuple[int, str, object]:
    b, config, splits = text.split(":")
    return int(b.lstrip("b")), config, splits if splits in ("auto", "many") else int(splits)


def _where(case: dict, inputs: dict, args: list, show: int = 12) -> str:
    """Where a failed case differs: per output, the bad rows' indices (NaN, non-finite mismatch or
    |got − ref| > 1e-2 · max|ref|) and, for LSE, got vs ref at the first few."""
    import torch

    from oracles.sparse_decode import reference, tensors

    names = [s.name for s in tensors(case)]
    ref = reference({k: v.cpu() for k, v in inputs.items()}, case)
    lines = []
    for n in ("O", "LSE"):
        a, r = args[names.index(n)].double().cpu(), ref[n].double().cpu()
        fin = torch.isfinite(r)
        scale = float(r[fin].abs().max()) if fin.any() else 1.0
        bad = torch.isnan(a) | (torch.isfinite(a) != fin) | (fin & ((a - r).abs() > 1e-2 * scale))
        if n == "O":
            bad = bad.any(dim=-1)
        idx = bad.nonzero().tolist()
        lines.append(f"    {n} {list(a.shape)}: {len(idx)} bad rows; nan {int(torch.isnan(a).sum())}; first {idx[:show]}")
        if n == "LSE":
            for i in idx[:show]:
                lines.append(f"      {i}: got {float(a[tuple(i)]):.6g} ref {float(r[tuple(i)]):.6g}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help="b<B>:<config>:<splits> (default: the three of CASES)")
    ap.add_argument("--scenarios", default="sink,lonely,sink_inf,invalid")
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    from e_small_timeline import _args_for, _check, _compile
    from oracles.sparse_decode import make_inputs
    from stages.E_sparse_decode.sm90 import Kernel

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(a.case or CASES):
            try:
                b, config, splits = _parse(text)
            except ValueError:
                ap.error(f"--case {text!r}: want b<B>:<config>:<splits>, e.g. b2:s2h64_m128bs256_x1024bs64:auto")
            case = dict(b=b, config=config, kv_format="model1", scenario="sink", splits=splits)
            kernel = Kernel(b=b, config=config, kv_format="model1", splits=splits, resident_combine=True)  # no code yet
            if not kernel.resident:
                print(f"e_rc_check {text}: the grid is not resident (or nothing is cut): no in-kernel combine to check")
                ok = False
                continue
            # compiled and exported as the timeline script builds a variant (model1, its sink scenario)
            _, obj, prefix, _, err, _ = _compile((f"rc{i}", b, config, dict(resident_combine=True, splits=splits),
                                                  str(Path(tmp) / str(i))))
            if err:
                print(f"e_rc_check {text}: compile FAILED: {err}")
                ok = False
                continue
            fn = cute.runtime.load_module(obj)[prefix]
            for scen in filter(None, a.scenarios.split(",")):
                scase = {**case, "scenario": scen}
                inputs = make_inputs(scase, 1, device="cuda")
                args = _args_for(scase, inputs)
                fn(*[from_dlpack(t, assumed_align=16) for t in args], cuda.CUstream(torch.cuda.current_stream().cuda_stream))
                torch.cuda.synchronize()
                got = _check(scase, inputs, args)
                print(f"e_rc_check {text} {scen}: {got} (parts {kernel.sched.parts}, L {kernel.sched.part_tiles}, "
                      f"pieces ≤ {kernel.splits})", flush=True)
                ok = ok and got.startswith("PASS")
                if not got.startswith("PASS"):
                    print(_where(scase, inputs, args), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
