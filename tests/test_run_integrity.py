"""No false green: a short run never exits 0; bad numbers: usage errors; signals: 128 + n, records kept."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.spec.matrix import expand
from harness.notebook.records import read_records, read_runs
from harness.execution.runner import RunOptions, Runner, RunSetupError, tasks_for
from harness.spec.spec import load_spec
from tests.conftest import ROOT, run_cli


@pytest.mark.parametrize("flags", [
    ["--workers-per-gpu", "0"], ["--workers-per-gpu", "-3"], ["--timeout", "inf"], ["--timeout", "nan"],
    ["--timeout", "-1"], ["--timeout", "0"], ["--gpus", "x"], ["--gpus", "0,0"], ["--shard", "2/2"],
])
def test_bad_numeric_options_are_one_line_usage_errors(fake_lab, flags):
    r = run_cli(["run", "stage-OK", *flags], cwd=fake_lab)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stdout + r.stderr
    assert not read_records(fake_lab), "nothing may run"


def test_records_that_cannot_be_written_stop_the_run_before_it_starts(fake_lab):
    (fake_lab / "results" / "records" / "OK.jsonl").mkdir(parents=True)   # a folder where the file goes
    r = run_cli(["run", "stage-OK"], cwd=fake_lab)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot write the lab's records" in r.stderr and "Traceback" not in r.stdout + r.stderr


def _runner(lab: Path, stage: str = "OK", **kw) -> Runner:
    spec = load_spec(root=lab)
    st = spec.stages[stage]
    return Runner(spec, RunOptions(tasks=tasks_for([st], None, lambda s: expand(s)), argv=["pytest"], **kw))


def test_an_error_in_a_serving_thread_fails_the_run_and_says_what_happened(fake_lab, monkeypatch):
    def broken(self, handle, task, res):
        raise PermissionError(13, "Permission denied", str(fake_lab / "results" / "records" / "OK.jsonl"))

    monkeypatch.setattr(Runner, "_serve_one", broken)
    summary = _runner(fake_lab).run()
    assert summary.exit_code == 1
    assert summary.errors and "PermissionError" in summary.errors[0]
    (run,) = read_runs(fake_lab).values()
    assert run["event"] == "end" and run["errors"] and run["planned"] == 2


def test_a_run_with_fewer_results_than_planned_never_exits_zero(fake_lab, monkeypatch):
    real = Runner._serve_one

    def drop_second(self, handle, task, res):
        if task.case.dict["n"] == 32:
            return  # lost without a trace
        real(self, handle, task, res)

    monkeypatch.setattr(Runner, "_serve_one", drop_second)
    summary = _runner(fake_lab).run()
    assert [r.status for r in summary.records] == ["pass"]
    assert summary.missing == 1 and summary.exit_code == 1


def test_runner_refuses_options_that_would_run_nothing(fake_lab):
    for kw in ({"workers_per_gpu": 0}, {"timeout_s": float("inf")}, {"timeout_s": float("nan")}, {"timeout_s": 0.0}):
        with pytest.raises(RunSetupError):
            _runner(fake_lab, **kw)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_hanging_run(lab: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "stage-BAD", "--mode", "ok,hang", "--timeout", "60"],
                            cwd=lab, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not read_records(lab):
        time.sleep(0.2)
    assert read_records(lab), "the ok case should be recorded while the hang case runs"
    time.sleep(0.5)
    return proc


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_a_stop_signal_to_the_run_ends_it_interrupted_with_no_orphan(fake_lab, sig, code):
    proc = _start_hanging_run(fake_lab)
    workers = _children(proc.pid)
    assert workers, "the run should have a worker process"
    os.kill(proc.pid, sig)          # the run alone: workers must not outlive it
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, out + err
    assert "Traceback" not in out + err
    (run,) = read_runs(fake_lab).values()
    assert run["event"] == "end" and run["interrupted"] is True and run["signal"] == signal.Signals(sig).name
    assert [r.case["mode"] for r in read_records(fake_lab)] == ["ok"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers), "a worker outlived its run"


def test_repeated_ctrl_c_during_the_clean_up_still_ends_the_run_properly(fake_lab):
    proc = _start_hanging_run(fake_lab)
    for _ in range(5):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err and "Bad file descriptor" not in out + err
    (run,) = read_runs(fake_lab).values()
    assert run["event"] == "end" and run["interrupted"] is True


def test_scratch_tensors_are_poisoned_workspace_never_compared(fake_lab):
    """Scratch is poisoned, never compared: relaying passes, reading unwritten gets NaN."""
    (fake_lab / "oracles" / "add.py").write_text((fake_lab / "oracles" / "add.py").read_text() + '''

def scratch_tensors(case):
    n = case["n"]
    return [TensorSpec("a", (n,), "float32"), TensorSpec("b", (n,), "float32"),
            TensorSpec("work", (2, n), "float32", "scratch"), TensorSpec("out", (n,), "float32", "out")]
''')
    (fake_lab / "stages" / "fake" / "cpu.py").write_text((fake_lab / "stages" / "fake" / "cpu.py").read_text() + '''

class ViaScratch:
    def __init__(self, *, n: int, write: bool):
        self.write = write

    def __call__(self, a, b, work, out):
        if self.write:
            work[0].copy_(a)
        out.copy_(work[0] + b)
''')
    (fake_lab / "stages.yaml").write_text((fake_lab / "stages.yaml").read_text() + '''
  SCR:
    title: out = a + b through a scratch buffer
    dir: stages/fake
    kernels: {cpu: {module: stages.fake.cpu, entry: ViaScratch}}
    tensors: oracles.add:scratch_tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix: {n: [16], write: [true, false]}
    tolerances: {out: {cosine_min: 0.9999}}
''')
    r = run_cli(["run", "stage-SCR"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    by = {rec.case["write"]: rec for rec in read_records(fake_lab, ["SCR"])}
    assert by[True].status == "pass" and set(by[True].metrics) == {"out"}
    assert by[False].status == "fail" and by[False].metrics["out"]["nonfinite"] + by[False].metrics["out"]["unwritten"] > 0
