"""`prepared`: a compiled kernel's host path run up to (not including) its launch, on a GPU of
another arch (sm_100a kernels on an H100).

CuTeDSL 4.8.1's compiled host code (read from the lowered IR) encodes every TMA descriptor itself
(no cuTensorMapEncode* call), then on its first call loads the cubin as a CUDA library
(_cudaLibraryLoadData), finds the kernel (_cudaLibraryGetKernel), reads its static shared memory
(_cuKernelGetAttribute), sets the shared-memory and cluster attributes, and launches
(_cudaLaunchKernelEx), through libcute_dsl_runtime.so's wrappers.

An interposer (SHIM_SOURCE, built with the machine's C compiler and loaded RTLD_GLOBAL before
CuTeDSL) forwards every call to the real runtime, except while a prepare is active: then the
launch is recorded and NOT made, and a library, kernel or attribute call the driver refuses for
want of an image for this device is recorded and passed over (the record's note says what the
driver did and refused).  A refused library or kernel gets a handle of the interposer's own,
never passed to the runtime (a made-up handle is a crash); any other error fails the host path.
Everything else runs for real, and the recorded launch is checked against the device's limits
(threads per block, grid, opt-in shared memory: 232,448 bytes on H100 and B200).

Mode "fake" (CPU tests only) answers every runtime call itself: it proves the mechanism, not the
hardware."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

ENV = "DSV4_PREPARE_SHIM"  # the built interposer's path: a worker loads it before CuTeDSL
MODES = {"off": 0, "prepare": 1, "fake": 2}

SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { uint32_t grid[3]; uint32_t block[3]; uint64_t smem; void *stream; void *attrs; uint32_t nattrs; } cfg_t;
static int mode = 0;            /* 0 off: forward all; 1 prepare; 2 fake (no GPU: answer everything) */
static int launches = 0, refused = 0, last_refusal = 0, refused_calls = 0, trace = -1;
static uint32_t grid[3], block[3];
static uint64_t smem;
static void *rt = 0;
/* the handles given out for a library / kernel the driver refused: never passed to the runtime */
static char fake_lib_obj, fake_kernel_obj;
#define FAKE_LIB ((void *)&fake_lib_obj)
#define FAKE_KERNEL ((void *)&fake_kernel_obj)
#define NOT_MADE 98 /* cudaErrorInvalidDeviceFunction: what a refused kernel answers outside a prepare */

static void *real(const char *name) { return rt ? dlsym(rt, name) : 0; }
static void note(const char *call, int rc) {
  if (trace < 0) trace = getenv("DSV4_PREPARE_TRACE") != 0;
  if (trace) fprintf(stderr, "dsv4-prepare: mode %d %s -> %d\n", mode, call, rc);
}
int dsv4_prepare_runtime(const char *path) { rt = dlopen(path, RTLD_NOW | RTLD_LOCAL); return rt != 0; }
void dsv4_prepare_begin(int m) { mode = m; launches = refused = last_refusal = refused_calls = 0; }
void dsv4_prepare_end(void) { mode = 0; }
int dsv4_prepare_launches(void) { return launches; }
int dsv4_prepare_refused(void) { return refused; }
int dsv4_prepare_last_refusal(void) { return last_refusal; }
int dsv4_prepare_refused_calls(void) { return refused_calls; }
void dsv4_prepare_config(uint32_t *out) { memcpy(out, grid, 12); memcpy(out + 3, block, 12); }
uint64_t dsv4_prepare_smem(void) { return smem; }

/* Whether `rc` is the driver refusing a kernel image for want of one for this device's arch
   (no kernel image / invalid image / PTX too new or invalid / no such function on this device). */
static int arch_refusal(int rc) { return rc == 98 || rc == 200 || rc == 209 || rc == 218 || rc == 222; }

/* a call the driver refuses in prepare mode for want of an image for this device's arch: noted by which call
   (bit: 1 library load, 2 kernel lookup, 4 kernel attribute read, 8 attribute set), passed over; any other
   error is returned (the host path fails as it would) */
static int tolerate(int rc, int call) {
  if (mode == 1 && arch_refusal(rc)) { refused++; last_refusal = rc; refused_calls |= call; return 0; }
  return rc;
}
/* a call on a handle the driver never made (its library or kernel was refused): not forwarded */
static int passed_over(int call) {
  if (mode == 1) { refused++; refused_calls |= call; return 0; }
  return mode == 2 ? 0 : NOT_MADE;
}

static void record_launch(const uint32_t *g, const uint32_t *b, uint64_t dyn) {
  /* the first launch's grid and block (the kernel; a second is a split combine), the most shared memory */
  if (launches++ == 0) { memcpy(grid, g, 12); memcpy(block, b, 12); smem = 0; }
  if (dyn > smem) smem = dyn;
}
int _cudaLaunchKernelEx(cfg_t *cfg, void *fn, void **args) {
  if (mode == 0) {
    if (fn == FAKE_KERNEL) return NOT_MADE;
    int (*f)(cfg_t *, void *, void **) = real("_cudaLaunchKernelEx"); return f ? f(cfg, fn, args) : 35;
  }
  record_launch(cfg->grid, cfg->block, cfg->smem); note("_cudaLaunchKernelEx (not made)", 0);
  return 0;
}
int _cudaLaunchKernel(void *fn, uint32_t gx, uint32_t gy, uint32_t gz, uint32_t bx, uint32_t by, uint32_t bz,
                      void **args, uint64_t dyn, void *stream) {
  if (mode == 0) {
    if (fn == FAKE_KERNEL) return NOT_MADE;
    int (*f)(void *, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, void **, uint64_t, void *) =
        real("_cudaLaunchKernel");
    return f ? f(fn, gx, gy, gz, bx, by, bz, args, dyn, stream) : 35;
  }
  uint32_t g[3] = {gx, gy, gz}, b[3] = {bx, by, bz};
  record_launch(g, b, dyn); note("_cudaLaunchKernel (not made)", 0);
  return 0;
}
int _cudaLibraryLoadData(void **lib, const void *code, void *a, void *b, unsigned n, void *c, void *d, unsigned m) {
  if (mode == 2) { *lib = FAKE_LIB; return 0; }
  int (*f)(void **, const void *, void *, void *, unsigned, void *, void *, unsigned) = real("_cudaLibraryLoadData");
  int rc = f ? f(lib, code, a, b, n, c, d, m) : 35;
  note("_cudaLibraryLoadData", rc);
  if (rc && mode == 1 && arch_refusal(rc)) *lib = FAKE_LIB;
  return tolerate(rc, 1);
}
int _cudaLibraryGetKernel(void **k, void *lib, const char *name) {
  if (mode == 2) { *k = FAKE_KERNEL; return 0; }
  if (lib == FAKE_LIB) { *k = FAKE_KERNEL; note("_cudaLibraryGetKernel (refused library: not forwarded)", 0); return passed_over(2); }
  int (*f)(void **, void *, const char *) = real("_cudaLibraryGetKernel");
  int rc = f ? f(k, lib, name) : 35;
  note("_cudaLibraryGetKernel", rc);
  if (rc && mode == 1 && arch_refusal(rc)) *k = FAKE_KERNEL;
  return tolerate(rc, 2);
}
int _cuKernelGetAttribute(int *v, int attr, void *k, int dev) {
  if (mode == 2) { *v = 0; return 0; }
  if (k == FAKE_KERNEL) { *v = 0; note("_cuKernelGetAttribute (refused kernel: not forwarded)", 0); return passed_over(4); }
  int (*f)(int *, int, void *, int) = real("_cuKernelGetAttribute");
  int rc = f ? f(v, attr, k, dev) : 35;
  note("_cuKernelGetAttribute", rc);
  if (rc && mode == 1 && arch_refusal(rc)) *v = 0;
  return tolerate(rc, 4);
}
int _cudaDeviceGetAttribute(int *v, int attr, int dev) {
  if (mode == 2) { *v = attr == 97 ? 232448 : 0; return 0; }
  int (*f)(int *, int, int) = real("_cudaDeviceGetAttribute");
  return f ? f(v, attr, dev) : 35;
}
int _cudaGetDevice(int *d) {
  if (mode == 2) { *d = 0; return 0; }
  int (*f)(int *) = real("_cudaGetDevice");
  return f ? f(d) : 35;
}
int _cudaFuncSetAttribute(void *k, int attr, int v) {
  if (mode == 2) return 0;
  if (k == FAKE_KERNEL) { note("_cudaFuncSetAttribute (refused kernel: not forwarded)", 0); return passed_over(8); }
  int (*f)(void *, int, int) = real("_cudaFuncSetAttribute");
  int rc = f ? f(k, attr, v) : 35;
  note("_cudaFuncSetAttribute", rc);
  return tolerate(rc, 8);
}
int _cudaKernelSetAttributeForDevice(void *k, int attr, int v, int dev) {
  if (mode == 2) return 0;
  if (k == FAKE_KERNEL) { note("_cudaKernelSetAttributeForDevice (refused kernel: not forwarded)", 0); return passed_over(8); }
  int (*f)(void *, int, int, int) = real("_cudaKernelSetAttributeForDevice");
  int rc = f ? f(k, attr, v, dev) : 35;
  note("_cudaKernelSetAttributeForDevice", rc);
  return tolerate(rc, 8);
}
"""


