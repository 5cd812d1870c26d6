"""`prepared`: never a pass, run baseline or gate result; the interposer's "fake" mode."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from harness.notebook.records import Record
from harness.core.statuses import COMPILED, FAILING, PREPARED, RAN, STATUSES, STYLE
from harness.spec.identity import source_hash
from harness.spec.matrix import expand
from harness.spec.spec import load_spec
from tests.conftest import ROOT


def _rec(status: str, **kw) -> Record:
    return Record(id="r.1", run="r", t="2026-11-27T00:00:00Z", stage="D2", arch="sm_100a",
                  case={"shape": "b1s2h128n1152d512", "splits": 1}, status=status, **kw)


def test_prepared_is_a_status_of_its_own_and_never_a_run():
    assert "prepared" in STATUSES and PREPARED == ("prepared",) and "prepared" in STYLE
    assert "prepared" not in RAN and "prepared" not in FAILING and "prepared" not in COMPILED
    from harness.workflows.gate import RESULT_STATUSES

    assert "prepared" not in RESULT_STATUSES  # the gate never takes it as a run's verdict
    from harness.notebook.records import validate

    assert validate(_rec("prepared").to_dict()) is None


def test_summary_says_nothing_ran_when_cases_were_only_prepared():
    from harness.execution.report import summary_lines

    lines = summary_lines([_rec("prepared", note="prepared, not run: …")], False, {})
    text = "\n".join(lines)
    assert "1 prepared" in text
    assert "sm_100a: 1 case(s) prepared" in text and "Nothing was launched or verified" in text
    assert "No case ran on a GPU in this run." in text


def test_dashboard_shows_prepared_apart_from_compiled_and_from_a_run(project_root):
    from harness.workflows.dashboard import cell

    spec = load_spec(root=project_root)
    stage = spec.stages["D2"]
    src = source_hash(project_root, stage, "sm_100a")
    compiled = _rec("compiled", note="compiled, not run: no sm_100 device", code={"src": src})
    prepared = dataclasses.replace(_rec("prepared", note="prepared, not run: …", code={"src": src},
                                        env={"gpu": "NVIDIA H100 80GB HBM3"}), id="r.2")
    c = cell(spec, stage, "sm_100a", [compiled, prepared], {}, time.time())
    assert c.ran.startswith("◐ prepared on H100 80GB HBM3, not run") and c.style == "cyan", c.ran
    assert c.passed in ("", None) or "✓" not in str(c.passed)
    c = cell(spec, stage, "sm_100a", [compiled], {}, time.time())
    assert c.ran == "○ compiled, not run"


def test_baselines_never_take_a_prepared_record_as_a_run_result(tmp_path, monkeypatch):
    """A `prepared`-only case gets no run baseline; unrunnable, a compile-only one."""
    from harness.notebook import baselines
    from harness.notebook.records import RecordWriter
    from tests.conftest import copy_lab

    lab = copy_lab(tmp_path / "lab", results=False)
    spec = load_spec(root=lab)
    stage = spec.stages["D2"]
    case = expand(stage)[0]
    src = source_hash(lab, stage, "sm_100a")
    rec = dataclasses.replace(_rec("prepared", note="prepared, not run: …", code={"src": src},
                                   compile={"key": "k", "regs": 160, "spill": 0, "inv": {"all": 1}}),
                              case=case.dict)
    writer = RecordWriter(lab)
    writer.write(rec)
    writer.close()
    monkeypatch.setattr(baselines, "runnable_archs", lambda: {"cpu", "sm_90a", "sm_100a"})
    baselines.accept(spec, stage, ["sm_100a"], [case])
    assert baselines.load(lab) == []  # no pass: nothing to take as a run result
    monkeypatch.setattr(baselines, "runnable_archs", lambda: {"cpu"})
    baselines.accept(spec, stage, ["sm_100a"], [case])
    assert [b.kind for b in baselines.load(lab)] == ["compile"]


def test_run_prepare_without_a_gpu_says_so_and_records_compiled(fake_lab, monkeypatch):
    """No GPU: the cases stay `compiled` and the reason says why."""
    from harness.execution.runner import RunOptions, Runner, Task

    monkeypatch.setattr("harness.execution.runner.gpu_capabilities", lambda: {})
    spec = load_spec(root=fake_lab)
    stage = next(iter(spec.stages.values()))
    stage = dataclasses.replace(stage, kernels={"sm_100a": stage.kernels["cpu"]})
    monkeypatch.setattr("harness.execution.runner.Runner._submit", lambda self, compiler, task: _done())
    tasks = [Task(stage, "sm_100a", c) for c in expand(stage)[:1]]
    summary = Runner(spec, RunOptions(tasks=tasks, argv=["pytest"], prepare=True)).run()
    assert [r.status for r in summary.records] == ["compiled"]
    assert "--prepare needs a GPU here" in summary.no_device_reason["sm_100a"]
    assert summary.records[0].status != "prepared"


def _done():
    from concurrent.futures import Future

    from harness.execution.compile import CompileResult

    f = Future()
    f.set_result(CompileResult(ok=True, key="k", arch="sm_100a", cached=True))
    return f


def test_check_launch_refuses_what_a_device_would_not_start():
    from harness.execution.prepare import check_launch

    limits = {"max_threads": 1024, "max_grid_y": 65535, "max_grid_z": 65535, "smem_optin": 232448}
    ok = {"launches": 1, "grid": [2, 1, 4], "block": [320, 1, 1], "smem": 231424}
    assert check_launch(ok, limits) == []
    assert check_launch({**ok, "smem": 232449}, limits) == ["232449 bytes of dynamic shared memory > 232448 (the opt-in limit)"]
    assert check_launch({**ok, "launches": 0}, limits) == ["the host path made no launch"]
    assert check_launch({**ok, "block": [1056, 1, 1]}, limits) == ["1056 threads a block > 1024"]


_COMPILE = """
    import json, sys
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from harness.execution.compile import _fake_tensor, launch_smem_bytes
    from oracles.sparse_decode import tensors
    import stages.E_sparse_decode.sm100 as m

    case = {"b": 2, "config": "s1h64_m96bs64", "kv_format": "simple", "scenario": "plain", "splits": 1}
    k = m.Kernel(b=2, config=case["config"], kv_format="simple", splits=1)
    c = cute.compile(k, *[_fake_tensor(s) for s in tensors(case)], make_fake_stream())
    c.export_to_c(sys.argv[1], "kernel", function_prefix="pfx")
    print("META", json.dumps({"launch_smem": launch_smem_bytes(str(c.ir_module)), "want_grid": list(k.launch_grid()),
                              "threads": k.THREADS, "case": case}))
