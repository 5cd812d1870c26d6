"""Compile checks and the on-disk compile cache.

A case is compiled against fake tensors (static shapes from `tensors(case)`), no GPU needed, and
cached under .cache/compile/<key>/ with its PTX, cubin, SASS (with the CUDA binary tools) and a
meta.json of the instruction inventory and resources.  The key covers the stage's source hash,
the kernel parameters, tensor specs, arch, CuTeDSL version and a visible GPU's SM count.
CuTeDSL reads its arch at import, so compiles run in per-arch worker processes (`Compiler`).
A failure in the user's code is a result, never a crash: one line naming the user's file:line
(core/userfault.py), the traceback kept in `trace`."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from harness.core.environment import cutedsl_version
from harness.execution.hangs import DEBUG_LABEL
from harness.execution.hangs import ENV as DEBUG_HANGS_ENV
from harness.spec.identity import source_hash
from harness.core.interrupts import start_resource_tracker
from harness.notebook.inventory import disassemble, find_tool, ptx_inventory, sass_inventory
from harness.core.paths import cache_dir
from harness.spec.spec import Stage
from harness.core.userfault import describe, full_trace

CACHE_FORMAT = 3  # bump when what a cache entry holds changes (3: detailed inventory, SASS, barriers, trace)


def visible_sm_count() -> int | None:
    """The SM count of CUDA device 0 by stages/common/device.py's rule, None without a GPU or that
        rule: a kernel compiled here is built for it, so it is part of the cache key."""
    try:
        from stages.common.device import visible_sm_count as sms
    except ImportError:
        return None
    return sms()


@dataclass
class CompileResult:
    ok: bool
    key: str
    arch: str
    cached: bool = False
    seconds: float = 0.0
    prefix: str = ""
    object_path: str = ""
    ptx_path: str = ""
    cubin_path: str = ""
    sass_path: str = ""
    inventory: dict[str, int] = field(default_factory=dict)  # PTX counters (harness/notebook/inventory.py)
    sass: dict[str, int] = field(default_factory=dict)  # SASS counters; empty without the tools
    resources: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # one line
    trace: str | None = None  # the full traceback of a failure in user code
    debug: str = ""  # "hangs": a --debug-hangs build (bounded mbarrier waits, stages/common/hang_guard.py)

    def summary(self) -> dict[str, Any]:
        """The compact form kept in a record: resources and, for a build, its inventory (`inv`, and
                `sass` with the CUDA binary tools): what a compile-only baseline holds."""
        d: dict[str, Any] = {"key": self.key[:12], "s": round(self.seconds, 2), "cached": self.cached}
        if self.debug:
            d["debug"] = self.debug
        d.update(self.resources)
        if self.ok:
            d["inv"] = dict(self.inventory)
            if self.sass:
                d["sass"] = dict(self.sass)
        return d


def tensor_specs(stage: Stage, case: dict[str, Any]) -> list:
    return _load_attr(stage.tensors.module, stage.tensors.name)(case)


def _load_attr(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def cache_key(root: Path, stage: Stage, arch: str, case: dict[str, Any], debug_hangs: bool = False) -> str:
    specs = tensor_specs(stage, case)
    payload = {
        "lab": CACHE_FORMAT,
        "src": source_hash(root, stage, arch),
        "arch": arch,
        "params": {k: case[k] for k in stage.kernel_params},
        "tensors": [s.to_json() for s in specs],
        "cute": cutedsl_version(),
        "entry": stage.kernels[arch].entry,
    }
    if debug_hangs:  # a different build: its own entry (a normal build's key is unchanged)
        payload["debug"] = DEBUG_LABEL
    sms = visible_sm_count()
    if sms is not None:  # kernels size their launch by the GPU's SM count (stages/common/device.py)
        payload["sm_count"] = sms
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def entry_dir(root: Path, key: str) -> Path:
    return cache_dir(root) / "compile" / key[:2] / key


def cached_result(root: Path, key: str) -> CompileResult | None:
    meta = entry_dir(root, key) / "meta.json"
    if not meta.is_file():
        return None
    try:
        d = json.loads(meta.read_text())
        res = CompileResult(**d)
    except (ValueError, TypeError):
        return None
    if res.ok and not Path(res.object_path).is_file():
        return None
    res.cached = True
    return res


def ptxas_resources(ptx_path: Path, arch: str) -> dict[str, Any]:
    """Registers, spills, stack, static shared memory and named barriers per the CUDA
    assembler, when it is installed (`ptxas -v`). Empty when it is not."""
    ptxas = find_tool("ptxas")
    if not ptxas:
        return {}
    try:
        out = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", str(ptx_path), "-o", os.devnull],
            capture_output=True, text=True, timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    text = out.stdout + out.stderr
    res: dict[str, Any] = {}
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    if regs:
        res["regs"] = max(regs)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if spills:
        res["spill"] = max(int(a) + int(b) for a, b in spills)
    stack = re.findall(r"(\d+) bytes stack frame", text)
    if stack:
        res["stack"] = max(int(x) for x in stack)
    smem = re.findall(r"(\d+) bytes smem", text)
    res["static_smem"] = max((int(x) for x in smem), default=0)
    barriers = re.findall(r"used (\d+) barriers", text)
    if barriers:
        res["barriers"] = max(int(x) for x in barriers)
    return res


def dynamic_smem_bytes(kernel) -> int | None:
    """A kernel's dynamic shared memory as it declares it: an int `smem_bytes`, or its `smem_struct`,
        set while tracing."""
    smem = getattr(kernel, "smem_bytes", None)
    if isinstance(smem, int):
        return smem
    struct = getattr(kernel, "smem_struct", None)
    try:
        return int(struct.size_in_bytes()) if struct is not None else None
    except Exception:
        return None


_LAUNCH_CONFIG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"  # grid, block, smem, …
_CONST = re.compile(r"(%[\w.]+) = llvm\.mlir\.constant\((\d+) : i64\) : i64")
_SMEM_FIELD = re.compile(r"(%[\w.]+) = llvm\.getelementptr %[\w.]+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, (.+)$")
_STORE = re.compile(r"llvm\.store (%[\w.]+), (%[\w.]+) : i64, !llvm\.ptr")


def launch_smem_bytes(ir_text: str) -> list[int]:
    """The dynamic shared memory of each kernel launch in a compiled module's lowered IR, in order:
        the constant CuTeDSL inferred and stored into the launch config (the bytes asked of the
        driver).  Empty when there is no such store (a run-time size)."""
    found: list[int] = []
    for func in ir_text.split("llvm.func ")[1:]:  # SSA names are per function
        consts: dict[str, int] = {}
        fields: set[str] = set()
        for line in func.splitlines():
            line = line.strip()
            if m := _CONST.match(line):
                consts[m.group(1)] = int(m.group(2))
            elif (m := _SMEM_FIELD.match(line)) and m.group(2).strip() == _LAUNCH_CONFIG:
                fields.add(m.group(1))
            elif (m := _STORE.match(line)) and m.group(2) in fields and m.group(1) in consts:
                found.append(consts[m.group(1)])
    return found


def fake_tensor(spec):
    """A CuTeDSL fake (compact, shape-only) tensor for a TensorSpec: what `compile` and `inspect` trace with."""
    import cutlass
    from cutlass.cute.runtime import make_fake_compact_tensor

    dtypes = {
        "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32,
        "int32": cutlass.Int32, "uint8": cutlass.Uint8, "float8_e4m3fn": cutlass.Float8E4M3FN,
    }
    order = tuple(range(len(spec.shape) - 1, -1, -1))  # row-major: last mode fastest
    return make_fake_compact_tensor(dtypes[spec.dtype], tuple(spec.shape), stride_order=order, assumed_align=16)


_fake_tensor = fake_tensor  # the name before it was public (tests/test_e_sm100.py reads it)


def failed(root: Path, arch: str, exc: BaseException, key: str = "", seconds: float = 0.0) -> CompileResult:
    """A compile that raised: one line naming the user's file:line, the traceback kept."""
    return CompileResult(ok=False, key=key, arch=arch, seconds=seconds, error=describe(exc, root),
                         trace=full_trace(exc), resources={})


