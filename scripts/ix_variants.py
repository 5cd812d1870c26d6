r"""Stage I1 / I2 sm90 schedule variants timed beside DeepGEMM.  For the lead's GPU windows; prints
everything, writes nothing.

    python3 scripts/ix_variants.py --shape b64:n2:c8192 --variant base \
        --variant "s8:stages=8" --variant "w2:mma_wg=2,stages=8,min_blocks=2" [--deepgemm]
    python3 scripts/ix_variants.py --shape s2048:k4096:cp --variant base --deepgemm

A shape is b<B>:n<next_n>:c<ctx> (I2) or s<s>:k<s_kv>:<causal|cp> (I1).  A variant is
name[:knob=value,…], keyword arguments of the stage's sm90 Kernel, compiled here (no cache, no
records), checked against the float64 oracle, then timed as `bench` times it.  --deepgemm:
DeepGEMM's MQA logits on the same inputs, as harness/peers/deepgemm.py calls it."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from variant_launch import launches, rotated_sets  # noqa: E402


def _case(shape: str) -> dict:
    f = shape.split(":")
    if f[0].startswith("s"):  # I1
        return dict(s=int(f[0][1:]), s_kv=int(f[1][1:]), ranges=f[2], heads=64, head_dim=128, logits_dtype="fp32",
                    compressed=False)
    b, n, c = (int(x[1:]) for x in f)
    return dict(b=b, next_n=n, ctx=c, block_kv=64, heads=64, head_dim=128, logits_dtype="fp32", context_2d=False)


def _stage(case: dict):
    """(Kernel class, tensor specs, make_inputs, reference, DeepGEMM problem, the case's keys the
    Kernel takes) of the case's stage."""
    from oracles import indexer as o

    if "s" in case:
        from stages.I1_mqa_logits.sm90 import Kernel
        return Kernel, o.tensors, o.make_inputs, o.reference, "mqa_logits", ("s", "s_kv")
    from stages.I2_paged_mqa_logits.sm90 import Kernel
    return Kernel, o.paged_tensors, o.paged_make_inputs, o.paged_reference, "paged_mqa_logits", ("b", "next_n", "block_kv")


def _parse_knobs(text: str) -> dict:
    return {k: int(v) for k, _, v in (item.partition("=") for item in filter(None, text.split(",")))}


def _compile(job: tuple) -> tuple:
    key, case, knobs, out_dir = job
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    t0 = time.perf_counter()
    try:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from harness.execution.compile import fake_tensor

        Kernel, specs, *_, size_keys = _stage(case)
        kernel = Kernel(**{k: case[k] for k in size_keys}, **knobs)
        compiled = cute.compile(kernel, *[fake_tensor(s) for s in specs(case)], make_fake_stream())
        prefix = "ix_" + key.replace(":", "_").replace("=", "").replace(",", "_")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        compiled.export_to_c(out_dir, "kernel", function_prefix=prefix)
        regs = _registers(compiled)
        info = (f"stages {kernel.STAGES} wg {kernel.NUM_MMA_WG} regs {kernel.MMA_REGS} ctas {kernel.ctas} "
                f"launch regs {regs}")
        return key, str(Path(out_dir) / "kernel.o"), prefix, time.perf_counter() - t0, None, info
    except Exception as exc:  # reported, the other variants go on
        return key, "", "", time.perf_counter() - t0, f"{type(exc).__name__}: {exc}", ""


def _registers(compiled) -> str:
    """The launch's registers a thread per `ptxas -v` on the kernel's PTX ('?' without ptxas)."""
    from harness.execution.compile import ptxas_resources

    raw = compiled.__ptx__ or ""
    path = Path(raw) if raw and "\n" not in raw else None
    text = path.read_text() if path and path.is_file() else raw
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(text)
    res = ptxas_resources(Path(f.name), "sm_90a")
    os.unlink(f.name)
    return f"{res.get('regs', '?')} spill {res.get('spill', '?')}"


