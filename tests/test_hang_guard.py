"""`--debug-hangs`: off, PTX unchanged; on, timer bound and trap; cache key; `hang` replies."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from harness.execution.executor import launch_watching_hangs as _launch_watching_hangs
from harness.execution.worker import error_reply as _error_reply
from tests.conftest import ROOT

CASE = {"shape": "b4s2h128n256d64", "splits": 1}  # D2's smallest: 2 KV tiles a CTA

_PROBE = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
if {stub!r}:  # the tree as if the guard did not exist: no patch, no names
    import types
    import cutlass.cute as cute
    stub = types.ModuleType("stages.common.hang_guard")
    stub.enabled = lambda: False
    stub.name = lambda pipeline: ""
    stub.role = lambda what: None
    stub.mbarrier_wait = lambda bar, phase, pipeline, slot=0: cute.arch.mbarrier_wait(bar, phase)
    import stages.common
    sys.modules["stages.common.hang_guard"] = stub
    stages.common.hang_guard = stub
import dataclasses
from harness.execution.compile import compile_case
from harness.spec.spec import KernelRef, load_spec
root = Path({root!r})
spec = load_spec(root=root)
d2 = spec.stages["D2"]
out = {{}}
for label, stage, debug in {builds!r}:
    if stage == "fixture":
        ref = KernelRef("sm_90a", "tests.fixtures.hang_d2.sm90", "Kernel", root / "tests/fixtures/hang_d2/sm90.py")
        st = dataclasses.replace(d2, kernels={{"sm_90a": ref}}, dir=ref.path.parent)
    else:
        st = d2
    r = compile_case(root, st, "sm_90a", {case!r}, debug_hangs=debug)
    out[label] = {{"ok": r.ok, "error": r.error, "ptx": Path(r.ptx_path).read_text() if r.ok else "",
                   "key": r.key, "summary": r.summary()}}
print("RESULT" + json.dumps(out))
"""


def _compile(tmp_path, builds, stub: bool = False) -> dict:
    script = tmp_path / f"probe_{'stub' if stub else 'tree'}.py"
    script.write_text(textwrap.dedent(_PROBE.format(root=str(ROOT), stub=stub, builds=builds, case=CASE)))
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx,cubin", "CUTE_DSL_DUMP_DIR": str(tmp_path),
           "DSV4_LAB_CACHE": str(tmp_path / f"cache_{stub}"), "PYTHONPATH": str(ROOT)}
    env.pop("DSV4_DEBUG_HANGS", None)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(line[len("RESULT"):])
    for label, r in out.items():
        assert r["ok"], (label, r["error"])
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hang_guard")
    tree = _compile(tmp, [("off", "D2", False), ("on", "D2", True), ("fixture_on", "fixture", True)])
    stub = _compile(tmp, [("stub_off", "D2", False)], stub=True)
    return {**tree, **stub}


def test_flag_off_is_the_build_without_the_guard(builds):
    assert builds["off"]["ptx"] == builds["stub_off"]["ptx"]
    for word in ("globaltimer", "trap;", "vprintf"):
        assert word not in builds["off"]["ptx"]


def _formats(ptx: str) -> list[str]:
    """The printf format strings of a PTX module (global byte arrays)."""
    out = []
    for m in re.finditer(r"\.global \.align 1 \.b8 (\w+)\[\d+\] = \{([^}]*)\}", ptx):
        out.append(bytes(int(x) for x in m.group(2).split(",")).decode(errors="replace"))
    return out


def test_flag_on_bounds_every_wait_and_names_it(builds):
    on = builds["on"]["ptx"]
    assert on != builds["off"]["ptx"]
    assert "%globaltimer" in on and "trap;" in on
    # no unbounded wait left
    assert "10000000;" not in on.replace(" ", "")
    assert "10000000;" in builds["off"]["ptx"].replace(" ", "")
    lines = " | ".join(_formats(on))
    for want in ("role=mma pipeline=kv.full", "role=load pipeline=kv.empty", "role=mma pipeline=q.full",
                 "role=load pipeline=q.empty"):
        assert want in lines, lines
    assert "DSV4-HANG" in lines and "slot=%d phase=%d cta=(%d,%d,%d)" in lines
    assert "pipeline=unnamed" not in lines and "role=?" not in lines, lines