"""

_HOST_PATH = """
    import json, os, sys
    from harness.execution.prepare import build_shim, load_shim, run_host_path
    from pathlib import Path
    load_shim(str(build_shim(Path(sys.argv[1]))))  # before CuTeDSL binds its runtime
    import torch
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack
    from cutlass.cutlass_dsl.cuda_jit_executor import CudaDialectJitCompiledFunction
    import cuda.bindings.driver as cuda
    from oracles.sparse_decode import make_inputs, tensors

    mode, runtime, case = sys.argv[2], sys.argv[3] or None, json.loads(sys.argv[4])
    fn = cute.runtime.load_module(os.path.join(sys.argv[1], "kernel.o"))["pfx"]
    CudaDialectJitCompiledFunction.num_devices = 1  # no GPU here
    specs = tensors(case)
    ins = make_inputs(case, 1)
    args = [from_dlpack(ins[s.name] if s.role == "in" else torch.zeros(s.shape, dtype=getattr(torch, s.dtype)),
                        assumed_align=16) for s in specs]
    try:
        got = run_host_path(lambda: fn(*args, cuda.CUstream(0)), mode=mode, runtime=runtime)
        print("GOT", json.dumps(got))
    except Exception as exc:
        print("RAISED", type(exc).__name__, str(exc)[:200])