def compile_case(root: Path, stage: Stage, arch: str, case: dict[str, Any], keep: Path | None = None,
                 debug_hangs: bool = False) -> CompileResult:
    """Compile one case for `arch` in this process (CUTE_DSL_ARCH must be `arch`), or return the
        cached result; never raises for the user's error.  `debug_hangs`: DSV4_DEBUG_HANGS=1."""
    try:
        key = cache_key(root, stage, arch, case, debug_hangs)
    except Exception as exc:  # the oracle's tensors(case) raised, or its module failed to import
        return failed(root, arch, exc)
    hit = cached_result(root, key)
    if hit is not None and keep is None:
        return hit
    if os.environ.get("CUTE_DSL_ARCH") != arch:
        raise RuntimeError(f"compile_case for {arch} in a process set up for {os.environ.get('CUTE_DSL_ARCH')}")
    out_dir = entry_dir(root, key)
    t0 = time.perf_counter()
    prefix = "dsv4_" + key[:16]
    was = os.environ.pop(DEBUG_HANGS_ENV, None)
    if debug_hangs:
        os.environ[DEBUG_HANGS_ENV] = "1"
    try:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_stream

        kref = stage.kernels[arch]
        kernel_cls = _load_attr(kref.module, kref.entry)
        kernel = kernel_cls(**{k: case[k] for k in stage.kernel_params})
        fakes = [fake_tensor(s) for s in tensor_specs(stage, case)]
        compiled = cute.compile(kernel, *fakes, make_fake_stream())
        # CUTE_DSL_KEEP=ptx,cubin (set per process) dumps both into CUTE_DSL_DUMP_DIR.
        # __ptx__ holds the PTX text, or the path of the dumped file, depending on the build.
        raw_ptx = compiled.__ptx__ or ""
        ptx_file = Path(raw_ptx) if raw_ptx and "\n" not in raw_ptx else None
        ptx = ptx_file.read_text() if ptx_file and ptx_file.is_file() else raw_ptx
        cubin = compiled.__cubin__ if isinstance(compiled.__cubin__, bytes) else b""
        if ptx_file:
            for dumped in ptx_file.parent.glob(ptx_file.name.rsplit(".", 2)[0] + ".*"):
                dumped.unlink(missing_ok=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        compiled.export_to_c(str(out_dir), "kernel", function_prefix=prefix)
        seconds = time.perf_counter() - t0
        (out_dir / "kernel.ptx").write_text(ptx)
        if cubin:
            (out_dir / "kernel.cubin").write_bytes(cubin)
        resources = ptxas_resources(out_dir / "kernel.ptx", arch) if ptx else {}
        smem = dynamic_smem_bytes(kernel)
        if smem is not None:
            resources["smem"] = smem + resources.get("static_smem", 0)
        sass_text = disassemble(out_dir / "kernel.cubin") if cubin else None
        if sass_text:
            (out_dir / "kernel.sass").write_text(sass_text)
        res = CompileResult(
            ok=True, key=key, arch=arch, seconds=seconds, prefix=prefix,
            object_path=str(out_dir / "kernel.o"), ptx_path=str(out_dir / "kernel.ptx"),
            cubin_path=str(out_dir / "kernel.cubin") if cubin else "",
            sass_path=str(out_dir / "kernel.sass") if sass_text else "",
            inventory=ptx_inventory(ptx), sass=sass_inventory(sass_text) if sass_text else {},
            resources=resources, debug=DEBUG_LABEL if debug_hangs else "",
        )
    except Exception as exc:  # the kernel's own compile error is a result, not a crash
        res = failed(root, arch, exc, key, time.perf_counter() - t0)
        if os.environ.get("DSV4_LAB_DEBUG"):
            traceback.print_exc()
    finally:
        os.environ.pop(DEBUG_HANGS_ENV, None)
        if was is not None:
            os.environ[DEBUG_HANGS_ENV] = was
    if res.ok:
        tmp_meta = out_dir / "meta.json.tmp"
        tmp_meta.write_text(json.dumps(asdict(res)))
        tmp_meta.replace(out_dir / "meta.json")
    if keep is not None and res.ok:
        keep.mkdir(parents=True, exist_ok=True)
        for name in ("kernel.ptx", "kernel.cubin", "kernel.sass"):
            src = out_dir / name
            if src.is_file():
                shutil.copy(src, keep / name)
    return res


# ---------------------------------------------------------------------------------------
# Parallel compiling: one process pool per arch (CuTeDSL's arch is per process).

_WORKER_STATE: dict[str, Any] = {}


def _init_worker(root: str, arch: str, scratch: str) -> None:
    """Set up a compile worker for `arch`; CuTeDSL dumps into the worker's own folder inside
        `scratch` (removed by `Compiler.close`)."""
    # Its own process group: a signal to the terminal's group (Ctrl-C, a hang-up) is the parent's
    # to handle, and the parent's stop kills the group, so a tool the compile started goes too.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="worker-", dir=scratch)
    if root not in sys.path:
        sys.path.insert(0, root)
    _WORKER_STATE["root"] = Path(root)


def _compile_job(stage: Stage, arch: str, case: dict[str, Any], debug_hangs: bool = False) -> CompileResult:
    return compile_case(_WORKER_STATE["root"], stage, arch, case, debug_hangs=debug_hangs)


class Compiler:
    """Compiles cases in parallel, a pool per arch sized to the cores; the workers' scratch folder
        (`dsv4-compile-*`) is removed by `close` or at exit."""

    def __init__(self, root: Path, max_workers: int | None = None, debug_hangs: bool = False):
        self.root = root
        self.debug_hangs = debug_hangs  # every case built with bounded mbarrier waits (harness/execution/hangs.py)
        self.max_workers = max_workers or max(1, os.cpu_count() or 1)
        self._pools: dict[str, ProcessPoolExecutor] = {}
        self._pending: dict[str, Future] = {}  # key -> future: one compile per key per run
        self._scratch: str | None = None
        self._remove_scratch: weakref.finalize | None = None

    def _scratch_dir(self) -> str:
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="dsv4-compile-")
            self._remove_scratch = weakref.finalize(self, shutil.rmtree, self._scratch, True)
        return self._scratch

    def _pool(self, arch: str) -> ProcessPoolExecutor:
        if arch not in self._pools:
            start_resource_tracker()  # deaf to a hang-up of the group, so the pool stops cleanly on one
            self._pools[arch] = ProcessPoolExecutor(
                max_workers=self.max_workers, mp_context=get_context("spawn"),
                initializer=_init_worker, initargs=(str(self.root), arch, self._scratch_dir()),
            )
        return self._pools[arch]

    def submit(self, stage: Stage, arch: str, case: dict[str, Any]) -> Future:
        """A future CompileResult; an already cached case resolves at once, without a pool."""
        try:
            key = cache_key(self.root, stage, arch, case, self.debug_hangs)
        except Exception as exc:  # the oracle's tensors(case) raised: a result, not a crash
            fut = Future()
            fut.set_result(failed(self.root, arch, exc))
            return fut
        if key in self._pending:
            return self._pending[key]
        hit = cached_result(self.root, key)
        if hit is not None:
            fut: Future = Future()
            fut.set_result(hit)
        else:
            fut = self._pool(arch).submit(_compile_job, stage, arch, case, self.debug_hangs)
        self._pending[key] = fut
        return fut

    def close(self, cancel: bool = False) -> None:
        """Shut the pools down; `cancel` (a stopped run): queued compiles dropped, running ones killed
                with their process groups, so the process exits at once."""
        try:
            for pool in self._pools.values():
                procs = list((getattr(pool, "_processes", None) or {}).values()) if cancel else []
                pool.shutdown(wait=not cancel, cancel_futures=cancel)
                for proc in procs:
                    _kill_group(proc.pid)
                    if proc.is_alive():
                        proc.kill()
                for proc in procs:
                    proc.join(5)
            self._pools.clear()
        finally:
            if self._remove_scratch is not None:  # the workers are gone: their scratch files go too
                self._remove_scratch()
                self._scratch = self._remove_scratch = None


def _kill_group(pid: int | None) -> None:
    """SIGKILL the process group a compile worker leads (nothing when it has none yet)."""
    if pid is None:
        return
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
