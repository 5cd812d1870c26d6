"""A compile session, recorded the way a run is: `dsv4-lab compile` and the gate's recompiles write
one record per case (status `compiled` or `compile_error`, the compile summary, code identity,
environment) and the run's start and end events.  No torch; CuTeDSL only in the compilers.

With `only_new` (`compile` without `--record`) a case whose newest fresh record already says the
same (source hash and compile summary) is not written again, and a session that writes nothing
writes no run events: results/ stays byte for byte.  A changed source has no fresh record, so it
is always recorded.

SIGINT, SIGTERM and SIGHUP stop a session as they stop a run: compilers killed, finished records
kept, the end event interrupted, `core.interrupts.Interrupted` raised (exit 128 + signal)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from harness.execution.compile import CompileResult, Compiler
from harness.core.environment import host_environment
from harness.spec.identity import code_identity
from harness.core.interrupts import Interrupted, StopGuard
from harness.spec.matrix import Case
from harness.core.labels import case_label
from harness.notebook.records import (Record, RunLog, code_src, new_run_id, newest_fresh_in_file, now_iso, shows_compile,
                             stage_file, status_counts)
from harness.spec.spec import Spec, Stage

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
    record: Record  # as written; when not written (`same_as`), as it would have been, with same_as's id
    same_as: str | None = None  # not written: the id of the newest fresh record that says the same


# What a compile summary holds that differs between two builds of the same thing.
_INCIDENTAL = ("s", "cached")


def same_facts(old: Record, new: Record) -> bool:
    """Whether record `new` (a build) says nothing that `old` (the newest fresh record showing a
        build) does not: the same source hash and every compile fact (resources, key, PTX and SASS
        inventories; not time nor cache flag). A fact this machine cannot tell (no ptxas, no SASS
        tools) leaves `old`'s standing; one `old` lacks is news."""
    if new.status != "compiled" or not new.compile or not old.compile:
        return False
    if old.status == "compile_error" or code_src(old) != code_src(new):
        return False
    return all(k in old.compile and old.compile[k] == v for k, v in new.compile.items() if k not in _INCIDENTAL)


def newest_builds(root: Path, jobs: Sequence[CompileJob], src: dict[tuple[str, str], str]) -> dict[tuple, Record]:
    """(stage, arch, case label) -> the newest record with the current source hash that says what
        compiling gave, for each job (CompileJob or runner Task).  Each records file is read from its
        newest line back until every case is found; a bad line is skipped."""
    out: dict[tuple, Record] = {}
    for stage in sorted({j.stage.id for j in jobs}):
        wanted = {(j.stage.id, j.arch, case_label(j.case.dict)): (src.get((j.stage.id, j.arch)), shows_compile)
                  for j in jobs if j.stage.id == stage}
        found, _ = newest_fresh_in_file(stage_file(root, stage), wanted,
                                        lambda rec: (rec.stage, rec.arch, case_label(rec.case)), [])
        out.update(found)
    return out


def compile_recorded(spec: Spec, jobs: list[CompileJob], argv: list[str],
                     on_done: Callable[[Compiled], None] | None = None,
                     write: bool = True, only_new: bool = False) -> tuple[str, list[Compiled]]:
    """Compile every job (parallel, cached), write a record per case as it finishes (job order),
        return the run id and the results. `write=False`: nothing is written. `only_new`: a record
        repeating the newest fresh one (`same_facts`) is not written (`Compiled.same_as` names it),
        and run events only with the first record written."""
    root = spec.root
    log = RunLog(root) if write else None  # write=False: a run id, and nothing written
    run_id = log.run_id if log is not None else new_run_id()
    if log is not None:
        log.plan(target="local", argv=argv, cases=len(jobs), compile_only=True)
        if not only_new:
            log.start()
    identity: dict[tuple[str, str], dict] = {}
    for job in jobs:
        key = (job.stage.id, job.arch)
        if key not in identity:
            identity[key] = code_identity(root, job.stage, job.arch)
    newest = newest_builds(root, jobs, {k: v["src"] for k, v in identity.items()}) if write and only_new else {}
    out: list[Compiled] = []
    seq = 0  # records numbered as they are written (a case not written takes no number)
    compiler = Compiler(root)
    interrupted = False
    guard = StopGuard().__enter__()  # SIGINT / SIGTERM / SIGHUP: Interrupted, then the clean-up below
    try:
        futures = [(job, compiler.submit(job.stage, job.arch, job.case.dict)) for job in jobs]
        for job, fut in futures:
            try:
                res = fut.result()
            except Exception as exc:  # the compiler process itself died
                res = CompileResult(ok=False, key="", arch=job.arch,
                                    error=f"compiler process failed: {type(exc).__name__}: {exc}")
            rec = Record(
                id=f"{run_id}.{seq + 1}", run=run_id, t=now_iso(), stage=job.stage.id, arch=job.arch,
                case=job.case.dict, status="compiled" if res.ok else "compile_error", compile=res.summary(),
                env=host_environment(), code=identity[(job.stage.id, job.arch)], error=res.error, trace=res.trace,
                note=NOTE if res.ok else None,
            )
            old = newest.get((job.stage.id, job.arch, case_label(job.case.dict)))
            same_as = old.id if old is not None and same_facts(old, rec) else None
            if same_as is not None:
                rec.id = same_as  # the record that says it: `dsv4-lab show` finds that one
            else:
                seq += 1
                if log is not None:
                    log.write(rec)
            done = Compiled(job, res, rec, same_as)
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
            if log is not None:
                log.close()
                signum = guard.signum
                if interrupted or signum is not None:
                    log.start()  # a stopped session is recorded as such, even one that wrote no record yet
                if log.started:
                    log.end(interrupted or signum is not None, signum, counts=status_counts([c.record for c in out]))
        finally:
            guard.release()
    if guard.signum is not None:  # a stop signal during the clean-up: the exit code still says so
        raise Interrupted(guard.signum)
    return run_id, out