"""

# Stand-in CUDA runtime: refuses the arch (209), aborts on unknown handles.
# DRIVER_REFUSES: load | lookup | other (error 2).
_DRIVER = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
static char lib_obj, kernel_obj;
static const char *how(void) { const char *w = getenv("DRIVER_REFUSES"); return w ? w : "load"; }
static void mine(void *h, void *want) { if (h != want) abort(); }
int _cudaGetDevice(int *d) { *d = 0; return 0; }
int _cudaDeviceGetAttribute(int *v, int a, int d) { *v = a == 97 ? 232448 : 0; return 0; }
int _cudaLibraryLoadData(void **lib, const void *c, void *a, void *b, unsigned n, void *e, void *f, unsigned m) {
  if (!strcmp(how(), "load")) return 209;
  if (!strcmp(how(), "other")) return 2;
  *lib = &lib_obj; return 0;
}
int _cudaLibraryGetKernel(void **k, void *lib, const char *name) { mine(lib, &lib_obj); return 209; }
int _cuKernelGetAttribute(int *v, int attr, void *k, int dev) { mine(k, &kernel_obj); return 0; }
int _cudaFuncSetAttribute(void *k, int attr, int v) { mine(k, &kernel_obj); return 0; }
int _cudaKernelSetAttributeForDevice(void *k, int attr, int v, int dev) { mine(k, &kernel_obj); return 0; }
int _cudaLaunchKernelEx(void *cfg, void *fn, void **args) { abort(); }
int _cudaLaunchKernel(void *fn, uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t e, uint32_t f, void **g,
                      uint64_t s, void *st) { abort(); }
"""


@pytest.fixture(scope="module")
def e_sm100_object(tmp_path_factory):
    """E's sm100 kernel compiled for sm_100a as an object file, with smem, grid, threads."""
    d = tmp_path_factory.mktemp("e_sm100")
    (d / "compile.py").write_text(textwrap.dedent(_COMPILE))
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(d / "compile.py"), str(d)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert "META" in r.stdout, (r.stdout + r.stderr)[-3000:]
    (d / "host.py").write_text(textwrap.dedent(_HOST_PATH))
    return d, json.loads(r.stdout.split("META", 1)[1].strip().splitlines()[0])


def _host_path(obj, mode: str, runtime: str = "", **env_extra) -> tuple[str, dict | None, int]:
    d, meta = obj
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": str(ROOT), **env_extra}
    r = subprocess.run([sys.executable, str(d / "host.py"), str(d), mode, runtime, json.dumps(meta["case"])],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    got = json.loads(out.split("GOT", 1)[1].strip().splitlines()[0]) if "GOT" in r.stdout else None
    return out, got, r.returncode


def test_the_host_path_of_e_sm100_runs_up_to_the_launch_under_the_interposer(e_sm100_object):
    """Fake interposer: one launch with the compile's grid, threads, smem; no driver raises."""
    out, got, _ = _host_path(e_sm100_object, "prepare")
    assert "RAISED" in out and got is None, out[-3000:]  # never a false `prepared`
    out, got, _ = _host_path(e_sm100_object, "fake")
    meta = e_sm100_object[1]
    assert got is not None, out[-3000:]
    assert got["launches"] == 1 and got["refused"] == 0, got
    assert got["grid"] == meta["want_grid"] and got["block"] == [meta["threads"], 1, 1], got
    assert [got["smem"]] == meta["launch_smem"], got


@pytest.mark.parametrize("refuses, calls", [("load", 1 | 2 | 4 | 8), ("lookup", 2 | 4 | 8)])
def test_a_refused_library_or_kernel_is_never_handed_to_the_driver(e_sm100_object, tmp_path, refuses, calls):
    """A refused image's handle is never forwarded."""
    lib = tmp_path / "libdriver.so"
    (tmp_path / "driver.c").write_text(_DRIVER)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "driver.c")], check=True)
    out, got, rc = _host_path(e_sm100_object, "prepare", str(lib), DRIVER_REFUSES=refuses, DSV4_PREPARE_TRACE="1")
    assert rc == 0 and got is not None, out[-3000:]
    meta = e_sm100_object[1]
    assert got["launches"] == 1 and got["refused_calls"] == calls and got["refusal"] == 209, got
    assert got["grid"] == meta["want_grid"] and [got["smem"]] == meta["launch_smem"], got
    assert "not forwarded" in out, out[-2000:]


def test_an_error_that_is_no_arch_refusal_fails_the_host_path(e_sm100_object, tmp_path):
    """A driver error not about the arch fails the host path: nothing `prepared`."""
    lib = tmp_path / "libdriver.so"
    (tmp_path / "driver.c").write_text(_DRIVER)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "driver.c")], check=True)
    out, got, rc = _host_path(e_sm100_object, "prepare", str(lib), DRIVER_REFUSES="other")
    assert got is None and "RAISED" in out, out[-3000:]
