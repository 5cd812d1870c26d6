"""`prepared` (issue 34 item 5), on the CPU: the status is its own thing — never a run, never a
pass, never a run baseline, never the gate's result, shown apart in the summary and the
dashboard — and `run --prepare` without a GPU says so and records `compiled`.  The mechanism
itself (harness/execution/prepare.py's launch interposer under CuTeDSL's real compiled host code) is run
here in its "fake" mode, which answers the CUDA runtime calls itself: stage E's sm100 host path
goes through descriptor encoding, library load, kernel lookup, attributes and stops at the
launch, whose grid, block and dynamic shared memory are those the compile inferred.  On an H100
the same path runs against the real driver: tests/test_prepare_gpu.py."""

from __future__ import annotations

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
    from harness.spec.identity import source_hash
    from harness.spec.spec import load_spec

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
    """`baseline accept` on a lab whose only record of a case is a fresh `prepared` one: even with
    the arch counted as runnable here, no run baseline comes of it (there is no pass); where the
    arch cannot run, what it gives is a compile-only baseline (its build facts), never a run one."""
    from harness.notebook import baselines
    from harness.spec.identity import source_hash
    from harness.spec.matrix import expand
    from harness.notebook.records import RecordWriter
    from harness.spec.spec import load_spec
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
    """No GPU here: nothing to prepare on — the cases stay `compiled` and the reason says why."""
    from harness.spec.matrix import expand
    from harness.execution.runner import RunOptions, Runner, Task
    from harness.spec.spec import load_spec

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


_HOST_PATH = """
    import json, os, sys
    from harness.execution.prepare import build_shim, load_shim, run_host_path
    from pathlib import Path
    load_shim(str(build_shim(Path(sys.argv[1]))))  # before CuTeDSL binds its runtime
    import torch
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack, make_fake_stream
    from cutlass.cutlass_dsl.cuda_jit_executor import CudaDialectJitCompiledFunction
    import cuda.bindings.driver as cuda
    from harness.execution.compile import _fake_tensor, launch_smem_bytes
    from oracles.sparse_decode import make_inputs, tensors
    import stages.E_sparse_decode.sm100 as m

    case = {"b": 2, "config": "s1h64_m96bs64", "kv_format": "simple", "scenario": "plain", "splits": 1}
    k = m.Kernel(b=2, config=case["config"], kv_format="simple", splits=1)
    specs = tensors(case)
    c = cute.compile(k, *[_fake_tensor(s) for s in specs], make_fake_stream())
    c.export_to_c(sys.argv[1], "kernel", function_prefix="pfx")
    fn = cute.runtime.load_module(os.path.join(sys.argv[1], "kernel.o"))["pfx"]
    CudaDialectJitCompiledFunction.num_devices = 1  # no GPU here: the fake runtime has one
    ins = make_inputs(case, 1)
    args = [from_dlpack(ins[s.name] if s.role == "in" else torch.zeros(s.shape, dtype=getattr(torch, s.dtype)),
                        assumed_align=16) for s in specs]
    try:  # the real runtime on a machine without a driver: a refusal that is not about the arch stops it
        run_host_path(lambda: fn(*args, cuda.CUstream(0)), mode="prepare")
        print("PREPARE_RETURNED")
    except Exception as exc:
        print("PREPARE_RAISED", type(exc).__name__)
    got = run_host_path(lambda: fn(*args, cuda.CUstream(0)), mode="fake")
    print("GOT", json.dumps({**got, "launch_smem": launch_smem_bytes(str(c.ir_module)),
                             "grid": got["grid"], "want_grid": list(k.launch_grid()), "threads": k.THREADS}))
"""


def test_the_host_path_of_e_sm100_runs_up_to_the_launch_under_the_interposer(tmp_path):
    """CuTeDSL's compiled host code of E sm100 (simple), on its real arguments, with the launch
    interposer in fake mode: one launch reached, not made, with the kernel's grid and threads and
    the dynamic shared memory the compile inferred.  In prepare mode against the real runtime
    (no driver here) a failing call that is not a foreign-arch refusal raises: no `prepared`."""
    path = tmp_path / "probe.py"
    path.write_text(textwrap.dedent(_HOST_PATH))
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(path), str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    out = r.stdout + r.stderr
    assert "GOT" in out, out[-3000:]
    assert "PREPARE_RAISED" in out and "PREPARE_RETURNED" not in out, out[-3000:]  # never a false `prepared`
    got = json.loads(out.split("GOT", 1)[1].strip().splitlines()[0])
    assert got["launches"] == 1 and got["refused"] == 0, got
    assert got["grid"] == got["want_grid"] and got["block"] == [got["threads"], 1, 1], got
    assert [got["smem"]] == got["launch_smem"], got
