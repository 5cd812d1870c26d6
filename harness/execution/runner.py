"""Runs stages' matrices: compile (cached, parallel), execute each case in a worker with a timeout,
judge it, write its record the moment it ends.

A case whose arch this machine cannot run is recorded `compiled` with the reason, never passed.
With `only_new` (`run` without `--record`) it is not recorded again when its newest fresh record
says the same (compilerun.py's `same_facts`), and a run with nothing to run writes its events
only with its first record."""

from __future__ import annotations

import math
import os
import queue
import signal
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from harness.execution.compile import CompileResult, Compiler
from harness.execution.compilerun import newest_builds, same_facts
from harness.core.environment import gpu_capabilities, host_environment
from harness.spec.identity import code_identity
from harness.core.labels import case_label
from harness.spec.matrix import Case
from harness.execution.metrics import judge
from harness.execution.pristine import describe as describe_input_writes
from harness.notebook.records import Record, RunLog, now_iso, runs_file, stage_file, status_counts
from harness.spec.spec import Spec, Stage
from harness.core.statuses import FAILING
from harness.execution.executor import Job, job_for
from harness.execution.worker import WorkerHandle



@dataclass
class Task:
    stage: Stage
    arch: str
    case: Case


@dataclass
class RunOptions:
    tasks: list[Task]
    bench: bool = False
    gpus: list[int] | None = None  # None: every visible GPU that can run the arch
    workers_per_gpu: int = 1
    target: str = "local"
    seed: int = 0
    timeout_s: float | None = None  # overrides the stages' own
    argv: list[str] = field(default_factory=list)
    only_new: bool = False  # a compiled-not-run case that repeats its newest fresh record is not written
    debug_hangs: bool = False  # build with bounded mbarrier waits; an expired one is a `hang` (harness/execution/hangs.py)
    prepare: bool = False  # a case of an arch no GPU here runs: its host path up to the launch on one that is here


class RunSetupError(Exception):
    """The run cannot start (a GPU that is not there, results that cannot be written): one line."""


