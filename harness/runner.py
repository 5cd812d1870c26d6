"""Runs stages' matrices: compile (cached, parallel), execute each case in a worker process
with a timeout, judge it against the stage's tolerances, and write its record the moment
it ends.

Cases whose arch this machine cannot run are compiled and recorded as `compiled` with the
reason ("compiled, not run: no sm_100 device"): never as passed.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from harness.compile import CompileResult, Compiler
from harness.environment import gpu_capabilities, host_environment
from harness.identity import code_identity
from harness.matrix import Case
from harness.metrics import violations
from harness.records import Record, RecordWriter, append_event, new_run_id, now_iso, runs_file, status_counts
from harness.spec import Spec, Stage
from harness.worker import Job, WorkerHandle

from harness.statuses import FAILING  # noqa: E402  (re-exported for remote.py)


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


@dataclass
class RunSummary:
    run_id: str
    records: list[Record]
    interrupted: bool = False
    no_device_reason: dict[str, str] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return status_counts(self.records)

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return 1 if any(r.status in FAILING for r in self.records) else 0


def not_runnable_reason(arch: str, caps: dict[int, tuple[str, str | None]]) -> str:
    short = arch.removesuffix("a").replace("sm_", "sm_")
    if not caps:
        return f"compiled, not run: no GPU on this machine (needs {short})"
    names = sorted({n for n, _ in caps.values()})
    return f"compiled, not run: no {short} device (this machine has {', '.join(names)})"


class Runner:
    """One run: owns the compiler pools, the worker processes and the record writer."""

    def __init__(self, spec: Spec, opts: RunOptions, on_record: Callable[[Record], None] | None = None,
                 emit: Callable[[str], None] | None = None, results_root: Path | None = None):
        """`emit`: send each record's JSON line there instead of writing it (remote mode).
        `results_root`: the lab whose results/ receives records (default: the spec's)."""
        self.spec = spec
        self.root = spec.root
        self.results_root = results_root or spec.root
        self.opts = opts
        self.run_id = new_run_id()
        self.on_record = on_record or (lambda r: None)
        self.writer = RecordWriter(self.results_root)
        self.emit = emit
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._identity: dict[tuple[str, str], dict] = {}
        self._workers: list[WorkerHandle] = []
        self._threads: list[threading.Thread] = []

    # -- records ---------------------------------------------------------------------------

    def _record(self, task: Task, status: str, **kw: Any) -> Record:
        with self._lock:
            self._seq += 1
            key = (task.stage.id, task.arch)
            if key not in self._identity:
                self._identity[key] = code_identity(self.root, task.stage, task.arch)
            rec = Record(
                id=f"{self.run_id}.{self._seq}", run=self.run_id, t=now_iso(), stage=task.stage.id,
                arch=task.arch, case=task.case.dict, status=status, code=self._identity[key],
                target=self.opts.target, **kw,
            )
            if self.emit is not None:
                self.emit(rec.to_json())
            else:
                self.writer.write(rec)
            self.records.append(rec)
        self.on_record(rec)
        return rec

    def _judge(self, task: Task, metrics: dict[str, dict]) -> tuple[str, str | None]:
        why = []
        for out, tol in task.stage.tolerances.items():
            if out not in metrics:
                why.append(f"{out}: not produced")
                continue
            why += [f"{out}: {w}" for w in violations(metrics[out], tol)]
        return ("fail", "; ".join(why)) if why else ("pass", None)

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> RunSummary:
        caps = gpu_capabilities()
        if self.opts.gpus is not None:
            caps = {i: c for i, c in caps.items() if i in self.opts.gpus}
        runnable_archs = {"cpu"} | {a for _, a in caps.values() if a}
        reasons = {t.arch: not_runnable_reason(t.arch, caps) for t in self.opts.tasks if t.arch not in runnable_archs}

        if self.emit is None:
            append_event(runs_file(self.results_root), {
                "run": self.run_id, "t": now_iso(), "event": "start", "target": self.opts.target,
                "argv": self.opts.argv, "cases": len(self.opts.tasks), "bench": self.opts.bench,
            })
        compiler = Compiler(self.root)
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
                if not res.ok:
                    self._record(task, "compile_error", error=res.error, compile=res.summary(), env=host_environment())
                elif task.arch not in runnable_archs:
                    self._record(task, "compiled", compile=res.summary(),
                                 env=host_environment(), note=reasons[task.arch])
                else:
                    ready.put((task, res))
            for _ in self._threads:
                ready.put(None)
            for th in self._threads:
                while th.is_alive():
                    th.join(0.2)
        except KeyboardInterrupt:
            interrupted = True
            self._stop.set()
        finally:
            for w in self._workers:
                w.kill() if interrupted else w.close()
            if interrupted:  # idle serving threads wait for work: release them
                for _ in self._threads:
                    ready.put(None)
            for th in self._threads:  # a killed worker's case returns at once and is dropped
                th.join(5)
            compiler.close(cancel=interrupted)
            self.writer.close()
            if self.emit is None:
                append_event(runs_file(self.results_root), {
                    "run": self.run_id, "t": now_iso(), "event": "end", "interrupted": interrupted,
                    "counts": RunSummary(self.run_id, self.records).counts,
                })
        return RunSummary(self.run_id, self.records, interrupted, reasons)

    def _submit(self, compiler: Compiler, task: Task) -> Future:
        if task.arch == "cpu":
            fut: Future = Future()
            fut.set_result(CompileResult(ok=True, key="cpu", arch="cpu", cached=True))
            return fut
        return compiler.submit(task.stage, task.arch, task.case.dict)

    def _compile_result(self, fut: Future, task: Task) -> CompileResult:
        try:
            return fut.result()
        except Exception as exc:  # the compiler process itself died
            return CompileResult(ok=False, key="", arch=task.arch,
                                 error=f"compiler process failed: {type(exc).__name__}: {exc}")

    def _start_workers(self, caps, runnable_archs: set[str], ready: queue.Queue) -> list[threading.Thread]:
        needs_gpu = any(t.arch in runnable_archs and t.arch != "cpu" for t in self.opts.tasks)
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
        while not self._stop.is_set():
            item = ready.get()
            if item is None:
                return
            task, res = item
            s = task.stage
            job = Job(
                stage=s.id, arch=task.arch, case=task.case.dict, kernel_params=s.kernel_params,
                kernel_module=s.kernels[task.arch].module, kernel_entry=s.kernels[task.arch].entry,
                tensors=(s.tensors.module, s.tensors.name), inputs=(s.inputs.module, s.inputs.name),
                oracle=(s.oracle.module, s.oracle.name),
                flops=(s.flops.module, s.flops.name) if s.flops else None,
                peer=(s.peer.module, s.peer.name) if s.peer else None,
                seed=_seed(s.id, task.case.dict, self.opts.seed),
                object_path=res.object_path, prefix=res.prefix, bench=self._bench_this(task),
            )
            timeout = self.opts.timeout_s or s.timeout_s
            out = handle.run(job, timeout)
            if self._stop.is_set():  # interrupted: the case did not finish, it is not a crash
                return
            env = handle.env or host_environment()
            common = dict(compile=res.summary() if task.arch != "cpu" else None, env=env,
                          gpu=handle.gpu)
            if "metrics" in out:
                status, why = self._judge(task, out["metrics"])
                self._record(task, status, metrics=out["metrics"], timing=out.get("timing"), error=why, **common)
            else:
                status = out.get("status", "crash")
                status = "crash" if status == "error" else status
                self._record(task, status, error=out.get("error"), **common)

    def _bench_this(self, task: Task) -> bool:
        if not self.opts.bench:
            return False
        want = task.stage.bench
        return all(task.case.dict.get(k) == v for k, v in want.items())


def _seed(stage: str, case: dict, base: int) -> int:
    from oracles.common import case_seed

    return case_seed(stage, case, base)


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