def _args_for(case: dict, inputs: dict):
    import torch

    out = []
    for spec in _stage(case)[1](case):
        if spec.name in inputs:
            out.append(inputs[spec.name])
        else:
            out.append(torch.full(tuple(spec.shape), float("nan"), dtype=torch.float32, device="cuda"))
    return out


def _check(ref, args: list) -> str:
    import torch

    got = args[-1].double()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(got), finite) or not torch.equal(got[~finite], ref[~finite]):
        return "FAIL (non-finite positions differ)"
    a, r = got[finite], ref[finite]
    cos = float(torch.nn.functional.cosine_similarity(a, r, dim=0))
    rel = float((a - r).norm() / r.norm())
    return ("PASS" if cos >= 0.99999 and rel <= 1e-3 else "FAIL") + f" cos {cos:.7f} rel {rel:.2e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True, help="b<B>:n<next_n>:c<ctx> or s<s>:k<s_kv>:<ranges>")
    ap.add_argument("--variant", action="append", required=True, help="name[:knob=v,…] ('none': DeepGEMM alone)")
    ap.add_argument("--deepgemm", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--check-only", action="store_true", help="check each variant once, no timing (for compute-sanitizer)")
    a = ap.parse_args()
    shapes = a.shape
    variants = [(v.partition(":")[0], _parse_knobs(v.partition(":")[2])) for v in a.variant if v != "none"]

    work = Path(tempfile.mkdtemp(prefix="ixv-"))
    jobs = [(f"{sh}:{name}", _case(sh), knobs, str(work / str(i)))
            for i, (sh, (name, knobs)) in enumerate((s, v) for s in shapes for v in variants)]
    t0 = time.perf_counter()
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=max(1, min(a.jobs, len(jobs))), mp_context=mp.get_context("spawn")) as pool:
        built = {r[0]: r for r in pool.map(_compile, jobs)}
    print(f"compiled {len(jobs)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)

    import cutlass.cute as cute
    import torch

    from harness.execution.timing import bench
    print(torch.cuda.get_device_name(0), flush=True)
    for sh in shapes:
        case = _case(sh)
        _, specs, make_inputs, reference, problem, _ = _stage(case)
        first = make_inputs(case, 0, device="cuda")
        sets = rotated_sets(first)
        ref = reference(first, case)["logits"].double()  # float64, on the GPU
        print(f"== {sh}: {len(sets)} input sets", flush=True)
        for name, knobs in variants:
            key, obj, prefix, secs, err, info = built[f"{sh}:{name}"]
            if err:
                print(f"  {name:10s} compile FAILED ({secs:.0f} s): {err}", flush=True)
                continue
            try:
                fn = cute.runtime.load_module(obj)[prefix]
                arg_lists = [_args_for(case, inputs) for inputs in sets]
                runs = launches(fn, arg_lists)
                check = _check(ref, arg_lists[0])
                if a.check_only:
                    print(f"  {name:10s} {check}; {info}", flush=True)
                    continue
                t = bench(runs, reps=a.reps, min_launches=20)
                print(f"  {name:10s} {t['us']:8.2f} µs (p10 {t['p10_us']:.2f} p90 {t['p90_us']:.2f}) {check}; {info}",
                      flush=True)
            except Exception as exc:
                print(f"  {name:10s} FAILED: {type(exc).__name__}: {exc}", flush=True)
        if a.deepgemm:
            try:
                from harness.peers import deepgemm
                from harness.peers.indexer_problems import problem_dims

                dims = problem_dims(problem, {s.name: s for s in specs(case)})
                runs = [deepgemm.make(problem, dims, s) for s in sets]
                t = bench(runs, reps=a.reps, min_launches=20)
                print(f"  {'deepgemm':10s} {t['us']:8.2f} µs (p10 {t['p10_us']:.2f} p90 {t['p90_us']:.2f})", flush=True)
            except Exception as exc:
                print(f"  deepgemm FAILED: {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
