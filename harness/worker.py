"""Case execution in a worker process, and the parent's handle on that process.

The worker imports torch and CuTeDSL once, then serves cases over a pipe: inputs from the
stage's generator, outputs allocated and poisoned, the cached compiled kernel loaded and
launched, CUDA errors checked by a synchronize, the inputs compared bit for bit with a copy
kept before the launch (harness.pristine: a kernel that wrote one is named in the reply, and
the oracle runs on the inputs as generated), the oracle run, metrics returned. A CUDA
error leaves the context unusable, so after reporting one the worker exits and the parent
starts a new one. The parent bounds each case by a timeout: a hang is killed and reported.

A failure inside the user's code (input generator, oracle, kernel) comes back as one line
naming their file and line (harness.userfault), with the full traceback under "trace". What
the input generator and the oracle return is checked against `tensors(case)` before it is
used (harness.check): a wrong name, shape or dtype is a one-line error, never a silent pass.

A worker never outlives the process that started it: on Linux the kernel kills it when the
thread that started it ends (prctl PR_SET_PDEATHSIG — the runner starts each worker from the
serving thread that owns it, and stops using it when that thread ends), and a watchdog
thread exits it when its parent process is gone (any OS; a fallback). Each worker leads its
own process group; killing a worker (timeout, crash, a stopped run) or closing it kills the
group, so a process the case started never outlives the case.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from harness.launch import KernelJob, Launcher, attr

STARTUP_TIMEOUT_S = 180.0
TRACE_CHARS = 20000  # the tail of a traceback kept in a reply
WATCHDOG_S = 0.5  # how often a worker checks that its parent is alive
PR_SET_PDEATHSIG = 1


@dataclass(kw_only=True)
class Job(KernelJob):
    """A test case for a worker: the kernel's job, the stage's peer (run --bench), and whether to time."""

    peer: tuple[str, str] | None = None
    bench: bool = False
    debug_hangs: bool = False  # a --debug-hangs build: the launch's printed output is read (harness/hangs.py)
    prepare: bool = False  # a kernel of another arch: its host path up to the launch only (harness/prepare.py)


# ---------------------------------------------------------------------------------------
# Worker side.


class _Executor:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.launcher = Launcher()

    def run(self, job: Job) -> dict:
        import torch

        from harness.check import ContractError, inputs_problems, outputs_problems, specs_problems
        from harness.metrics import compare, poison_
        from harness.pristine import keep, restore, written

        if job.prepare:
            return self.prepare(job)
        device = "cpu" if job.arch == "cpu" else "cuda"
        tensors_fn, inputs_fn, oracle_fn = attr(job.tensors), attr(job.inputs), attr(job.oracle)
        specs = tensors_fn(job.case)
        bad = specs_problems(specs, tensors_fn, self.root)
        if bad:
            raise ContractError(bad[0])
        inputs = inputs_fn(job.case, job.seed, device)
        bad = inputs_problems(specs, inputs, inputs_fn, self.root)
        if bad:  # before the launch: a kernel fed the wrong shapes may fault the device
            raise ContractError(bad[0])

        def fresh_outputs() -> dict:
            """Outputs and scratch, poisoned: the kernel must write what it reads back."""
            return {
                s.name: poison_(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device))
                for s in specs if s.role in ("out", "scratch")
            }

        outputs = fresh_outputs()
        args = [inputs[s.name] if s.role == "in" else outputs[s.name] for s in specs]
        launch = self.launcher(job, args)
        kept = keep(inputs)  # the inputs as generated: the kernel must not write them
        if job.debug_hangs and device == "cuda":
            _launch_watching_hangs(launch, torch)
        else:
            launch()
            if device == "cuda":
                torch.cuda.synchronize()  # raises on a launch failure or illegal address
        wrote = written(inputs, kept)  # bit for bit; the runner fails the case when any changed
        restore(inputs, kept, wrote)  # the oracle sees the inputs as generated
        del kept
        ref = oracle_fn(inputs, job.case)
        bad = outputs_problems(specs, ref, oracle_fn, self.root)
        if bad:
            raise ContractError(bad[0])
        metrics = {s.name: compare(outputs[s.name], ref[s.name]).to_json() for s in specs if s.role == "out"}
        result: dict[str, Any] = {"metrics": metrics}
        if wrote:
            result["wrote_inputs"] = wrote
        if job.bench and device == "cuda":
            result["timing"] = self._bench(job, specs, inputs, fresh_outputs)
        return result

    def prepare(self, job: Job) -> dict:
        """A kernel built for another arch: its inputs on this GPU, its outputs allocated, its
        compiled host path run up to (not including) the launch (harness/prepare.py), the
        recorded launch checked against this device's limits.  {"prepared": what it got to,
        "note": …}; raises when the host path failed or the launch could not start."""
        import torch

        from harness.check import ContractError, inputs_problems, specs_problems
        from harness.metrics import poison_
        from harness.prepare import check_launch, describe, device_limits, run_host_path

        tensors_fn, inputs_fn = attr(job.tensors), attr(job.inputs)
        specs = tensors_fn(job.case)
        bad = specs_problems(specs, tensors_fn, self.root)
        if bad:
            raise ContractError(bad[0])
        inputs = inputs_fn(job.case, job.seed, "cuda")
        bad = inputs_problems(specs, inputs, inputs_fn, self.root)
        if bad:
            raise ContractError(bad[0])
        outputs = {s.name: poison_(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="cuda"))
                   for s in specs if s.role in ("out", "scratch")}
        args = [inputs[s.name] if s.role == "in" else outputs[s.name] for s in specs]
        got = run_host_path(self.launcher(job, args))
        torch.cuda.synchronize()  # nothing was launched: a sticky error would be the host path's
        why = check_launch(got, device_limits())
        if why:
            raise RuntimeError(f"prepare: the launch would not start: {'; '.join(why)}")
        return {"prepared": got, "note": describe(got, torch.cuda.get_device_name(), job.arch.removesuffix("a"))}

    def _bench(self, job: Job, specs, inputs: dict, fresh_outputs) -> dict:
        from harness.timing import bench, rotations

        total_bytes = sum(s.nbytes for s in specs)
        sets = []
        for i in range(rotations(total_bytes)):
            ins = inputs if i == 0 else {k: v.clone() for k, v in inputs.items()}
            outs = fresh_outputs()
            sets.append([ins[s.name] if s.role == "in" else outs[s.name] for s in specs])
        t = bench([self.launcher(job, a) for a in sets])
        secs = t["us"] * 1e-6
        flops = attr(job.flops)(job.case) if job.flops else None
        if flops:
            t["tflops"] = flops / secs / 1e12
        t["gbps"] = total_bytes / secs / 1e9
        if job.peer:  # the same computation written plainly in PyTorch, timed the same way
            peer = attr(job.peer)
            ins_sets = [{s.name: a[i] for i, s in enumerate(specs) if s.role == "in"} for a in sets]
            p = bench([(lambda ins=ins: peer(ins, job.case)) for ins in ins_sets])
            t["peer_us"] = p["us"]
            if flops:
                t["peer_tflops"] = flops / (p["us"] * 1e-6) / 1e12
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in t.items()}


def _launch_watching_hangs(launch, torch) -> None:
    """Launch and synchronize with the process's stdout captured: a bounded wait that expired
    printed its hang line there before it trapped (harness/hangs.py); that line makes the
    CUDA error a KernelHang."""
    from harness.hangs import DeviceOutput, KernelHang, describe, hang_lines

    failure: BaseException | None = None
    out = DeviceOutput()
    with out:
        try:
            launch()
            torch.cuda.synchronize()
        except Exception as exc:  # the trap's CUDA error (or any other: re-raised below)
            failure = exc
    lines = hang_lines(out.text)
    if lines:
        raise KernelHang(describe(lines[0], len(lines) - 1, failure)) from failure
    if failure is not None:
        raise failure


def _die_with_parent(parent_pid: int | None) -> None:
    """Exit when the parent goes: PR_SET_PDEATHSIG on Linux (the kernel sends SIGKILL when
    the thread that started this process ends), and a watchdog thread that exits when the
    parent process is gone (a changed parent pid), as a fallback on any OS."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if parent_pid is None:
        return
    if os.getppid() != parent_pid:  # the parent died before the above took effect
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(WATCHDOG_S)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _error_reply(exc: BaseException, root: Path, seconds: float) -> dict:
    """The one-line error (the user's file:line), the full trace, and the status."""
    from harness.check import ContractError
    from harness.hangs import KernelHang
    from harness.userfault import describe, full_trace, strip_ansi

    if isinstance(exc, KernelHang):  # the CUDA context is lost after the trap: the worker exits
        return {"error": str(exc)[:4000], "trace": full_trace(exc)[-TRACE_CHARS:], "status": "hang", "seconds": seconds}
    raw = strip_ansi(f"{type(exc).__name__}: {exc}").strip()
    cuda_error = "CUDA" in raw or "cuda" in (type(exc).__module__ or "") or "CUresult" in raw
    if isinstance(exc, ContractError):
        text = str(exc)
    elif cuda_error:
        text = raw
    else:
        text = describe(exc, root)
    return {
        "error": text[:4000],
        "trace": full_trace(exc)[-TRACE_CHARS:],
        "status": "crash" if cuda_error else "error",
        "seconds": seconds,
    }


