"""A compile session, recorded the way a run is: `dsv4-lab compile` and the gate (when it
recompiles a stale compile-only case) compile cases in the parallel, cached compiler and write
one record per case — status `compiled` or `compile_error`, the compile summary (resources and
instruction inventory), code identity and environment — plus the run's start and end events
in results/runs.jsonl. Nothing here imports torch; CuTeDSL only inside the compiler's workers.
SIGINT, SIGTERM and SIGHUP stop a session the way they stop a run: the compilers killed, the
finished records kept, the end event marked interrupted (with the signal), and
`harness.interrupts.Interrupted` raised for the caller (the command line exits 128 + signal).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Callable

from harness.compile import CompileResult, Compiler
from harness.environment import host_environment
from harness.identity import code_identity
from harness.interrupts import Interrupted, StopGuard
from harness.matrix import Case
from harness.records import Record, RecordWriter, append_event, new_run_id, now_iso, runs_file, status_counts
from harness.spec import Spec, Stage

NOTE = "compiled only (dsv4-lab compile): nothing was run"


@dataclass
class CompileJob:
    stage: Stage
    arch: str
    case: Case


@dataclass
class Compiled:
    job: CompileJob
    result: CompileResult
    record: Record


def compile_recorded(spec: Spec, jobs: list[CompileJob], argv: list[str],
                     on_done: Callable[[Compiled], None] | None = None,
                     write: bool = True) -> tuple[str, list[Compiled]]:
    """Compile every job (in parallel, cached), write a record per case as it finishes (in
    job order), and return the run id with what each gave. `write=False`: records are built
    but neither records nor run events are written (a comparison that must leave no trace)."""
    root = spec.root
    run_id = new_run_id()
    writer = RecordWriter(root) if write else None
    if write:
        append_event(runs_file(root), {"run": run_id, "t": now_iso(), "event": "start", "target": "local",
                                       "argv": argv, "cases": len(jobs), "compile_only": True})
    identity: dict[tuple[str, str], dict] = {}
    out: list[Compiled] = []
    compiler = Compiler(root)
    interrupted = False
    guard = StopGuard().__enter__()  # SIGINT / SIGTERM / SIGHUP: Interrupted, then the clean-up below
    try:
        futures = [(job, compiler.submit(job.stage, job.arch, job.case.dict)) for job in jobs]
        for seq, (job, fut) in enumerate(futures, 1):
            try:
                res = fut.result()
            except Exception as exc:  # the compiler process itself died
                res = CompileResult(ok=False, key="", arch=job.arch,
                                    error=f"compiler process failed: {type(exc).__name__}: {exc}")
            key = (job.stage.id, job.arch)
            if key not in identity:
                identity[key] = code_identity(root, job.stage, job.arch)
            rec = Record(
                id=f"{run_id}.{seq}", run=run_id, t=now_iso(), stage=job.stage.id, arch=job.arch,
                case=job.case.dict, status="compiled" if res.ok else "compile_error", compile=res.summary(),
                env=host_environment(), code=identity[key], error=res.error, trace=res.trace,
                note=NOTE if res.ok else None,
            )
            if writer is not None:
                writer.write(rec)
            done = Compiled(job, res, rec)
            out.append(done)
            if on_done is not None:
                on_done(done)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        guard.quiet()  # a signal now is noted, never raised: the clean-up and the end event are not cut short
        try:
            compiler.close(cancel=interrupted or guard.signum is not None)
            if writer is not None:
                writer.close()
                signum = guard.signum
                append_event(runs_file(root), {
                    "run": run_id, "t": now_iso(), "event": "end", "interrupted": interrupted or signum is not None,
                    **({"signal": signal.Signals(signum).name} if signum is not None else {}),
                    "counts": status_counts([c.record for c in out])})
        finally:
            guard.release()
    if guard.signum is not None:  # a stop signal during the clean-up: the exit code still says so
        raise Interrupted(guard.signum)
    return run_id, out
