"""A user-code failure is one line at their file:line; trace kept; make_inputs/oracle results checked."""

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from harness.core.userfault import describe, full_trace, user_frame, where_defined
from tests.conftest import ROOT, make_fake_lab


def _module(root: Path, name: str, text: str):
    (root / f"{name}.py").write_text(textwrap.dedent(text))
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return name


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_innermost_user_frame_in_a_function(tmp_path):
    name = _module(tmp_path, "uf_func", """\
        def helper(x):
            return 1 / x

        def reference(inputs, case):
            return helper(0)
        """)
    mod = importlib.import_module(name)
    exc = _raised(lambda: mod.reference({}, {}))
    assert describe(exc, tmp_path) == "uf_func.py:2: in helper: ZeroDivisionError: division by zero"
    assert "Traceback" in full_trace(exc) and "uf_func.py" in full_trace(exc)


def test_at_import_and_syntax_error(tmp_path):
    name = _module(tmp_path, "uf_import", "x = 1\nraise RuntimeError('boom\\nsecond line')\n")
    exc = _raised(lambda: importlib.import_module(name))
    assert describe(exc, tmp_path) == "uf_import.py:2: at import: RuntimeError: boom"
    name = _module(tmp_path, "uf_syntax", "def f(:\n    pass\n")
    exc = _raised(lambda: importlib.import_module(name))
    assert describe(exc, tmp_path).startswith("uf_syntax.py:1: at import: SyntaxError:")


def test_harness_and_library_frames_are_never_blamed(tmp_path):
    # the user's line, not the library's
    name = _module(tmp_path, "uf_lib", "import json\n\ndef make_inputs(case, seed, device):\n    return json.loads('{')\n")
    mod = importlib.import_module(name)
    exc = _raised(lambda: mod.make_inputs({}, 0, "cpu"))
    assert describe(exc, tmp_path).startswith("uf_lib.py:4: in make_inputs: JSONDecodeError:")
    # the lab's harness/ is not user code
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "fake_runner.py").write_text("def call(fn):\n    return fn()\n")
    ns: dict = {}
    exec(compile((harness / "fake_runner.py").read_text(), str(harness / "fake_runner.py"), "exec"), ns)
    exc = _raised(lambda: ns["call"](lambda: mod.make_inputs({}, 0, "cpu")))
    assert user_frame(exc, tmp_path).file == "uf_lib.py"
    # no user frame: no location
    exc = _raised(lambda: ns["call"](lambda: int("x")))
    assert describe(exc, tmp_path) == "ValueError: invalid literal for int() with base 10: 'x'"


def test_ansi_colours_are_stripped(tmp_path):
    name = _module(tmp_path, "uf_ansi", "def f():\n    raise ValueError('\\x1b[31mred\\x1b[0m text')\n")
    exc = _raised(importlib.import_module(name).f)
    assert describe(exc, tmp_path) == "uf_ansi.py:2: in f: ValueError: red text"
    assert "\x1b" not in full_trace(exc)


def test_where_defined_names_the_def_line_past_decorators(tmp_path):
    name = _module(tmp_path, "uf_deco", """\
        import functools

        def deco(f):
            @functools.wraps(f)
            def inner(*a):
                return f(*a)
            return inner

        class K:
            @deco
            def __call__(self, a):
                return a
        """)
    mod = importlib.import_module(name)
    assert where_defined(mod.K.__call__, tmp_path) == "uf_deco.py:11"
    assert where_defined(mod.K, tmp_path) == "uf_deco.py:9"


# The worker.


def _job(lab: Path, **over):
    from harness.execution.worker import Job

    base = dict(stage="OK", arch="cpu", case={"n": 16}, kernel_params=("n",), kernel_module="stages.fake.cpu",
                kernel_entry="Add", tensors=("oracles.add", "tensors"), inputs=("oracles.add", "make_inputs"),
                oracle=("oracles.add", "reference"), flops=None, seed=1)
    base.update(over)
    return Job(**base)


