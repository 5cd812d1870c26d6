"""`dsv4-lab bench STAGE [filters] [--peers]`: the stage's kernel timed at the realistic shapes of
its `bench:` block (stages.yaml), beside its peers, as a fraction of the GPU's roofline.

For each bench shape, in a process of its own (a kernel that faults takes down that shape only):
  1. inputs from the stage's generator, outputs poisoned, the cached compiled kernel launched once;
  2. the check: every input compared bit for bit with its copy from before the launch (a kernel
     that wrote one fails: harness.pristine), then the oracle on a sample of `check_rows` rows along `row_axis` (each output row of a
     row-separable stage depends on its own input rows only; the stage's tensors() tell which
     tensors are sliced), judged by the stage's tolerances, and every element of every output
     written. A kernel that fails posts no time: status fail, no timing;
  3. the kernel, then each peer, timed one after the other on the same rotated inputs by the same
     method (harness.timing: CUDA graphs of many launches, warm-up, median and spread);
     each peer's outputs are checked on the same rows first (a wrong peer posts no time either).
Each shape is one record in results/records/<stage>.jsonl with `note: "bench"` (is_bench()),
its shape in `case`, and flat timing keys: us, tflops, gbps, spread, p10_us, p90_us, reps, rot,
launches, method, GPU name and clocks, roofline (fraction of the bound), bound_us, bound_by, and
per peer `peer_<name>_us`, `_tflops`, `_ratio` (peer µs / kernel µs: above 1, the kernel is
faster) and `_cos` — or `peer_<name>`: why it did not run ("not installed (pip install …)",
"unsupported: …").

`run --bench` is separate: it times the one test case the block's `case:` names (default: each
axis's largest number / first word) at its test shape, as before.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from harness.labels import case_label
from harness.launch import KernelJob, Launcher, attr
from harness.matrix import expand, parse_filters
from harness.records import BENCH_NOTE
from harness.spec import Stage, Tolerance

ARCH_CC = {"sm_90a": (9, 0), "sm_100a": (10, 0)}  # the compute capability a peer is asked about
DEFAULT_TIMEOUT_S = 600.0
MIN_LAUNCHES = 20  # launches per timed repetition (one graph)


def is_bench(record: Any) -> bool:
    """Whether a record is a bench result (its case is a bench shape, not a test case)."""
    return getattr(record, "note", None) == BENCH_NOTE


class BenchError(Exception):
    """Bench cannot start (no bench block, bad filters): one line."""


# ---------------------------------------------------------------------------------------
# The plan (no torch).


def bench_view(stage: Stage) -> Stage:
    """The stage with its bench shapes as its matrix (for filters; each axis's values over the
    block's matrix and its `more` matrices)."""
    if stage.bench_plan is None:
        raise BenchError(f"{stage.name} has no bench block in stages.yaml — add one: bench: {{matrix: {{AXIS: "
                         f"[VALUES]}}, problem: attention, peers: [torch_sdpa]}} (see docs/STAGES.md)")
    union = {a: list(v) for a, v in stage.bench_plan.matrix.items()}
    for m in stage.bench_plan.more:
        for a, values in m.items():
            union[a] += [v for v in values if not any(type(u) is type(v) and u == v for u in union[a])]
    return dataclasses.replace(stage, matrix=union)


def plan_cases(stage: Stage, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The bench shapes that pass the filters (`[("hd", "128")]`), in bench-matrix order (the
    block's matrix, then its `more` matrices); with `beside`, the shapes that have its value come
    first, and one is added for every shape that lacks its twin (it is shown beside it)."""
    view = bench_view(stage)
    filters = parse_filters(view, pairs)
    cases: list[dict[str, Any]] = []
    for m in (stage.bench_plan.matrix, *stage.bench_plan.more):
        cases += [c.dict for c in expand(dataclasses.replace(stage, matrix=m), filters) if c.dict not in cases]
    if stage.bench_plan.beside and cases:
        axis, value = stage.bench_plan.beside
        twins = [{**c, axis: value} for c in cases]
        firsts = [c for i, c in enumerate(twins) if c not in twins[:i]]
        cases = firsts + [c for c in cases if c not in firsts]
    if not cases:
        raise BenchError(f"{stage.name}: no bench shape passes these filters — bench shapes: "
                         + ", ".join(case_label(c.dict) for c in expand(view)))
    if stage.bench_plan.open_axes:  # words the test matrix lacks: the stage's tensors() must take them
        tensors_fn = attr((stage.tensors.module, stage.tensors.name))
        for case in cases:
            try:
                tensors_fn(case)
            except Exception as exc:
                raise BenchError(f"stages.yaml:{stage.bench_plan.line}: {stage.name} bench shape {case_label(case)}: "
                                 f"{stage.tensors.module}:{stage.tensors.name} refuses it ({_one_line(exc)}) — "
                                 "fix the word in the bench matrix") from None
    return cases


def shape_support(stage: Stage, case: dict[str, Any], cc: tuple[int, int] | None) -> dict[str, str | None]:
    """peer -> None (it can run this shape) or why not (shape support only: no import)."""
    from harness.peers import why_not
    from harness.peers.problems import problem_dims

    plan = stage.bench_plan
    assert plan is not None
    specs = attr((stage.tensors.module, stage.tensors.name))(case)
    dims = problem_dims(plan.problem, specs) if plan.problem else "no problem named"
    return {p: why_not(p, plan.problem, dims, cc, probe=False) for p in plan.peers}


def sample_rows(total: int, want: int, seed: int) -> list[int]:
    """`want` distinct row indices of `total`, sorted: the first and last rows, the rest drawn
    (seeded). All rows when `want >= total`."""
    if want >= total:
        return list(range(total))
    if want == 1:
        return [0]
    rest = random.Random(seed).sample(range(1, total - 1), want - 2)
    return sorted([0, total - 1, *rest])


def row_tensors(specs: list, specs_rows: list, axis: str, total: int, rows: int) -> set[str]:
    """The tensors sliced by rows: those whose first dimension follows `axis` (from `total` to
    `rows`) while the rest of their shape stays; ValueError when a tensor changes any other way
    (the stage is not row-separable along `axis`)."""
    if [s.name for s in specs] != [s.name for s in specs_rows]:
        raise ValueError(f"tensors() names different tensors when {axis} changes")
    sliced = set()
    for s, r in zip(specs, specs_rows):
        if s.role == "scratch" or tuple(s.shape) == tuple(r.shape):  # scratch: the kernel's own, never compared
            continue
        if len(s.shape) and s.shape[0] == total and r.shape[0] == rows and tuple(s.shape[1:]) == tuple(r.shape[1:]):
            sliced.add(s.name)
            continue
        raise ValueError(f"{s.name} {list(s.shape)} becomes {list(r.shape)} when {axis} is {rows}: not rows along "
                         f"its first dimension — name another row_axis in the bench block")
    if not any(s.role == "out" and s.name in sliced for s in specs):
        raise ValueError(f"no output has {axis} rows — name another row_axis in the bench block")
    return sliced


# ---------------------------------------------------------------------------------------
# One bench shape, in its own process.


@dataclass(kw_only=True)
class BenchJob(KernelJob):
    """A bench shape for a bench process: the kernel's job, the stage's tolerances, the peers and
    the row check."""

    tolerances: dict[str, Tolerance]
    peers: tuple[str, ...] = ()
    problem: str | None = None
    check_rows: int = 256
    row_axis: str | None = None
    reps: int = 30
    min_launches: int = MIN_LAUNCHES
    time_it: bool = True
    env: dict[str, Any] = field(default_factory=dict)


_launcher = Launcher()  # one per bench process


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def check_and_time(job: BenchJob, root: Path) -> dict:
    """Check the kernel at the bench shape on sampled rows; when it passes and a GPU is here,
    time it and its peers. Returns {"status", "metrics", "error"?, "timing"?, "env"}."""
    import torch

    from harness.check import ContractError, inputs_problems, outputs_problems, specs_problems
    from harness.metrics import compare, judge, poison_, unwritten_mask
    from harness.pristine import describe, keep, restore, written

    device = "cpu" if job.arch == "cpu" else "cuda"
    tensors_fn, inputs_fn, oracle_fn = attr(job.tensors), attr(job.inputs), attr(job.oracle)
    specs = tensors_fn(job.case)
    bad = specs_problems(specs, tensors_fn, root)
    if bad:
        raise ContractError(bad[0])
    inputs = inputs_fn(job.case, job.seed, device)
    bad = inputs_problems(specs, inputs, inputs_fn, root)
    if bad:
        raise ContractError(bad[0])

    def fresh_outputs() -> dict:
        """Outputs and scratch, poisoned."""
        return {s.name: poison_(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device))
                for s in specs if s.role in ("out", "scratch")}

    buffers = fresh_outputs()
    args = [inputs[s.name] if s.role == "in" else buffers[s.name] for s in specs]
    outputs = {s.name: buffers[s.name] for s in specs if s.role == "out"}
    launch = _launcher(job, args)
    kept = keep(inputs)  # the inputs as generated: the kernel must not write them
    launch()
    if device == "cuda":
        torch.cuda.synchronize()
    wrote = written(inputs, kept)  # bit for bit
    restore(inputs, kept, wrote)  # the oracle (and the timing) see the inputs as generated
    del kept

    # The check: rows sampled along row_axis (or everything), against the oracle.
    axis = job.row_axis
    total = job.case.get(axis) if axis else None
    if axis and isinstance(total, int) and job.check_rows < total:
        idx = sample_rows(total, job.check_rows, job.seed)
        rcase = {**job.case, axis: len(idx)}
        sliced = row_tensors(specs, tensors_fn(rcase), axis, total, len(idx))
        index = torch.tensor(idx, device=device)
        pick = (lambda name, t: t.index_select(0, index) if name in sliced else t)
        check_inputs = {k: pick(k, v) for k, v in inputs.items()}
        check_outputs = {k: pick(k, v) for k, v in outputs.items()}
        checked = f"{len(idx)} of {total} rows along {axis}"
    else:
        idx, rcase, sliced = None, job.case, set()
        check_inputs, check_outputs = inputs, outputs
        checked = "every row"
    ref = oracle_fn(check_inputs, rcase)
    bad = outputs_problems(tensors_fn(rcase), ref, oracle_fn, root)
    if bad:
        raise ContractError(bad[0])
    metrics = {name: compare(check_outputs[name], ref[name]).to_json() for name in check_outputs}
    status, why = judge(job.tolerances, metrics)
    if wrote:  # a kernel that writes its inputs fails, whatever its outputs
        status, why = "fail", "; ".join(filter(None, [describe(wrote), why]))
    unwritten = {name: int(unwritten_mask(t).sum()) for name, t in outputs.items()}
    if any(unwritten.values()):
        status = "fail"
        lost = ", ".join(f"{k}: {v} elements" for k, v in unwritten.items() if v)
        why = "; ".join(filter(None, [why, f"never written ({lost})"]))
    result: dict[str, Any] = {"status": status, "metrics": metrics, "checked": checked}
    if why:
        result["error"] = why
    if status != "pass" or device != "cuda" or not job.time_it:
        return result
    result["timing"] = _time(job, specs, inputs, fresh_outputs, ref, idx, sliced)
    return result


def _time(job: BenchJob, specs, inputs: dict, fresh_outputs, ref: dict, idx, sliced: set) -> dict:
    import torch

    from harness.metrics import compare, judge
    from harness.peers import adapter, why_not
    from harness.peers.problems import problem_dims
    from harness.timing import bench, gpu_clocks, l2_bytes, rotations

    total_bytes = sum(s.nbytes for s in specs if s.role != "scratch")  # the fewest bytes: inputs once, outputs once
    sets = []
    for i in range(rotations(sum(s.nbytes for s in specs), l2_bytes())):
        ins = inputs if i == 0 else {k: v.clone() for k, v in inputs.items()}
        outs = fresh_outputs()
        sets.append((ins, [ins[s.name] if s.role == "in" else outs[s.name] for s in specs]))
    t = bench([_launcher(job, a) for _, a in sets], reps=job.reps, min_launches=job.min_launches)
    flops = attr(job.flops)(job.case) if job.flops else None
    secs = t["us"] * 1e-6
    if flops:
        t["tflops"] = flops / secs / 1e12
    t["gbps"] = total_bytes / secs / 1e9
    t["flops"] = float(flops or 0.0)
    t["bytes"] = total_bytes
    cap = torch.cuda.get_device_capability()
    dims = problem_dims(job.problem, specs) if job.problem else "no problem named"
    index = torch.tensor(idx, device="cuda") if idx is not None else None
    for name in job.peers:
        key = f"peer_{name}"
        why = why_not(name, job.problem, dims, cap)
        if why:
            t[key] = why
            continue
        try:
            mod = adapter(name)
            runs = [mod.make(job.problem, dims, ins) for ins, _ in sets]
            got = runs[0]()
            torch.cuda.synchronize()
            pm = {}
            for out, value in got.items():
                if out in ref:
                    v = value.index_select(0, index) if (index is not None and out in sliced) else value
                    pm[out] = compare(v, ref[out]).to_json()
            # a peer is held to the stage's cosine bound only: its precision choices (a bf16 score
            # matrix in plain PyTorch) are its own business, a wrong answer is not
            tols = {k: Tolerance(cosine_min=v.cosine_min if v.cosine_min is not None else 0.999)
                    for k, v in job.tolerances.items() if k in pm}
            verdict, pwhy = judge(tols, pm) if tols else ("fail", "returned none of the checked outputs")
            cos = [m["cosine"] for m in pm.values() if m.get("cosine") is not None]
            if cos:
                t[f"{key}_cos"] = min(cos)
            if verdict != "pass":
                t[key] = f"wrong result: {pwhy}"[:300]
                continue
            p = bench(runs, reps=job.reps, min_launches=job.min_launches)
        except Exception as exc:  # a peer that breaks is that peer's line, not the kernel's record
            t[key] = f"error: {_one_line(exc)}"
            if "CUDA" in str(exc) or "illegal" in str(exc):
                break  # the context may be unusable: no further peer on it
            continue
        t[f"{key}_us"] = p["us"]
        t[f"{key}_spread"] = p["spread"]
        peer_flops = mod.flops(job.problem, dims) if hasattr(mod, "flops") else flops  # its own work, if more
        if peer_flops:
            t[f"{key}_tflops"] = peer_flops / (p["us"] * 1e-6) / 1e12
        t[f"{key}_ratio"] = p["us"] / t["us"]
    t.update(gpu_clocks())
    # cosines keep every digit (1 - 1e-6 is not 1.0); times and rates keep four decimals
    return {k: (round(v, 4) if isinstance(v, float) and not k.endswith("_cos") else v) for k, v in t.items()}


def _worker(conn, root: str, job: BenchJob, gpu: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and kills this process
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        from harness.environment import gpu_environment

        if gpu is not None and job.arch != "cpu":
            import torch

            torch.cuda.set_device(gpu)

        out = check_and_time(job, Path(root))
        out["env"] = gpu_environment()
    except Exception as exc:
        from harness.userfault import describe, full_trace

        raw = _one_line(exc)
        cuda = "CUDA" in raw or "CUresult" in raw
        out = {"status": "crash", "error": raw if cuda else describe(exc, Path(root)), "trace": full_trace(exc)[-20000:]}
    conn.send(out)
    conn.close()


def run_job(root: Path, job: BenchJob, timeout_s: float, gpu: int | None = None) -> dict:
    """The job's answer from a fresh process, or {"status": "crash"|"timeout", "error": ...}."""
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, str(root), job, gpu), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            return {"status": "timeout", "error": f"no result within {timeout_s:g} s; bench process killed"}
        try:
            return parent.recv()
        except EOFError:
            proc.join(5)
            return {"status": "crash", "error": f"bench process died (exit code {proc.exitcode})"}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        parent.close()


# ---------------------------------------------------------------------------------------
# The command.


def _job(stage: Stage, arch: str, case: dict[str, Any], peers: bool, reps: int, seed: int) -> BenchJob:
    from oracles.common import case_seed

    plan = stage.bench_plan
    assert plan is not None
    k = stage.kernels[arch]
    return BenchJob(
        stage=stage.id, arch=arch, case=case, kernel_params=stage.kernel_params, kernel_module=k.module,
        kernel_entry=k.entry, tensors=(stage.tensors.module, stage.tensors.name),
        inputs=(stage.inputs.module, stage.inputs.name), oracle=(stage.oracle.module, stage.oracle.name),
        flops=(stage.flops.module, stage.flops.name) if stage.flops else None, tolerances=stage.tolerances,
        seed=case_seed(stage.id, case, seed), peers=plan.peers if peers else (), problem=plan.problem,
        check_rows=plan.check_rows, row_axis=plan.row_axis, reps=reps,
    )


def _fmt_us(x: Any) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else "—"


def main(root: Path, stage: Stage, pairs: list[tuple[str, str]], peers: bool = False, reps: int = 30,
         timeout_s: float = DEFAULT_TIMEOUT_S, seed: int = 0, gpu: int = 0, argv: list[str] | None = None) -> int:
    """Plan, compile, check, time and record. 0 only when every shape passed and was timed;
    1 when something failed or nothing could be timed (no GPU here); 2 for bad input (raised)."""
    from rich.console import Console

    from harness.environment import gpu_capabilities
    from harness.roofline import read_peaks, roofline_fields

    console = Console(highlight=False, soft_wrap=True, markup=False)  # names and notes print literally
    cases = plan_cases(stage, pairs)
    plan = stage.bench_plan
    assert plan is not None
    caps = gpu_capabilities()
    arch = caps[gpu][1] if gpu in caps else None
    console.print(f"{stage.name} bench: {len(cases)} shape(s); peers: "
                  f"{', '.join(plan.peers) if peers and plan.peers else 'none (add --peers)' if plan.peers else 'none'}")
    cc = ARCH_CC.get(arch or "")  # None (no GPU here): peers' shape support is told for sm90
    for case in cases:
        sup = shape_support(stage, case, cc) if peers else {}
        notes = "; ".join(f"{p}: {w}" for p, w in sup.items() if w)
        console.print(f"  {case_label(case)}" + (f"   ({notes})" if notes else ""))
    if not caps:
        console.print("no GPU here: nothing was timed (run dsv4-lab bench on the GPU machine)")
        return 1
    if gpu not in caps:
        raise BenchError(f"--gpu {gpu}: no such GPU (this machine has {', '.join(map(str, sorted(caps)))})")
    if arch not in stage.kernels:
        console.print(f"{stage.name} has no kernel for {arch} (GPU {gpu}: {caps[gpu][0]}): nothing was timed")
        return 1

    from harness.compile import Compiler
    from harness.identity import code_identity
    from harness.records import Record, RecordWriter, append_event, new_run_id, now_iso, runs_file

    run_id = new_run_id()
    writer = RecordWriter(root)
    code = code_identity(root, stage, arch)
    append_event(runs_file(root), {"run": run_id, "t": now_iso(), "event": "start", "target": "local",
                                   "argv": argv or [], "cases": len(cases), "bench": True})
    compiler = Compiler(root)
    futures = [compiler.submit(stage, arch, case) for case in cases]
    counts: dict[str, int] = {}
    beside_us: dict[tuple, float] = {}
    timed = 0
    warn: list[str] = []
    try:
        for i, (case, fut) in enumerate(zip(cases, futures), 1):
            res = fut.result()
            common: dict[str, Any] = dict(id=f"{run_id}.{i}", run=run_id, t="", stage=stage.id, arch=arch,
                                          case=case, code=code, gpu=gpu, note=BENCH_NOTE)
            if not res.ok:
                rec = Record(**common, status="compile_error", error=res.error, trace=res.trace or None,
                             compile=res.summary())
            else:
                job = _job(stage, arch, case, peers, reps, seed)
                job.object_path, job.prefix = res.object_path, res.prefix
                out = run_job(root, job, timeout_s, gpu)
                status = out.get("status", "crash")
                timing = out.get("timing")
                if timing:
                    peaks = read_peaks(root, timing.get("gpu_name", ""), warn)
                    timing.update(roofline_fields(timing.get("flops"), timing.get("bytes", 0), timing["us"], peaks,
                                                  plan.peak))
                    timing["checked"] = out.get("checked", "")
                    timed += 1
                elif status == "pass":  # checked, not timed: never a green bench
                    status, out["error"] = "skipped", "checked, not timed: " + out.get("checked", "")
                rec = Record(**common, status=status if status != "error" else "crash", metrics=out.get("metrics") or {},
                             timing=timing, error=out.get("error"), trace=out.get("trace"), env=out.get("env") or {},
                             compile=res.summary())
            _beside(plan.beside, case, rec.timing if rec.status == "pass" else None, beside_us)
            rec.t = now_iso()
            writer.write(rec)
            counts[rec.status] = counts.get(rec.status, 0) + 1
            _print_row(console, rec)
    except KeyboardInterrupt:
        console.print("interrupted: the finished shapes are recorded")
        return 130
    finally:
        compiler.close(cancel=True)
        writer.close()
        append_event(runs_file(root), {"run": run_id, "t": now_iso(), "event": "end", "planned": len(cases),
                                       "counts": counts})
    for w in warn[:3]:
        console.print(f"warning: {w}")
    console.print(f"records: results/records/{stage.id}.jsonl (run {run_id})")
    if timed < len(cases):
        return 1
    return 0


def _beside(beside: tuple[str, Any] | None, case: dict[str, Any], timing: dict | None, seen: dict[tuple, float]) -> None:
    """With the block's `beside` (axis, value): keep a timed shape's µs that has the value; give a
    shape that has another the twin's as `beside_<value>_us` and its own time over it as
    `beside_<value>_cost` (1.12: 12 % slower) — both timed in this run (plan_cases puts twins first)."""
    if beside is None or not timing:
        return
    axis, value = beside
    key = tuple(sorted((a, str(v)) for a, v in case.items() if a != axis))
    if case.get(axis) == value:
        seen[key] = timing["us"]
    elif key in seen:
        timing[f"beside_{value}_us"] = seen[key]
        timing[f"beside_{value}_cost"] = round(timing["us"] / seen[key], 4)


def _print_row(console, rec) -> None:
    t = rec.timing or {}
    head = f"  {case_label(rec.case)}: {rec.status}"
    if not t:
        console.print(head + (f" — {rec.error}" if rec.error else ""))
        return
    roof = t.get("roofline")
    roof_text = f"{roof:.0%} of roofline ({t.get('bound_by')})" if isinstance(roof, float) else str(roof)
    tf = f", {t['tflops']:.0f} TFLOP/s" if isinstance(t.get("tflops"), (int, float)) else ""
    console.print(f"{head} — {t['us']:.1f} µs{tf}, ±{t.get('spread', 0):.1%}, {roof_text}")
    for key, value in t.items():
        if key.startswith("peer_") and isinstance(value, str):  # why a peer did not run
            console.print(f"      {key[5:]}: {value}")
    for key in [k for k in t if k.startswith("beside_") and k.endswith("_cost")]:  # _beside
        twin = key[len("beside_"):-len("_cost")]
        console.print(f"      {twin} (this run): {_fmt_us(t.get(f'beside_{twin}_us'))} µs — this shape takes "
                      f"{t[key]:.2f}x its time")
    for key in [k for k in t if k.endswith("_ratio")]:
        name = key[5:-6]
        console.print(f"      {name}: {_fmt_us(t.get(f'peer_{name}_us'))} µs — kernel is {t[key]:.2f}x "
                      f"{'faster' if t[key] > 1 else 'slower' if t[key] < 1 else 'as fast'}")