def test_planted_deadlock_fixture_builds_with_the_bound(builds):
    fx = builds["fixture_on"]["ptx"]
    assert "role=mma pipeline=kv.full" in " | ".join(_formats(fx))
    assert fx != builds["on"]["ptx"]  # the skipped arrive is in it


def test_flag_is_in_the_cache_key_and_the_summary(builds):
    assert builds["on"]["key"] != builds["off"]["key"]
    assert builds["on"]["summary"]["debug"] == "hangs"
    assert "debug" not in builds["off"]["summary"]


# -- the worker's side


class _FakeTorch:
    class cuda:
        @staticmethod
        def synchronize():
            raise RuntimeError("CUDA error: unspecified launch failure")


def test_a_hang_line_on_stdout_makes_the_case_a_hang():
    from harness.execution.hangs import KernelHang

    line = ("DSV4-HANG role=mma pipeline=kv.full slot=1 phase=0 cta=(0,0,2) tile=(0,0,2) warp=0 thread=0 "
            "waited_ns=4000000123")

    def launch():  # a device printf writes to fd 1
        os.write(1, f"{line}\n{line.replace('warp=0 thread=0', 'warp=1 thread=32')}\n".encode())

    with pytest.raises(KernelHang) as got:
        _launch_watching_hangs(launch, _FakeTorch)
    text = str(got.value)
    assert text.startswith("hang in a --debug-hangs build: " + line)
    assert "+1 more" in text and "unspecified launch failure" in text
    reply = _error_reply(got.value, ROOT, 1.0)
    assert reply["status"] == "hang" and reply["error"] == text


def test_a_crash_without_a_hang_line_stays_a_crash():
    with pytest.raises(RuntimeError) as got:
        _launch_watching_hangs(lambda: os.write(1, b"some kernel printf\n"), _FakeTorch)
    assert _error_reply(got.value, ROOT, 1.0)["status"] == "crash"


def test_hang_is_a_failing_status_that_ran():
    from harness.core.statuses import FAILING, RAN, STATUSES, STYLE

    assert "hang" in STATUSES and "hang" in FAILING and "hang" in RAN and "hang" in STYLE


def test_the_lab_and_the_kernels_agree_on_the_switch():
    from harness.execution import hangs

    src = (ROOT / "stages" / "common" / "hang_guard.py").read_text()
    assert f'ENV = "{hangs.ENV}"' in src and f'TAG = "{hangs.TAG}"' in src


def test_run_flag_reaches_the_run_and_its_records(fake_lab):
    """`run … --debug-hangs`: the start event says so; without the flag not."""
    from harness.notebook.records import runs_file
    from tests.conftest import run_cli

    r = run_cli(["run", "stage-OK", "--debug-hangs"], cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    plain = run_cli(["run", "stage-OK"], cwd=fake_lab)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    starts = [json.loads(ln) for ln in runs_file(fake_lab).read_text().splitlines()
              if json.loads(ln).get("event") == "start"]
    assert [s.get("debug") for s in starts[-2:]] == ["hangs", None]


def test_every_pipeline_and_bare_wait_in_the_kernels_goes_through_the_guard():
    """Over stages/: no unnamed pipeline, no bare mbarrier_wait."""
    bad = []
    for path in sorted((ROOT / "stages").rglob("*.py")):
        if path.name == "hang_guard.py":
            continue
        text = path.read_text()
        rel = path.relative_to(ROOT)
        for m in re.finditer(r"pipeline\.Pipeline\w+\.create\(", text):
            depth, i = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            if "name=" not in text[m.end():i]:
                bad.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: pipeline without name=")
        for m in re.finditer(r"cute\.arch\.mbarrier_wait\(", text):
            bad.append(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: bare cute.arch.mbarrier_wait")
    assert bad == []
