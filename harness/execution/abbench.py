"""`dsv4-lab bench STAGE [filters] --compare REV`: the stage's kernel at REV against the working
tree's, at each bench shape, in one process, on the same inputs, timed interleaved.

  1. REV's user code (stages.yaml, stages/, oracles/) is taken with `git archive` into a
     temporary folder (compilediff.py's way) — on any machine, so a bad REV is found first;
  2. with a GPU that runs the arch: every shape is compiled from both trees (REV's in a process
     of its own; one content-keyed compile cache), then per shape one worker
     (executor.py `CaseExecutor.compare`) loads both modules side by side, checks each against
     the tree's oracle, and times them interleaved, AB BA AB … (`rounds` rounds of `reps`
     CUDA-graph repetitions) on the same rotated inputs;
  3. abtest.py turns the per-round medians into the ratio tree/REV, its 95 % interval and the
     verdict at the threshold (stages.yaml `bench: {speed_tolerance: …}`, default 3 %).

Each shape is one bench record (the tree's timing, `note: bench`) with a `compare` block: rev,
commit, a_us (REV), b_us (tree), ratio, lo, hi, verdict, threshold, level, rounds, method.
Without a GPU: the plan and REV's tree are made, then "no GPU here: nothing was timed", exit 1.
On a target (`gate --speed --target NAME`, no .git there) REV's tree is shipped beside the working
tree (`rev_tree`) and the records go into the gate's session (`log`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from harness.core.labels import case_label
from harness.core.paths import cache_dir
from harness.execution import abtest
from harness.execution.bench import BenchError, plan_cases
from harness.spec.spec import Stage


def rev_commit(root: Path, rev: str) -> str:
    """The full sha of `rev`; BenchError (one line) when git does not know it as a commit."""
    from harness.execution.compilediff import _git

    sha = _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").stdout.strip()
    if not sha or rev.startswith("-"):
        raise BenchError(f"--compare {rev}: not a commit git knows here — e.g. HEAD, HEAD~1, main, a sha")
    return sha


def take_tree(root: Path, rev: str, sha: str, dest: Path) -> Path:
    """REV's user code under `dest` (its lab root); BenchError (one line) when it cannot be taken."""
    from harness.execution.compilediff import _extract

    try:
        return _extract(root, sha, dest)
    except (RuntimeError, OSError, tarfile.TarError) as exc:
        raise BenchError(f"--compare {rev}: cannot take its tree ({exc})") from None


def compare_block(rev: str, sha: str, c: abtest.Comparison, rounds: dict[str, list[float]] | None = None
                  ) -> dict[str, Any]:
    """A bench record's `compare` block (A: REV, B: the tree); with `rounds`, the paired per-round
        medians too (`a_rounds`, `b_rounds`, µs), so the verdict can be re-derived."""
    block = {"rev": rev, "commit": sha[:12], **{k: (round(v, 5) if isinstance(v, float) else v)
                                                for k, v in c.to_dict().items()}}
    for side, key in (("A", "a_rounds"), ("B", "b_rounds")):
        if rounds and side in rounds:
            block[key] = [round(float(x), 4) for x in rounds[side]]
    return block


