"""`dsv4-lab bench STAGE [filters] [--peers]`: the stage's kernel timed at the realistic shapes of
its `bench:` block (stages.yaml), beside its peers, as a fraction of the GPU's roofline.

For each bench shape, in a process of its own (a kernel that faults takes down that shape only):
  1. inputs from the stage's generator, outputs poisoned, the compiled kernel launched once;
  2. the check: every input bit for bit unchanged (pristine), the oracle on `check_rows` rows
     along `row_axis`, by the stage's tolerances, and every output element written; a kernel
     that fails posts no time;
  3. the kernel, then each peer (its outputs checked first), timed on the same rotated inputs
     by the same method (timing.py: CUDA graphs, warm-up, median and spread).
Each shape is one record with `note: "bench"` (is_bench()), its shape in `case`, and flat timing
keys (README: the record's keys), per peer `peer_<name>_us`, `_tflops`, `_ratio` (peer µs /
kernel µs) and `_cos` — or `peer_<name>`: why it did not run.

`run --bench` is separate: it times the one test case the block's `case:` names."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from harness.execution.executor import MIN_LAUNCHES, BenchJob, CaseExecutor, job_for  # noqa: F401  (MIN_LAUNCHES: named here too)
from harness.execution.executor import one_line as _one_line
from harness.execution.executor import row_tensors, sample_rows  # noqa: F401  (the row check's pieces, named here too)
from harness.core.labels import case_label
from harness.execution.launch import attr
from harness.spec.matrix import expand, parse_filters
from harness.notebook.records import BENCH_NOTE, is_bench  # noqa: F401  (is_bench: named here too)
from harness.spec.spec import Stage
from harness.execution.worker import WorkerHandle

ARCH_CC = {"sm_90a": (9, 0), "sm_100a": (10, 0)}  # the compute capability a peer is asked about
DEFAULT_TIMEOUT_S = 600.0


class BenchError(Exception):
    """Bench cannot start (no bench block, bad filters): one line."""


# ---------------------------------------------------------------------------------------
# The plan (no torch).


def bench_view(stage: Stage) -> Stage:
    """The stage with its bench shapes as its matrix (the block's matrix and its `more` matrices),
        without its test `more:` case lists."""
    if stage.bench_plan is None:
        raise BenchError(f"{stage.name} has no bench block in stages.yaml — add one: bench: {{matrix: {{AXIS: "
                         f"[VALUES]}}, problem: attention, peers: [torch_sdpa]}} (see docs/STAGES.md)")
    union = {a: list(v) for a, v in stage.bench_plan.matrix.items()}
    for m in stage.bench_plan.more:
        for a, values in m.items():
            union[a] += [v for v in values if not any(type(u) is type(v) and u == v for u in union[a])]
    return dataclasses.replace(stage, matrix=union, cases=None)


def plan_cases(stage: Stage, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The bench shapes that pass the filters (`[("hd", "128")]`), in bench-matrix order; with
        `beside`, the shapes having its values first (most first), plus each missing twin. The
        stage's own test cases never enter."""
    view = bench_view(stage)
    filters = parse_filters(view, pairs)
    cases: list[dict[str, Any]] = []
    for m in (stage.bench_plan.matrix, *stage.bench_plan.more):
        cases += [c.dict for c in expand(dataclasses.replace(stage, matrix=m, cases=None), filters) if c.dict not in cases]
    pairs = stage.bench_plan.beside
    if pairs and cases:  # each shape after its twins (a twin has one more of the values), the missing ones added
        full: list[dict[str, Any]] = []
        for c in cases:
            for t in [*({**c, axis: value} for axis, value in pairs), c]:
                if t not in full:
                    full.append(t)
        cases = sorted(full, key=lambda c: -sum(c.get(axis) == value for axis, value in pairs))  # stable
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


# ---------------------------------------------------------------------------------------
# One bench shape, in a worker process of its own (harness/execution/worker.py, harness/execution/executor.py).


def check_and_time(job: BenchJob, root: Path) -> dict:
    """Check the kernel at the bench shape on sampled rows; when it passes and a GPU is here, time it
        and its peers in this process. Returns {"status", "metrics", "checked", "error"?, "timing"?}."""
    return CaseExecutor(root).check_and_time(job)


def run_job(root: Path, job: BenchJob, timeout_s: float, gpu: int | None = None) -> dict:
    """The job's answer from a fresh worker (a faulting kernel takes down that shape only), the GPU's
        environment under "env"; or {"status": "crash"|"timeout", "error": ...}."""
    handle = WorkerHandle(root, gpu, "bench process")
    try:
        out = handle.run(job, timeout_s)
        if handle.env and "env" not in out:
            out["env"] = handle.env
        return out
    finally:
        handle.close()


# ---------------------------------------------------------------------------------------
# The command.


def chosen_peers(plan: Any, peers: bool | tuple[str, ...]) -> tuple[str, ...]:
    """The bench block's peers to time: all (True), none (False) or those named (in the block's
    order; a name the block does not list is not timed)."""
    if isinstance(peers, bool):
        return tuple(plan.peers) if peers else ()
    return tuple(p for p in plan.peers if p in peers)


def _job(stage: Stage, arch: str, case: dict[str, Any], peers: bool | tuple[str, ...], reps: int,
         seed: int) -> BenchJob:
    plan = stage.bench_plan
    assert plan is not None
    return job_for(stage, arch, case, seed, BenchJob, tolerances=stage.tolerances_for(case),
                   peers=chosen_peers(plan, peers), problem=plan.problem, check_rows=plan.check_rows,
                   row_axis=plan.row_axis, reps=reps)


def _fmt_us(x: Any) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else "—"


def main(root: Path, stage: Stage, pairs: list[tuple[str, str]], peers: bool | tuple[str, ...] = False, reps: int = 30,
         timeout_s: float = DEFAULT_TIMEOUT_S, seed: int = 0, gpu: int = 0, argv: list[str] | None = None) -> int:
    """Plan, compile, check, time and record: 0 only when every shape passed and was timed; 1 when
        something failed or nothing was timed; 2 for bad input (raised)."""
    from rich.console import Console

    from harness.core.environment import gpu_capabilities
    from harness.execution.roofline import read_peaks, roofline_fields

    console = Console(highlight=False, soft_wrap=True, markup=False)  # names and notes print literally
    cases = plan_cases(stage, pairs)
    plan = stage.bench_plan
    assert plan is not None
    caps = gpu_capabilities()
    arch = caps[gpu][1] if gpu in caps else None
    timed_peers = chosen_peers(plan, peers)
    console.print(f"{stage.name} bench: {len(cases)} shape(s); peers: "
                  f"{', '.join(timed_peers) if timed_peers else 'none (add --peers)' if plan.peers else 'none'}")
    cc = ARCH_CC.get(arch or "")  # None (no GPU here): peers' shape support is told for sm90
    for case in cases:
        sup = {p: w for p, w in shape_support(stage, case, cc).items() if p in timed_peers}
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

    from harness.execution.compile import Compiler
    from harness.spec.identity import code_identity
    from harness.notebook.records import Record, RunLog, now_iso

    log = RunLog(root)
    run_id = log.run_id
    code = code_identity(root, stage, arch)
    log.plan(target="local", argv=argv or [], cases=len(cases), bench=True)
    log.start()
    compiler = Compiler(root)
    futures = [compiler.submit(stage, arch, case) for case in cases]
    counts: dict[str, int] = {}
    beside_us: dict[tuple, float] = {}
    timed = 0
    interrupted = False
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
            log.write(rec)
            counts[rec.status] = counts.get(rec.status, 0) + 1
            _print_row(console, rec)
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted: the finished shapes are recorded")
        return 130
    finally:
        compiler.close(cancel=True)
        log.close()
        log.end(interrupted, planned=len(cases), counts=counts)
    for w in warn[:3]:
        console.print(f"warning: {w}")
    console.print(f"records: results/records/{stage.id}.jsonl (run {run_id})")
    if timed < len(cases):
        return 1
    return 0


def _beside(beside: tuple[tuple[str, Any], ...], case: dict[str, Any], timing: dict | None,
            seen: dict[tuple, float]) -> None:
    """For each of the block's `beside` (axis, value) pairs: a shape with another value gets its
        twin's time as `beside_<value>_us` and its own over it as `beside_<value>_cost` (1.12: 12 %
        slower), both timed in this run (plan_cases puts twins first)."""
    if not timing:
        return
    for axis, value in beside:
        key = (axis, *sorted((a, str(v)) for a, v in case.items() if a != axis))
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

