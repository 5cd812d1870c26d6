"""The worker process that executes cases, and the parent's handle on it: the one process
supervisor of `run`, `run --bench`, `bench` and the remote side.

The worker imports torch and CuTeDSL once, then serves jobs over a pipe through the case
executor (executor.py).  A CUDA error leaves the context unusable, so after reporting one
(`error_reply`, the one crash classifier) the worker exits and the parent starts a new one; a
job past its timeout is killed and reported.  A failure in the user's code comes back as one
line naming their file and line (core.userfault), the traceback under "trace".

A worker never outlives its starter: PR_SET_PDEATHSIG ties it to the serving thread that owns it,
and a watchdog thread exits it when its parent process is gone (any OS).  Each worker leads its
own process group, killed with it, so a process a case started never outlives the case."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from multiprocessing import get_context
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from harness.execution.executor import CaseExecutor, Job  # noqa: F401  (Job: the runner's job, named here too)

STARTUP_TIMEOUT_S = 180.0
TRACE_CHARS = 20000  # the tail of a traceback kept in a reply
WATCHDOG_S = 0.5  # how often a worker checks that its parent is alive
PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------------------
# Worker side: the case executor (harness/execution/executor.py) serving jobs over the pipe.

_Executor = CaseExecutor  # the name the tests and older callers know


def _die_with_parent(parent_pid: int | None) -> None:
    """Exit when the parent goes: PR_SET_PDEATHSIG on Linux (SIGKILL when the starting thread ends)
        and a watchdog thread that exits when the parent pid changes (any OS)."""
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


def error_reply(exc: BaseException, root: Path, seconds: float) -> dict:
    """The one-line error (the user's file:line), the full trace, and the status: "crash" for a CUDA
        error (the worker must exit), else "error" (both recorded as crash)."""
    from harness.spec.check import ContractError
    from harness.execution.hangs import KernelHang
    from harness.core.userfault import describe, full_trace, strip_ansi

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
        from harness.execution.prepare import load_shim

        shim = load_shim()  # `run --prepare`: the launch interposer, before CuTeDSL binds its runtime
        import torch

        env: dict[str, Any] = {}
        if torch.cuda.is_available():
            import cutlass  # noqa: F401  (import cost paid before the first case)

            if shim is not None:
                from harness.execution.prepare import point_at_runtime

                point_at_runtime(shim)  # the interposer forwards every call unless a prepare is on

            from harness.core.environment import gpu_environment

            torch.cuda.init()
            env = gpu_environment()
        conn.send({"ready": True, "env": env, "pid": os.getpid()})
    except Exception as exc:
        conn.send({"ready": False, "error": f"worker start failed: {type(exc).__name__}: {exc}"})
        return
    executor = CaseExecutor(Path(root))
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
            reply = error_reply(exc, Path(root), time.perf_counter() - t0)
            conn.send(reply)
            if reply["status"] in ("crash", "hang"):  # the CUDA context is unusable after a device fault
                os._exit(3)


# ---------------------------------------------------------------------------------------
# Parent side.


class WorkerHandle:
    """One worker process, (re)started on demand, pinned to one GPU (or none)."""

    def __init__(self, root: Path, gpu: int | None, what: str = "worker"):
        self.root = root
        self.gpu = gpu
        self.what = what  # how its messages name it ("bench process")
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
            raise RuntimeError(f"{self.what} did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            hello = parent.recv()
        except EOFError:
            code = self.proc.exitcode
            self.kill()
            raise RuntimeError(f"{self.what} died while starting (exit code {code})")
        if not hello.get("ready"):
            self.kill()
            raise RuntimeError(hello.get("error", f"{self.what} failed to start"))
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
            return {"status": "timeout", "error": f"no result within {timeout_s:g} s; {self.what} killed"}
        try:
            out = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            code = self.proc.exitcode
            self.kill()
            return {"status": "crash", "error": f"{self.what} died (exit code {code}{_signal_name(code)})"}
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
    """SIGKILL the process group `pid` leads (the worker's, from os.setpgrp): a group outlives its
        leader while a member lives and its id is not reused, so this is safe after reaping."""
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