def compile_rev(old_root: Path, stage_id: str, arch: str, cases: list[dict[str, Any]], cache: Path,
                timeout_s: float = 3600.0) -> dict[str, dict[str, Any]]:
    """REV's compiled kernels, in a process of its own: {case label: {ok, object_path, prefix,
    error}} ({} when the stage does not exist at REV)."""
    code_root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DSV4_LAB_ROOT": str(old_root), "DSV4_LAB_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(code_root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory(prefix="dsv4-ab-") as tmp:
        out = Path(tmp) / "rev.json"
        proc = subprocess.run([sys.executable, "-m", "harness.execution.abbench", str(old_root), stage_id, arch,
                               json.dumps(cases), str(out)], cwd=old_root, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        if proc.returncode != 0 or not out.is_file():
            why = (proc.stderr.strip().splitlines() or ["no result"])[-1]
            raise BenchError(f"--compare: could not compile {stage_id} at that commit: {why}")
        return json.loads(out.read_text())


def _emit(root: str, stage_id: str, arch: str, cases: list[dict[str, Any]], out: str) -> int:
    """The REV side, in its own process: compile each shape, write {label: result} to `out`."""
    from harness.execution.compile import Compiler
    from harness.spec.spec import load_spec

    sys.path.insert(0, root)
    spec = load_spec(root=Path(root))
    if stage_id not in spec.stages or arch not in spec.stages[stage_id].kernels:
        Path(out).write_text("{}")
        return 0
    st = spec.stages[stage_id]
    compiler = Compiler(Path(root))
    try:
        futures = [(case_label(c), compiler.submit(st, arch, c)) for c in cases]
        got = {}
        for label, fut in futures:
            r = fut.result()
            got[label] = {"ok": r.ok, "object_path": r.object_path, "prefix": r.prefix, "error": r.error}
    finally:
        compiler.close()
    Path(out).write_text(json.dumps(got))
    return 0


def main(root: Path, stage: Stage, pairs: list[tuple[str, str]], rev: str, rounds: int = abtest.DEFAULT_ROUNDS,
         reps: int = 5, timeout_s: float = 600.0, seed: int = 0, gpu: int = 0, argv: list[str] | None = None,
         cases: list[dict[str, Any]] | None = None, done: list | None = None,
         rev_tree: tuple[str, Path] | None = None, log: Any = None) -> int:
    """Plan, take REV's tree, then (with a GPU) compile, check and time both interleaved, record.
        0 only when every shape was compared. `cases`: these bench shapes instead of the filters'
        (the speed gate); `done`: gets the records; `rev_tree`: (REV's sha, its tree already taken);
        `log`: an open session (run_id, write) the records go to (the caller starts and ends it)."""
    from rich.console import Console

    from harness.core.environment import gpu_capabilities

    console = Console(highlight=False, soft_wrap=True, markup=False)
    cases = cases if cases is not None else plan_cases(stage, pairs)
    sha = rev_tree[0] if rev_tree is not None else rev_commit(root, rev)
    threshold = stage.bench_plan.speed_tolerance if stage.bench_plan is not None else abtest.DEFAULT_THRESHOLD
    console.print(f"{stage.name} bench --compare {rev} ({sha[:12]}): {len(cases)} shape(s), {rounds} interleaved "
                  f"rounds each, threshold {threshold * 100:g} %")
    for case in cases:
        console.print(f"  {case_label(case)}")
    with tempfile.TemporaryDirectory(prefix="dsv4-compare-") as tmp:
        if rev_tree is None:
            old_root = take_tree(root, rev, sha, Path(tmp) / "tree")
            console.print(f"{rev} ({sha[:12]}): its stages.yaml, stages/ and oracles/ taken into a temporary tree")
        elif (rev_tree[1] / "stages.yaml").is_file():
            old_root = rev_tree[1]
            console.print(f"{rev} ({sha[:12]}): its stages.yaml, stages/ and oracles/ as sent, in {old_root}")
        else:
            raise BenchError(f"--compare {rev}: its tree was not sent ({rev_tree[1]} has no stages.yaml)")
        caps = gpu_capabilities()
        if not caps:
            console.print("no GPU here: nothing was timed (run dsv4-lab bench --compare on the GPU machine)")
            return 1
        if gpu not in caps:
            raise BenchError(f"--gpu {gpu}: no such GPU (this machine has {', '.join(map(str, sorted(caps)))})")
        arch = caps[gpu][1]
        if arch not in stage.kernels:
            console.print(f"{stage.name} has no kernel for {arch} (GPU {gpu}: {caps[gpu][0]}): nothing was timed")
            return 1
        return _compare(console, root, stage, arch, cases, rev, sha, old_root, rounds, reps, threshold, timeout_s,
                        seed, gpu, argv, done if done is not None else [], log)


def _compare(console, root: Path, stage: Stage, arch: str, cases: list[dict[str, Any]], rev: str, sha: str,
             old_root: Path, rounds: int, reps: int, threshold: float, timeout_s: float, seed: int, gpu: int,
             argv: list[str] | None, done: list, log: Any = None) -> int:
    from harness.execution.bench import _job, run_job
    from harness.execution.compile import Compiler
    from harness.execution.executor import ABJob
    from harness.execution.roofline import read_peaks, roofline_fields
    from harness.notebook.records import BENCH_NOTE, Record, RunLog, now_iso
    from harness.spec.identity import code_identity

    console.print(f"compiling {len(cases)} shape(s) at {rev} and in the working tree …")
    old = compile_rev(old_root, stage.id, arch, cases, cache_dir(root))
    if not old:
        console.print(f"{stage.name} ({arch}) does not exist at {rev}: nothing to compare with")
        return 1
    own = log is None  # else the caller's session: it starts and ends it
    if own:
        log = RunLog(root)
        log.plan(target="local", argv=argv or [], cases=len(cases), bench=True)
        log.start()
    code = code_identity(root, stage, arch)
    compiler = Compiler(root)
    counts: dict[str, int] = {}
    warn: list[str] = []
    compared = 0
    interrupted = False
    try:
        futures = [compiler.submit(stage, arch, case) for case in cases]
        for case, fut in zip(cases, futures):
            res, label = fut.result(), case_label(case)
            a_res = old.get(label) or {"ok": False, "error": f"no such bench shape at {rev}"}
            common: dict[str, Any] = dict(id=f"{log.run_id}.{len(done) + 1}", run=log.run_id, t="", stage=stage.id,
                                          arch=arch, case=case, code=code, gpu=gpu, note=BENCH_NOTE)
            block: dict[str, Any] = {"rev": rev, "commit": sha[:12]}
            if not res.ok:
                rec = Record(**common, status="compile_error", error=res.error, compile=res.summary(), compare=block)
            elif not a_res["ok"]:  # the tree's kernel built: nothing to compare it with (not its failure)
                rec = Record(**common, status="skipped", error=f"not compared: at {rev}: {a_res.get('error')}",
                             compile=res.summary(), compare=block)
            else:
                b = _job(stage, arch, case, False, reps, seed)
                b.object_path, b.prefix = res.object_path, res.prefix
                a = _job(stage, arch, case, False, reps, seed)
                a.object_path, a.prefix = a_res["object_path"], a_res["prefix"]
                out = run_job(root, ABJob(a=a, b=b, rounds=rounds, reps=reps, threshold=threshold), timeout_s, gpu)
                status, timing = out.get("status", "crash"), out.get("timing")
                if timing:  # the tree's time as a fraction of the roofline, as bench records it
                    peaks = read_peaks(root, timing.get("gpu_name", ""), warn)
                    timing.update(roofline_fields(timing.get("flops"), timing.get("bytes", 0), timing["us"], peaks,
                                                  stage.bench_plan.peak))
                if timing and out.get("rounds"):
                    c = abtest.compare(out["rounds"]["A"], out["rounds"]["B"], threshold=threshold, seed=seed)
                    block = compare_block(rev, sha, c, out["rounds"])
                    compared += 1
                elif status == "pass":
                    status, out["error"] = "skipped", "checked, not timed"
                rec = Record(**common, status=status if status != "error" else "crash",
                             metrics=out.get("metrics") or {}, timing=timing, error=out.get("error"),
                             trace=out.get("trace"), env=out.get("env") or {}, compile=res.summary(), compare=block)
            rec.t = now_iso()
            log.write(rec)
            done.append(rec)
            counts[rec.status] = counts.get(rec.status, 0) + 1
            console.print(compare_line(rec))
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted: the finished shapes are recorded")
        return 130
    finally:
        compiler.close(cancel=True)
        if own:
            log.close()
            log.end(interrupted, planned=len(cases), counts=counts)
    if own:
        console.print(f"records: results/records/{stage.id}.jsonl (run {log.run_id})")
    return 0 if compared == len(cases) else 1


def compare_line(rec: Any) -> str:
    """One shape's line: `hd=512,n=4096  REV 101.2 µs  tree 106.4 µs  B/A 1.051 [1.040, 1.062] slower`."""
    c = rec.compare or {}
    if "ratio" not in c:
        return f"  {case_label(rec.case)}  {rec.status}: {rec.error or 'not compared'}"
    return (f"  {case_label(rec.case)}  {c['rev']} {c['a_us']:.2f} µs  tree {c['b_us']:.2f} µs  "
            f"tree/{c['rev']} {c['ratio']:.3f} [{c['lo']:.3f}, {c['hi']:.3f}]  {c['verdict']}")


if __name__ == "__main__":
    try:
        sys.exit(_emit(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]))
    except Exception as exc:  # reported by the parent as one line
        print(f"{type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        sys.exit(1)