class PrepareError(Exception):
    """The prepare mode cannot be set up here (one line)."""


def build_shim(cache: Path) -> Path:
    """The interposer as a shared library under `cache` (built once per source text)."""
    tag = hashlib.sha256(SHIM_SOURCE.encode()).hexdigest()[:12]
    lib = cache / f"libdsv4_prepare_{tag}.so"
    if lib.is_file():
        return lib
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise PrepareError("--prepare needs a C compiler (cc) to build its launch interposer; none is installed")
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / f"dsv4_prepare_{tag}.c"
    src.write_text(SHIM_SOURCE)
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp), str(src), "-ldl"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise PrepareError(f"--prepare: building the launch interposer failed: {(r.stderr or r.stdout).strip()[:300]}")
    tmp.replace(lib)
    return lib


_SHIM: ctypes.CDLL | None = None


def load_shim(path: str | None = None) -> ctypes.CDLL | None:
    """Load the interposer (RTLD_GLOBAL, before CuTeDSL loads any compiled module) and point it at the
        real libcute_dsl_runtime.so.  None when none is configured (`path` or $DSV4_PREPARE_SHIM)."""
    global _SHIM
    path = path or os.environ.get(ENV)
    if _SHIM is not None or not path:
        return _SHIM
    _SHIM = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _SHIM.dsv4_prepare_smem.restype = ctypes.c_uint64
    return _SHIM