# Signals that end a run the way Ctrl-C does, and the exit code each gives (128 + signal).
STOP_SIGNALS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class RunInterrupted(BaseException):
    """Raised in the main thread by the run's signal handler (first signal only)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class RunSummary:
    run_id: str
    records: list[Record]
    interrupted: bool = False
    no_device_reason: dict[str, str] = field(default_factory=dict)
    planned: int = 0
    errors: list[str] = field(default_factory=list)  # what broke the run itself
    signum: int | None = None

    @property
    def counts(self) -> dict[str, int]:
        return status_counts(self.records)

    @property
    def missing(self) -> int:
        """Planned cases with no record (never 0 < missing on a clean run)."""
        return max(0, self.planned - len(self.records))

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return STOP_SIGNALS.get(self.signum or signal.SIGINT, 130)
        if self.errors or self.missing:
            return 1
        return 1 if any(r.status in FAILING for r in self.records) else 0


def not_runnable_reason(arch: str, caps: dict[int, tuple[str, str | None]]) -> str:
    short = arch.removesuffix("a")
    if not caps:
        return f"compiled, not run: no GPU on this machine (needs {short})"
    names = sorted({n for n, _ in caps.values()})
    return f"compiled, not run: no {short} device (this machine has {', '.join(names)})"


class Runner:
    """One run: owns the compiler pools, the worker processes and the record writer.  Each planned
        case gets a record, or the run says why not and exits non-zero.  SIGINT, SIGTERM, SIGHUP:
        workers and compilers killed, records kept, the run marked interrupted, exit 128 + signal."""

    def __init__(self, spec: Spec, opts: RunOptions, on_record: Callable[[Record], None] | None = None,
                 emit: Callable[[str], None] | None = None, results_root: Path | None = None):
        """`emit`: send each record's JSON line there instead of writing it (remote mode);
                `results_root`: the lab whose results/ receives records."""
        if opts.workers_per_gpu < 1:
            raise RunSetupError(f"--workers-per-gpu {opts.workers_per_gpu}: must be at least 1")
        if opts.timeout_s is not None and not (math.isfinite(opts.timeout_s) and opts.timeout_s > 0):
            raise RunSetupError(f"--timeout {opts.timeout_s:g}: must be a finite number of seconds > 0")
        self.spec = spec
        self.root = spec.root
        self.results_root = results_root or spec.root
        self.opts = opts
        self.log = RunLog(self.results_root)  # the run id, the record writer, the run's events
        self.run_id = self.log.run_id
        self.on_record = on_record or (lambda r: None)
        self.writer = self.log.writer
        self.emit = emit
        self.records: list[Record] = []
        self.errors: list[str] = []
        self.files_written: set[Path] = set()
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._cleaning = False
        self._signum: int | None = None
        self._end_interrupted = False
        self._identity: dict[tuple[str, str], dict] = {}
        self._workers: list[WorkerHandle] = []
        self._threads: list[threading.Thread] = []
        self._newest: dict[tuple, Record] = {}  # only_new: the newest fresh build record of each idle case
        self._prepare_archs: set[str] = set()  # `--prepare`: archs whose cases go up to the launch here
        self._lazy_start = False  # only_new with nothing to run here: the start event waits for a record
        self.unchanged: set[str] = set()  # ids of the records that said it all already (not written again)

    # -- records ---------------------------------------------------------------------------

    def _record(self, task: Task, status: str, **kw: Any) -> Record:
        with self._lock:
            key = (task.stage.id, task.arch)
            if key not in self._identity:
                self._identity[key] = code_identity(self.root, task.stage, task.arch)
            rec = Record(
                id=f"{self.run_id}.{self._seq + 1}", run=self.run_id, t=now_iso(), stage=task.stage.id,
                arch=task.arch, case=task.case.dict, status=status, code=self._identity[key],
                target=self.opts.target, **kw,
            )
            old = self._newest.get((task.stage.id, task.arch, case_label(task.case.dict)))
            if old is not None and same_facts(old, rec):  # nothing new: the record that says it stands
                rec.id = old.id
                self.unchanged.add(rec.id)
            elif self.emit is not None:
                self._seq += 1
                self.emit(rec.to_json())
            else:
                self._seq += 1
                self.log.write(rec)
                self.files_written.add(stage_file(self.results_root, rec.stage))
            self.records.append(rec)
        self.on_record(rec)
        return rec

    def _fail(self, what: str) -> None:
        """An error in the run itself (not in a case): stop and say so."""
        with self._lock:
            self.errors.append(what)
        self._stop.set()

    # -- the run ---------------------------------------------------------------------------

    def _check_writable(self) -> None:
        """Fail before compiling when the records cannot be written (a lazily started run checks
                without writing)."""
        if self.emit is not None:
            return
        self.log.plan(target=self.opts.target, argv=self.opts.argv, cases=len(self.opts.tasks), bench=self.opts.bench,
                      **({"debug": "hangs"} if self.opts.debug_hangs else {}))
        if self._lazy_start:
            paths = [runs_file(self.results_root)] + [stage_file(self.results_root, s)
                                                       for s in sorted({t.stage.id for t in self.opts.tasks})]
            for path in paths:
                there = path if path.exists() else next((p for p in path.parents if p.exists()), path.parent)
                if not os.access(there, os.W_OK):
                    raise RunSetupError(f"cannot write the lab's records: {there}: not writable — make results/ "
                                        "writable")
            return
        try:
            self.log.start()
            for stage in sorted({t.stage.id for t in self.opts.tasks}):
                self.writer.open(stage)
        except OSError as exc:
            raise RunSetupError(f"cannot write the lab's records: {exc.filename or ''}: "
                                f"{exc.strerror or exc} — make results/ writable") from None

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signum is None:
            self._signum = signum
        self._stop.set()
        if not self._cleaning:
            self._cleaning = True  # a second signal during the clean-up is noted, not raised
            raise RunInterrupted(signum)

    def run(self) -> RunSummary:
        caps = gpu_capabilities()
        if self.opts.gpus is not None:
            absent = [g for g in self.opts.gpus if g not in caps]
            if absent and caps:
                raise RunSetupError(f"--gpus: no GPU {', '.join(map(str, absent))} on this machine "
                                    f"(it has {', '.join(map(str, sorted(caps)))})")
            caps = {i: c for i, c in caps.items() if i in self.opts.gpus}
        runnable_archs = {"cpu"} | {a for _, a in caps.values() if a}
        reasons = {t.arch: not_runnable_reason(t.arch, caps) for t in self.opts.tasks if t.arch not in runnable_archs}
        idle = [t for t in self.opts.tasks if t.arch not in runnable_archs]
        self._prepare_archs = self._set_up_prepare(caps, idle, reasons)
        idle = [t for t in idle if t.arch not in self._prepare_archs]  # prepared cases are worked, not idle
        if self.opts.only_new and self.emit is None and idle:
            for t in idle:
                if (t.stage.id, t.arch) not in self._identity:
                    self._identity[(t.stage.id, t.arch)] = code_identity(self.root, t.stage, t.arch)
            self._newest = newest_builds(self.results_root, idle,
                                         {k: v["src"] for k, v in self._identity.items()})
            self._lazy_start = len(idle) == len(self.opts.tasks)
        self._check_writable()

        main_thread = threading.current_thread() is threading.main_thread()
        previous = {}
        if main_thread:
            # a signal the lab was started with ignored (nohup: SIGHUP) stays ignored
            previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS
                        if signal.getsignal(s) is not signal.SIG_IGN}
        compiler = Compiler(self.root, debug_hangs=self.opts.debug_hangs)
        ready: queue.Queue = queue.Queue()
        interrupted = False
        try:
            futures = [(t, self._submit(compiler, t)) for t in self.opts.tasks]
            self._threads = self._start_workers(caps, runnable_archs, ready)
            # Hand each case to the workers as soon as its compile is done (in order).
            for task, fut in futures:
                if self._stop.is_set():
                    break
                res = self._compile_result(fut, task)
                if res is None:
                    break
                if not res.ok:
                    self._record(task, "compile_error", error=res.error, trace=res.trace or None,
                                 compile=res.summary(), env=host_environment())
                elif task.arch in self._prepare_archs:  # `--prepare`: up to the launch on a GPU of another arch
                    ready.put((task, res))
                elif task.arch not in runnable_archs:
                    self._record(task, "compiled", compile=res.summary(),
                                 env=host_environment(), note=reasons[task.arch])
                else:
                    ready.put((task, res))
            for _ in self._threads:
                ready.put(None)
            for th in self._threads:
                while th.is_alive() and not self._stop.is_set():
                    th.join(0.2)
        except RunInterrupted:
            interrupted = True
        except Exception as exc:  # e.g. records that can no longer be written
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self._cleaning = True
            self._stop.set()
            interrupted = interrupted or self._signum is not None
            try:
                self._shut_down(compiler, ready, kill=interrupted or bool(self.errors))
            finally:
                # After an interruption the process is on its way out: further stop signals
                # are ignored (also while the interpreter shuts down) so nothing cuts the
                # report or the exit short; otherwise the previous handlers come back.
                # a signal during the shut-down, before the end event says so, counts too
                interrupted = interrupted or self._end_interrupted
                if main_thread:
                    for s, h in previous.items():
                        signal.signal(s, signal.SIG_IGN if interrupted else h)
        return RunSummary(self.run_id, self.records, interrupted, reasons, planned=len(self.opts.tasks),
                          errors=list(self.errors), signum=self._signum)

    def _set_up_prepare(self, caps, idle: list[Task], reasons: dict[str, str]) -> set[str]:
        """`--prepare`: the archs whose cases go to a GPU of another arch (prepare.py; the interposer
                built for the workers).  Without a GPU they stay `compiled`, the reason saying so."""
        if not self.opts.prepare or not idle:
            return set()
        if not caps:
            for arch in {t.arch for t in idle}:
                reasons[arch] += " — --prepare needs a GPU here (of any arch) to prepare on"
            return set()
        from harness.core.paths import cache_dir
        from harness.execution.prepare import ENV, PrepareError, build_shim

        try:
            os.environ[ENV] = str(build_shim(cache_dir(self.root) / "prepare"))  # the workers load it at start
        except PrepareError as exc:
            raise RunSetupError(str(exc)) from None
        return {t.arch for t in idle}

    def _shut_down(self, compiler: Compiler, ready: queue.Queue, kill: bool) -> None:
        for w in self._workers:
            try:
                w.kill() if kill else w.close()
            except Exception:  # a worker already gone
                pass
        for _ in self._threads:  # idle serving threads wait for work: release them
            ready.put(None)
        for th in self._threads:  # a killed worker's case returns at once and is dropped
            th.join(5)
        try:
            compiler.close(cancel=kill)
        except Exception:
            pass
        self.writer.close()
        signum = self._signum
        self._end_interrupted = signum is not None  # what the end event says: the exit code agrees
        if self.emit is None and not self.log.started and self._end_interrupted:
            try:  # a stopped run is recorded as such, even one that wrote no record yet
                self.log.start()
            except OSError:
                pass
        if self.emit is None and self.log.started:
            try:
                self.log.end(self._end_interrupted, signum or None,
                             **({"errors": self.errors[:5]} if self.errors else {}),
                             planned=len(self.opts.tasks), counts=status_counts(self.records))
            except OSError as exc:
                self.errors.append(f"the run's end could not be written: {exc}")

    def _submit(self, compiler: Compiler, task: Task) -> Future:
        if task.arch == "cpu":
            fut: Future = Future()
            fut.set_result(CompileResult(ok=True, key="cpu", arch="cpu", cached=True))
            return fut
        return compiler.submit(task.stage, task.arch, task.case.dict)

    def _compile_result(self, fut: Future, task: Task) -> CompileResult | None:
        """The compile's result (None when the run was stopped while waiting)."""
        while True:
            if self._stop.is_set():
                return None
            try:
                return fut.result(timeout=0.2)
            except FutureTimeout:
                continue
            except Exception as exc:  # the compiler process itself died
                return CompileResult(ok=False, key="", arch=task.arch,
                                     error=f"compiler process failed: {type(exc).__name__}: {exc}")

    def _start_workers(self, caps, runnable_archs: set[str], ready: queue.Queue) -> list[threading.Thread]:
        needs_gpu = any((t.arch in runnable_archs and t.arch != "cpu") or t.arch in self._prepare_archs
                        for t in self.opts.tasks)
        slots: list[int | None] = []
        if needs_gpu:
            for gpu in sorted(caps):
                slots += [gpu] * self.opts.workers_per_gpu
        if any(t.arch == "cpu" for t in self.opts.tasks) and not slots:
            slots = [None] * self.opts.workers_per_gpu
        threads = []
        for gpu in slots:
            handle = WorkerHandle(self.root, gpu)
            self._workers.append(handle)
            th = threading.Thread(target=self._serve, args=(handle, ready), daemon=True)
            th.start()
            threads.append(th)
        return threads

    def _serve(self, handle: WorkerHandle, ready: queue.Queue) -> None:
        """Serve cases to one worker until told to stop.  A failure here (not the case's) ends the run
                with an error saying what happened; after a stop it is quiet."""
        try:
            while not self._stop.is_set():
                item = ready.get()
                if item is None:
                    return
                self._serve_one(handle, *item)
        except BaseException as exc:
            if not self._stop.is_set():
                where = f"GPU {handle.gpu}" if handle.gpu is not None else "the CPU worker"
                self._fail(f"serving {where}: {type(exc).__name__}: {exc}")

    def _serve_one(self, handle: WorkerHandle, task: Task, res: CompileResult) -> None:
        s = task.stage
        job = job_for(s, task.arch, task.case.dict, self.opts.seed, Job,
                      peer=(s.peer.module, s.peer.name) if s.peer else None,
                      object_path=res.object_path, prefix=res.prefix, bench=self._bench_this(task),
                      debug_hangs=self.opts.debug_hangs, prepare=task.arch in self._prepare_archs)
        timeout = self.opts.timeout_s if self.opts.timeout_s is not None else s.timeout_s
        out = handle.run(job, timeout)
        if self._stop.is_set():  # interrupted: the case did not finish, it is not a crash
            return
        env = handle.env or host_environment()
        common = dict(compile=res.summary() if task.arch != "cpu" else None, env=env, gpu=handle.gpu)
        if "prepared" in out:  # up to the launch on a GPU of another arch: evidence, not a run
            self._record(task, "prepared", note=out.get("note"), **common)
        elif "metrics" in out:
            status, why = judge(s.tolerances_for(task.case.dict), out["metrics"])
            if status != "pass" and out.get("suite_why"):  # the suite's rule says what it saw
                why = "; ".join(filter(None, [why, *(f"{k}: {v}" for k, v in out["suite_why"].items())]))
            if out.get("wrote_inputs"):  # a kernel that writes its inputs fails, whatever its outputs
                status, why = "fail", "; ".join(filter(None, [describe_input_writes(out["wrote_inputs"]), why]))
            self._record(task, status, metrics=out["metrics"], timing=out.get("timing"), error=why, **common)
        else:
            status = out.get("status", "crash")
            status = "crash" if status == "error" else status
            self._record(task, status, error=out.get("error"), trace=out.get("trace"), **common)

    def _bench_this(self, task: Task) -> bool:
        if not self.opts.bench:
            return False
        want = task.stage.bench
        return all(task.case.dict.get(k) == v for k, v in want.items())


def tasks_for(stages: Iterable[Stage], archs: list[str] | None,
              cases_of: Callable[[Stage], list[Case]]) -> list[Task]:
    """Every (stage, arch, case) to run, stage by stage, arch by arch."""
    tasks = []
    for st in stages:
        for arch in st.kernels:
            if archs and arch not in archs:
                continue
            for case in cases_of(st):
                tasks.append(Task(st, arch, case))
    return tasks
