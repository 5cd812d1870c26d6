r"""Stage E at small batches: variants of the sm90 kernel timed beside FlashMLA, with a per-kernel
timeline.  For the lead's GPU windows; prints everything, writes nothing.

    python3 scripts/e_small_timeline.py --shape b2:s2h128_m128bs256_x1024bs64 \
        --variant base --variant "plain:fast_combine=0,sink_first=0,pair_stores=0" \
        [--variant "stamps:stamps=1@b2"] [--profile b2] [--flashmla] [--check-scenarios invalid,lonely]

A variant is name[:knob=value,…][@b<B>[:<config prefix>]+…]: keyword arguments of the kernel
(Kernel.__init__'s small-batch options; `splits=n`, `fmt=`), restricted to some shapes after @.
Each shape × variant is compiled here (no cache, no records), checked against the oracle (the
stage's tolerances; --check-scenarios: those scenarios too), then timed as `bench` times it
(median µs of a launch of everything the host function launches).  --profile b1+b2:
torch.profiler, each kernel's median duration and start/end relative to the first.  A
`stamps=1` variant: per point of a CTA's chain (stamps.py), the median ns after the first CTA's
entry.  --flashmla: FlashMLA's V4 decode on the same inputs (--percall: metadata per call)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from variant_launch import launches, rotated_sets  # noqa: E402

FMT = "model1"
SCENARIO = "sink"


def _case(b: int, config: str, splits="auto", fmt: str = FMT) -> dict:
    return dict(b=b, config=config, kv_format=fmt, scenario=SCENARIO, splits=splits, epilogue="bf16")


def _parse_knobs(text: str) -> dict:
    knobs = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key == "fmt":
            knobs[key] = value
            continue
        flags = ("stamps", "pair_stores", "fast_combine", "sink_first", "e2m1_table")
        knobs[key] = bool(int(value)) if key in flags else int(value)
    return knobs


def _compile(job: tuple) -> tuple:
    """In a worker: compile one shape × variant, export it; (key, object path, prefix, seconds, error)."""
    key, b, config, knobs, out_dir = job
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    t0 = time.perf_counter()
    try:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        from harness.execution.compile import fake_tensor
        from oracles.sparse_decode import tensors
        from stages.E_sparse_decode.sm90 import Kernel

        knobs = dict(knobs)
        splits = knobs.pop("splits", "auto")  # the matrix's axis: an int n cuts a sequence into ~n parts
        fmt = knobs.pop("fmt", FMT)
        case = _case(b, config, splits, fmt)
        kernel = Kernel(b=b, config=config, kv_format=fmt, splits=splits, **knobs)
        compiled = cute.compile(kernel, *[fake_tensor(s) for s in tensors(case)], make_fake_stream())
        prefix = "esmall_" + key.replace(":", "_").replace("=", "").replace(",", "_")
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        compiled.export_to_c(out_dir, "kernel", function_prefix=prefix)
        info = f"parts {kernel.sched.parts} L {kernel.sched.part_tiles} cap {kernel.splits} merges {kernel.merges} combines {kernel.combines}"
        return key, str(Path(out_dir) / "kernel.o"), prefix, time.perf_counter() - t0, None, info
    except Exception as exc:  # reported, the other variants go on
        return key, "", "", time.perf_counter() - t0, f"{type(exc).__name__}: {exc}", ""


def _args_for(case: dict, inputs: dict):
    """The kernel's tensors in the stage's order: inputs, then outputs and scratch (poisoned)."""
    import torch

    from oracles.sparse_decode import tensors

    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    out = []
    for spec in tensors(case):
        if spec.name in inputs:
            out.append(inputs[spec.name])
        else:
            out.append(torch.full(tuple(spec.shape), float("nan"), dtype=dt[spec.dtype], device="cuda"))
    return out


def _check(case: dict, inputs: dict, args: list) -> str:
    import torch

    from oracles.sparse_decode import reference, tensors

    names = [s.name for s in tensors(case)]
    got = {n: args[names.index(n)].double().cpu() for n in ("O", "LSE")}
    ref = reference({k: v.cpu() for k, v in inputs.items()}, case)
    parts = []
    ok = True
    for n in ("O", "LSE"):
        a, r = got[n], ref[n].double().cpu()
        finite = torch.isfinite(r)
        if not torch.equal(torch.isfinite(a), finite) or not torch.equal(a[~finite], r[~finite]):
            ok = False
        a, r = a[finite], r[finite]
        cos = float(torch.nn.functional.cosine_similarity(a.flatten(), r.flatten(), dim=0))
        rel = float((a - r).norm() / r.norm().clamp_min(1e-30))
        tol_cos, tol_rel = (0.9999, 1e-2) if n == "O" else (0.9999, 1e-5)
        ok &= cos >= tol_cos and rel <= tol_rel
        parts.append(f"{n} cos {cos:.6f} rel {rel:.2e}")
    return ("PASS " if ok else "FAIL ") + ", ".join(parts)


def _profile(launch, iters: int = 30) -> str:
    """Per kernel: mean duration, and mean start/end relative to the first kernel of a call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        launch()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            launch()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and getattr(e, "time_range", None) is not None]
    events.sort(key=lambda e: e.time_range.start)
    # a call's kernels: the events in order, len(events) / iters of them a call
    per = max(1, len(events) // iters)
    calls = [events[i:i + per] for i in range(0, per * iters, per)]
    rows: dict[str, list] = {}
    for call in calls:
        t0 = call[0].time_range.start
        for i, e in enumerate(call):
            name = f"{i}:{e.name[:60]}"
            rows.setdefault(name, []).append((e.time_range.start - t0, e.time_range.end - t0,
                                              e.time_range.end - e.time_range.start))
    lines = []
    for name, v in rows.items():
        lines.append(f"      {name:64s} start {statistics.mean(x[0] for x in v):6.2f} end "
                     f"{statistics.mean(x[1] for x in v):6.2f} dur {statistics.median(x[2] for x in v):6.2f} µs (n={len(v)})")
    return "\n".join(lines)


SLOT_NAMES = {0: "entry", 1: "barriers set, pair met", 2: "producer: idx staged", 3: "wg0: Q arrived",
              4: "wg0: tile 0 ready", 5: "wg0: tile 0 S+softmax", 11: "wg0: tile 1 ready", 6: "wg0: tiles done",
              12: "wg1: last P·V done", 13: "O rescaled (pre-store)",
              7: "wg0: epilogue done", 8: "wg1: epilogue done", 10: "producer done", 9: "exit"}


def _stamps(case: dict, sets: list, fn, n_launches: int = 5) -> str:
    """A stamps build (stages/common/stamps.py) launched on `n_launches` input sets one at a time:
    per slot, over the CTAs, the median (min … max) ns after the earliest CTA's entry and the
    median cycles after the CTA's own entry; the medians over the launches."""
    import cuda.bindings.driver as cuda
    import torch
    from cutlass.cute.runtime import from_dlpack

    from oracles.sparse_decode import tensors
    from stages.common.stamps import RECORD_BYTES, SLOTS

    per_launch = []
    for k in range(n_launches):
        args = _args_for(case, sets[(k + 1) % len(sets)])
        o = args[[spec.name for spec in tensors(case)].index("O")]
        o.zero_()
        torch.cuda.synchronize()
        fn(*[from_dlpack(t, assumed_align=16) for t in args], cuda.CUstream(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        words = o.view(torch.int64).flatten().cpu()
        ctas = []
        for c in range(words.numel() * 8 // RECORD_BYTES):
            rec = words[c * RECORD_BYTES // 8:(c + 1) * RECORD_BYTES // 8].view(SLOTS, 2)
            if rec[0, 0] == 0:
                break
            ctas.append(rec)
        t0 = min(int(r[0, 0]) for r in ctas)
        stats = {}
        for slot in SLOT_NAMES:
            ns = [int(r[slot, 0]) - t0 for r in ctas if r[slot, 0] != 0]
            cyc = [int(r[slot, 1]) - int(r[0, 1]) for r in ctas if r[slot, 0] != 0]
            if ns:
                stats[slot] = (statistics.median(ns), min(ns), max(ns), statistics.median(cyc), len(ns))
        per_launch.append((len(ctas), stats))
    lines = [f"      {per_launch[0][0]} CTAs; ns after the first CTA's entry: median (min … max); cycles after "
             f"the CTA's entry: median — medians over {n_launches} launches"]
    for slot, label in sorted(SLOT_NAMES.items(), key=lambda kv: per_launch[-1][1].get(kv[0], (1e18,))[0]):
        got = [st[slot] for _, st in per_launch if slot in st]
        if not got:
            continue
        med = [statistics.median(g[i] for g in got) for i in range(5)]
        lines.append(f"      {slot:2d} {label:26s} {med[0]:8.0f} ns ({med[1]:.0f} … {med[2]:.0f})  {med[3]:8.0f} cyc  n={med[4]:.0f}")
    return "\n".join(lines)


def _wanted(only: set, b: int, config: str) -> bool:
    """A variant's @ filter: b<B> or b<B>:<config prefix> entries (none: every shape)."""
    if not only:
        return True
    for x in only:
        bb, _, cfg = x.partition(":")
        if int(bb.lstrip("b")) == b and config.startswith(cfg):
            return True
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True, help="b<B>:<config>, e.g. b2:s2h128_m128bs256_x1024bs64")
    ap.add_argument("--variant", action="append", required=True,
                    help="name[:knob=v,…][@b1+b2] (Kernel keyword arguments; @: only at those batches)")
    ap.add_argument("--profile", default="", help="b1+b2: torch.profiler timelines at those batches")
    ap.add_argument("--flashmla", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--check-scenarios", default="", help="a,b: also check variants on these scenarios' inputs")
    ap.add_argument("--check-variants", default="new", help="the variants --check-scenarios applies to")
    ap.add_argument("--percall", action="store_true", help="FlashMLA with its metadata computed per call too")
    ap.add_argument("--jobs", type=int, default=16)
    a = ap.parse_args()

    shapes = []
    for s in a.shape:
        b, _, config = s.partition(":")
        shapes.append((int(b.lstrip("b")), config))
    variants = []
    for v in a.variant:
        v, _, only = v.partition("@")
        name, _, knobs = v.partition(":")
        variants.append((name, _parse_knobs(knobs), {x for x in only.split("+") if x}))
    profile_b = {int(x.lstrip("b")) for x in a.profile.split("+") if x}

    work = Path(tempfile.mkdtemp(prefix="esmall-"))
    jobs = [(f"b{b}:{config}:{name}", b, config, knobs, str(work / f"{i}"))
            for i, ((b, config), (name, knobs, only)) in enumerate((s, v) for s in shapes for v in variants)
            if _wanted(only, b, config)]
    t0 = time.perf_counter()
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=min(a.jobs, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        built = {r[0]: r for r in pool.map(_compile, jobs)}
    print(f"compiled {len(jobs)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)

    import cutlass.cute as cute
    import torch

    from harness.execution.timing import bench
    from oracles.sparse_decode import make_inputs

    print(torch.cuda.get_device_name(0), flush=True)
    for b, config in shapes:
        case = _case(b, config)
        first = make_inputs(case, 0, device="cuda")
        # the same values at other addresses: the rotation keeps L2 cold as bench's does
        sets = rotated_sets(first)
        print(f"== b {b} {config}: {len(sets)} input sets", flush=True)
        for name, knobs, only in variants:
            if not _wanted(only, b, config):
                continue
            key, obj, prefix, secs, err, info = built[f"b{b}:{config}:{name}"]
            if err:
                print(f"  {name:10s} compile FAILED ({secs:.0f} s): {err}", flush=True)
                continue
            try:
                fn = cute.runtime.load_module(obj)[prefix]
                vcase = _case(b, config, knobs.get("splits", "auto"), knobs.get("fmt", FMT))
                # another format (or splits) keeps L2 cold too: its own inputs, rotated as model1's
                vin = sets if vcase["kv_format"] == FMT else rotated_sets(make_inputs(vcase, 0, device="cuda"))
                if knobs.get("stamps"):
                    print(f"  {name:10s} stamps ({info}):", flush=True)
                    print(_stamps(vcase, vin, fn), flush=True)
                    continue
                arg_lists = [_args_for(vcase, inputs) for inputs in vin]
                runs = launches(fn, arg_lists)
                check = _check(vcase, vin[0], arg_lists[0])
                for scen in filter(None, a.check_scenarios.split(",") if name in a.check_variants.split(",") else []):
                    scase = {**vcase, "scenario": scen}
                    sin = make_inputs(scase, 1, device="cuda")
                    sargs = _args_for(scase, sin)
                    launches(fn, [sargs])  # launched once, synchronised
                    check += f" | {scen}: {_check(scase, sin, sargs)}"
                t = bench(runs, reps=a.reps, min_launches=20)
                print(f"  {name:10s} {t['us']:7.2f} µs (p10 {t['p10_us']:.2f} p90 {t['p90_us']:.2f}, {t['method']}) "
                      f"{check}; {info}; compile {secs:.0f} s", flush=True)
                if b in profile_b:
                    print(_profile(runs[0]), flush=True)
            except Exception as exc:  # a failed variant is reported; the rest go on
                print(f"  {name:10s} FAILED: {type(exc).__name__}: {exc}", flush=True)
        if a.flashmla:
            _flashmla(case, sets, a.reps, b in profile_b, a.percall)
    return 0


def _flashmla(case: dict, sets: list, reps: int, profile: bool, percall: bool = False) -> None:
    try:
        import torch
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata

        from harness.execution.timing import bench
        from oracles import kvcache as kc
        from stages.common.sparse_config import SparseConfig

        c = SparseConfig.parse(case["config"])
        for per_call in (False, True) if percall else (False,):
            calls = []
            for inputs in sets:
                cache = kc.model1_flashmla_view(inputs["KV"], c.block).view(torch.float8_e4m3fn)
                extra = kc.model1_flashmla_view(inputs["KV_extra"], c.extra_block).view(torch.float8_e4m3fn)
                kw = dict(is_fp8_kvcache=True, indices=inputs["idx"], attn_sink=inputs["sink"],
                          topk_length=inputs["topk_length"], extra_k_cache=extra,
                          extra_indices_in_kvcache=inputs["idx_extra"], extra_topk_length=inputs["extra_length"],
                          use_legacy=True, kv_format="V4")
                meta = get_mla_metadata()[0]

                def launch(inputs=inputs, cache=cache, kw=kw, meta=meta) -> None:
                    m = get_mla_metadata()[0] if per_call else meta
                    flash_mla_with_kvcache(inputs["Q"], cache, None, None, 512, m, **kw)

                launch()
                calls.append(launch)
            torch.cuda.synchronize()
            t = bench(calls, reps=reps, min_launches=20)
            print(f"  {'flashmla' + ('/percall' if per_call else ''):10s} {t['us']:7.2f} µs (p10 {t['p10_us']:.2f} "
                  f"p90 {t['p90_us']:.2f}, {t['method']})", flush=True)
            if profile and not per_call:
                print(_profile(calls[0]), flush=True)
    except Exception as exc:
        print(f"  flashmla: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