def point_at_runtime(shim: ctypes.CDLL, runtime: str | None = None) -> None:
    """Give the interposer the runtime to forward to: CuTeDSL's libcute_dsl_runtime.so, or `runtime`
        (the CPU tests' stand-in); idempotent."""
    if runtime is None:
        from cutlass.runtime import find_runtime_libraries

        libs = [p for p in find_runtime_libraries(enable_tvm_ffi=False) if p.endswith("libcute_dsl_runtime.so")]
        runtime = libs[0] if libs else None
    if not runtime or not shim.dsv4_prepare_runtime(runtime.encode()):
        raise PrepareError("--prepare: libcute_dsl_runtime.so (CuTeDSL's runtime) was not found")


def run_host_path(launch, mode: str = "prepare", runtime: str | None = None) -> dict[str, Any]:
    """Call `launch()` (a case's compiled host function) with the interposer active: {"launches",
        "grid", "block" (the first launch's), "smem" (the most asked), "refused", "refusal" (the last
        refused call's error code)}.  PrepareError when the interposer is not loaded."""
    shim = _SHIM or load_shim()
    if shim is None:
        raise PrepareError("--prepare: the launch interposer is not loaded in this process")
    if mode != "fake":
        point_at_runtime(shim, runtime)
    shim.dsv4_prepare_begin(MODES[mode])
    try:
        launch()
    finally:
        shim.dsv4_prepare_end()
    cfg = (ctypes.c_uint32 * 6)()
    shim.dsv4_prepare_config(cfg)
    return {"launches": int(shim.dsv4_prepare_launches()), "grid": list(cfg[:3]), "block": list(cfg[3:]),
            "smem": int(shim.dsv4_prepare_smem()), "refused": int(shim.dsv4_prepare_refused()),
            "refusal": int(shim.dsv4_prepare_last_refusal()), "refused_calls": int(shim.dsv4_prepare_refused_calls())}


def check_launch(got: dict[str, Any], limits: dict[str, int]) -> list[str]:
    """Why the recorded launch would not start on a device with `limits` (max_threads, max_grid_y,
        max_grid_z, smem_optin); empty when it would.  No launch recorded is a problem too."""
    why = []
    if got["launches"] < 1:
        why.append("the host path made no launch")
        return why
    threads = got["block"][0] * got["block"][1] * got["block"][2]
    if threads > limits["max_threads"]:
        why.append(f"{threads} threads a block > {limits['max_threads']}")
    if got["grid"][1] > limits["max_grid_y"] or got["grid"][2] > limits["max_grid_z"]:
        why.append(f"grid {tuple(got['grid'])} past the device's y/z limits")
    if got["smem"] > limits["smem_optin"]:
        why.append(f"{got['smem']} bytes of dynamic shared memory > {limits['smem_optin']} (the opt-in limit)")
    return why


def device_limits() -> dict[str, int]:
    """This process's current CUDA device's launch limits."""
    from cuda.bindings import runtime as rt

    def attr(a) -> int:
        err, v = rt.cudaDeviceGetAttribute(a, 0)
        return int(v)

    A = rt.cudaDeviceAttr
    return {"max_threads": attr(A.cudaDevAttrMaxThreadsPerBlock), "max_grid_y": attr(A.cudaDevAttrMaxGridDimY),
            "max_grid_z": attr(A.cudaDevAttrMaxGridDimZ),
            "smem_optin": attr(A.cudaDevAttrMaxSharedMemoryPerBlockOptin)}


_CALLS = ((1, "cubin loaded as a library"), (2, "kernel found by name"), (4, "kernel attributes read"),
          (8, "shared-memory attributes set"))


def describe(got: dict[str, Any], device: str, arch: str) -> str:
    """The note of a `prepared` record: what the driver did, what it refused (no image for this
        device) and the launch reached, not made."""
    g, b = tuple(got["grid"]), got["block"][0]
    bits = got.get("refused_calls", 0)
    done = [what for bit, what in _CALLS if not bits & bit]
    refused = [what for bit, what in _CALLS if bits & bit]
    refused_text = (f"; refused by the driver for this device (error {got['refusal']}), passed over: "
                    f"{', '.join(refused)}") if refused else ""
    return (f"prepared, not run: host path up to the launch on {device} — TMA descriptors encoded from the "
            f"real tensors, {', '.join(done) or 'no driver call accepted'}{refused_text}; launch grid {g} × {b} "
            f"threads, {got['smem']} B dynamic shared memory, {arch}; not launched, nothing verified")