def worker_main(conn: Connection, root: str, gpu: int | None, parent_pid: int | None = None) -> None:
    # Its own process group, first of all: whatever the case starts (a kernel or an oracle that
    # spawns a child) is in it, and the parent kills the whole group on a timeout or at the end,
    # so nothing outlives the case holding the run's stdout. The terminal's signals are the
    # parent's to handle.
    os.setpgrp()
    _die_with_parent(parent_pid)
    # Ctrl-C in a terminal reaches the whole process group: only the parent handles it (it
    # kills the workers and keeps what finished), so a worker never dies of it mid-case.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        from harness.prepare import load_shim

        shim = load_shim()  # `run --prepare`: the launch interposer, before CuTeDSL binds its runtime
        import torch

        env: dict[str, Any] = {}
        if torch.cuda.is_available():
            import cutlass  # noqa: F401  (import cost paid before the first case)

            if shim is not None:
                from harness.prepare import point_at_runtime

                point_at_runtime(shim)  # the interposer forwards every call unless a prepare is on

            from harness.environment import gpu_environment

            torch.cuda.init()
            env = gpu_environment()
        conn.send({"ready": True, "env": env, "pid": os.getpid()})
    except Exception as exc:
        conn.send({"ready": False, "error": f"worker start failed: {type(exc).__name__}: {exc}"})
        return
    executor = _Executor(Path(root))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            out = executor.run(job)
            out["seconds"] = time.perf_counter() - t0
            conn.send(out)
        except BaseException as exc:  # noqa: BLE001  SIGINT is ignored here: a KeyboardInterrupt or
            # SystemExit is the case's own code raising it — one line at its file:line, no traceback
            reply = _error_reply(exc, Path(root), time.perf_counter() - t0)
            conn.send(reply)
            if reply["status"] in ("crash", "hang"):  # the CUDA context is unusable after a device fault
                os._exit(3)