BAD_ORACLES = '''
from oracles.common import TensorSpec
from oracles.add import tensors, make_inputs as good_inputs, reference as good_reference


def short_inputs(case, seed, device="cpu"):
    d = good_inputs(case, seed, device)
    d["b"] = d["b"][:-1]
    return d


def int_inputs(case, seed, device="cpu"):
    d = good_inputs(case, seed, device)
    d["a"] = d["a"].double()
    return d


def raising_reference(inputs, case):
    scale = {}["scale"]
    return {"out": inputs["a"] * scale}


def wrong_reference(inputs, case):
    return {"out": good_reference(inputs, case)["out"][:-2]}


def named_wrong(inputs, case):
    return {"Out": good_reference(inputs, case)["out"]}
'''


def test_worker_reports_user_faults_as_one_line_with_the_trace(tmp_path):
    from harness.execution.worker import WorkerHandle

    lab = make_fake_lab(tmp_path / "lab")
    bad = lab / "oracles" / "bad.py"
    bad.write_text(BAD_ORACLES)
    text = bad.read_text().splitlines()
    line = {name: next(i for i, t in enumerate(text, 1) if t.startswith(f"def {name}(")) for name in
            ("short_inputs", "int_inputs", "wrong_reference", "named_wrong")}
    raise_line = next(i for i, t in enumerate(text, 1) if '{}["scale"]' in t)
    h = WorkerHandle(lab, None)
    try:
        ok = h.run(_job(lab), 60)
        assert "metrics" in ok and ok["metrics"]["out"]["cosine"] > 0.9999
        cases = {
            "short_inputs": (dict(inputs=("oracles.bad", "short_inputs")),
                             f"oracles/bad.py:{line['short_inputs']}: short_inputs: 'b' has shape (15,), tensors() declares (16,)"),
            "int_inputs": (dict(inputs=("oracles.bad", "int_inputs")),
                           f"oracles/bad.py:{line['int_inputs']}: int_inputs: 'a' has dtype float64, tensors() declares float32"),
            "raising": (dict(oracle=("oracles.bad", "raising_reference")),
                        f"oracles/bad.py:{raise_line}: in raising_reference: KeyError: 'scale'"),
            "wrong_shape": (dict(oracle=("oracles.bad", "wrong_reference")),
                            f"oracles/bad.py:{line['wrong_reference']}: wrong_reference: 'out' has shape (14,), tensors() declares (16,)"),
            "wrong_name": (dict(oracle=("oracles.bad", "named_wrong")),
                           f"oracles/bad.py:{line['named_wrong']}: named_wrong: missing out; returned Out"),
            "kernel_raises": (dict(kernel_entry="Misbehave", case={"n": 16, "mode": "raise"}, kernel_params=("n", "mode")),
                              "stages/fake/cpu.py:"),
        }
        for what, (over, want) in cases.items():
            out = h.run(_job(lab, **over), 60)
            assert out.get("status") == "error", (what, out)
            assert out["error"].startswith(want), (what, out["error"])
            assert "\n" not in out["error"] and "Traceback" not in out["error"]
            assert "Traceback" in out["trace"], what
        assert h.starts == 1  # a user's fault does not cost the worker
    finally:
        h.close()


PARENT = r'''
import signal, sys, time
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a run started under nohup inherits SIGHUP ignored: this parent must die of it
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from harness.execution.worker import Job, WorkerHandle
h = WorkerHandle(Path(sys.argv[1]), None)
h._start()
h.conn.send(Job(stage="BAD", arch="cpu", case={"n": 16, "mode": "hang"}, kernel_params=("n", "mode"),
                kernel_module="stages.fake.cpu", kernel_entry="Misbehave", tensors=("oracles.add", "tensors"),
                inputs=("oracles.add", "make_inputs"), oracle=("oracles.add", "reference"), flops=None, seed=1))
time.sleep(1.0)  # the worker is inside the hanging case now, not waiting on the pipe
print(h.proc.pid, flush=True)
time.sleep(120)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_worker_dies_with_its_parent(tmp_path, sig):
    lab = make_fake_lab(tmp_path / "lab")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(lab)], stdout=subprocess.PIPE, text=True, env=env,
                              cwd=lab)
    pid = 0
    try:
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        parent.send_signal(sig)
        parent.wait(10)
        deadline = time.time() + 10
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"worker {pid} outlived its parent ({sig.name})"
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid and _alive(pid):  # never leave an orphan
            os.kill(pid, signal.SIGKILL)