# ---------------------------------------------------------------------------------------
# Parent side.


class WorkerHandle:
    """One worker process, (re)started on demand, pinned to one GPU (or none)."""

    def __init__(self, root: Path, gpu: int | None):
        self.root = root
        self.gpu = gpu
        self.proc = None
        self.conn: Connection | None = None
        self.env: dict[str, Any] = {}
        self.starts = 0

    def _start(self) -> None:
        ctx = get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, str(self.root), self.gpu, os.getpid()),
                                daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self.starts += 1
        if not parent.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            hello = parent.recv()
        except EOFError:
            code = self.proc.exitcode
            self.kill()
            raise RuntimeError(f"worker died while starting (exit code {code})")
        if not hello.get("ready"):
            self.kill()
            raise RuntimeError(hello.get("error", "worker failed to start"))
        self.env = hello.get("env", {})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def run(self, job: Job, timeout_s: float) -> dict:
        """The worker's answer for `job`, or {"status": "crash"|"timeout", "error": ...}."""
        if not self.alive():
            self.kill()
            try:
                self._start()
            except RuntimeError as exc:
                return {"status": "crash", "error": str(exc)}
        assert self.conn is not None and self.proc is not None
        self.conn.send(job)
        if not self.conn.poll(timeout_s):
            self.kill()
            return {"status": "timeout", "error": f"no result within {timeout_s:g} s; worker killed"}
        try:
            out = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            code = self.proc.exitcode
            self.kill()
            return {"status": "crash", "error": f"worker died (exit code {code}{_signal_name(code)})"}
        if out.get("status") in ("crash", "hang"):
            self.proc.join(5)
            self.kill()
        return out

    def kill(self) -> None:
        """Kill the worker and its process group: a child the case started goes too (also one
        left behind by a worker that already exited)."""
        if self.proc is not None:
            pid = self.proc.pid
            _kill_group(pid)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            _kill_group(pid)  # a child forked in the moment before the first kill
        if self.conn is not None:
            self.conn.close()
        self.proc, self.conn = None, None

    def close(self) -> None:
        if self.alive() and self.conn is not None:
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (OSError, BrokenPipeError):
                pass
        self.kill()


def _kill_group(pid: int | None) -> None:
    """SIGKILL the process group `pid` leads (the worker's own, from os.setpgrp). A group
    outlives its leader while a member lives, and its id is not reused meanwhile, so this is
    safe after the worker was reaped; a worker killed before its setpgrp leads no group."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return ""
    try:
        return f", {signal.Signals(-code).name}"
    except ValueError:
        return ""
