"""Signals and leftovers (issue 27) with real processes, found by an env marker in /proc."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from harness.spec.matrix import MAX_RUN_CASES
from harness.notebook.records import read_records, read_runs
from tests.conftest import ROOT, run_cli, write_baselines

MARK = "DSV4_SIGNALS_TEST_MARK"


def _marked(token: str) -> list[int]:
    """Live processes whose environment carries MARK=token."""
    needle = f"{MARK}={token}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != "Z":
            out.append(int(entry.name))
    return out


def _wait_gone(token: str, seconds: float = 10) -> list[int]:
    deadline = time.monotonic() + seconds
    left = _marked(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _marked(token)
    return left


def _kill_marked(token: str) -> None:
    for pid in _marked(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _start(lab: Path, args: list[str], token: str, preexec=None, **extra_env) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), MARK: token, **extra_env}
    return subprocess.Popen([sys.executable, "-m", "cli", *args], cwd=lab, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=preexec)


def _add_stage(lab: Path, yaml_block: str, module: str, code: str) -> None:
    (lab / "stages" / "fake" / f"{module}.py").write_text(textwrap.dedent(code))
    with open(lab / "stages.yaml", "a") as f:
        f.write(textwrap.indent(textwrap.dedent(yaml_block), "  "))


# Item 11: a kernel's child process.

SPAWNING_KERNEL = '''\
    import subprocess
    import time


    class Spawn:
        """Starts a child that would live for ten minutes, then hangs (or returns, leaving it)."""

        def __init__(self, *, n: int, mode: str):
            self.mode = mode

        def __call__(self, a, b, out):
            subprocess.Popen(["sleep", "600"])
            if self.mode == "hang":
                time.sleep(3600)
            out.copy_(a + b)
    '''

SPAWN_STAGE = '''\
    SPAWN:
      title: a kernel that starts a child process
      dir: stages/fake
      kernels: {cpu: {module: stages.fake.spawn, entry: Spawn}}
      tensors: oracles.add:tensors
      inputs: oracles.add:make_inputs
      oracle: oracles.add:reference
      matrix: {n: [16], mode: [hang, leave]}
      kernel_params: [n, mode]
      tolerances: {out: {cosine_min: 0.9999}}
      timeout_s: 4
    '''


@pytest.mark.parametrize("mode, code, status", [("hang", 1, "timeout"), ("leave", 0, "pass")])
def test_a_process_the_kernel_starts_does_not_outlive_its_case(fake_lab, mode, code, status):
    """`hang`/`leave`: the kernel's child goes with the worker's group; `run … | tail` returns."""
    _add_stage(fake_lab, SPAWN_STAGE, "spawn", SPAWNING_KERNEL)
    token = uuid.uuid4().hex
    proc = _start(fake_lab, ["run", "stage-SPAWN", "--mode", mode], token)
    try:
        out, err = proc.communicate(timeout=120)  # a live `sleep` holds stdout
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_marked(token)
        pytest.fail("the run's stdout stayed open: a process the kernel started outlived the run")
    try:
        assert proc.returncode == code, out + err
        assert [r.status for r in read_records(fake_lab, ["SPAWN"])] == [status]
        assert _wait_gone(token, 5) == [], "a process the kernel started outlived its case"
    finally:
        _kill_marked(token)


# Item 12: nohup.


def _ignore_hangup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def test_a_run_started_with_sighup_ignored_keeps_going_on_a_hang_up(fake_lab):
    """`nohup dsv4-lab run`: SIGHUP ignored, the run finishes."""
    token = uuid.uuid4().hex
    proc = _start(fake_lab, ["run", "stage-BAD", "--mode", "ok,hang", "--timeout", "6"], token,
                  preexec=_ignore_hangup)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not read_records(fake_lab) and proc.poll() is None:
            time.sleep(0.2)
        assert read_records(fake_lab), "the ok case should be recorded while the hang case runs"
        os.killpg(proc.pid, signal.SIGHUP)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, out + err
        assert "Traceback" not in out + err and "nterrupted" not in out + err
        assert sorted(r.case["mode"] for r in read_records(fake_lab)) == ["hang", "ok"]
        (run,) = read_runs(fake_lab).values()
        assert run["event"] == "end" and run["interrupted"] is False
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_marked(token)


# Item 15: a stop signal at shutdown.


def test_a_stop_signal_during_the_shut_down_gives_the_exit_code_of_the_end_event(fake_lab, monkeypatch):
    """SIGTERM during shutdown: end event interrupted, exit 143."""
    from harness.execution import runner as runner_mod
    from harness.spec.matrix import expand
    from harness.spec.spec import load_spec

    class SignalledCompiler(runner_mod.Compiler):
        def close(self, cancel: bool = False) -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here
            super().close(cancel=cancel)

    monkeypatch.setattr(runner_mod, "Compiler", SignalledCompiler)
    spec = load_spec(root=fake_lab)
    st = spec.stage("stage-OK")
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        summary = runner_mod.Runner(spec, runner_mod.RunOptions(tasks=runner_mod.tasks_for([st], None,
                                                                                           lambda s: expand(s)))).run()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    (run,) = read_runs(fake_lab).values()
    assert run["event"] == "end" and run["interrupted"] is True
    assert summary.interrupted and summary.exit_code == 143


# Item 10: `compile` and signals.

SLOW_COMPILE_KERNEL = '''\
    import os
    import subprocess
    import time
    from pathlib import Path


    class SlowCompile:
        def __init__(self, *, n: int):
            subprocess.Popen(["sleep", "600"])
            Path(os.environ["DSV4_SLOW_COMPILE_MARK"]).write_text(str(os.getpid()))
            time.sleep(3600)

        def __call__(self, a, b, out, stream):
            pass
    '''

SLOW_COMPILE_STAGE = '''\
    SLOWC:
      title: a compile that takes its time
      dir: stages/fake
      kernels: {sm90: {module: stages.fake.slowcompile, entry: SlowCompile}}
      tensors: oracles.add:tensors
      inputs: oracles.add:make_inputs
      oracle: oracles.add:reference
      matrix: {n: [16, 32]}
      tolerances: {out: {cosine_min: 0.9999}}
      timeout_s: 20
    '''


@pytest.mark.parametrize("sig, code, group", [
    (signal.SIGTERM, 143, False),  # `kill $!`: the lab alone
    (signal.SIGHUP, 129, True),  # the terminal closes: its whole process group
    (signal.SIGINT, 130, True),  # Ctrl-C: the whole process group
])
def test_a_stop_signal_ends_a_compile_interrupted_with_nothing_left(fake_lab, tmp_path, sig, code, group):
    _add_stage(fake_lab, SLOW_COMPILE_STAGE, "slowcompile", SLOW_COMPILE_KERNEL)
    token, marker = uuid.uuid4().hex, tmp_path / "compiling"
    proc = _start(fake_lab, ["compile", "stage-SLOWC"], token, DSV4_SLOW_COMPILE_MARK=str(marker))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not marker.exists() and proc.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "the compile never started: " + "".join(proc.communicate(timeout=5))
        (os.killpg if group else os.kill)(proc.pid, sig)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 15
        assert proc.returncode == code, out + err
        assert "Traceback" not in out + err and "KeyError" not in out + err, err
        (run,) = read_runs(fake_lab).values()
        assert run["event"] == "end" and run["interrupted"] is True and run["signal"] == signal.Signals(sig).name
        assert _wait_gone(token, 10) == [], "a compile worker (or what it started) outlived the command"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_marked(token)


def test_sigterm_during_the_gates_recompile_is_143_interrupted_with_nothing_left(fake_lab, tmp_path):
    """SIGTERM during the gate's recompile: 143, no verdict, no worker left."""
    _add_stage(fake_lab, SLOW_COMPILE_STAGE, "slowcompile", SLOW_COMPILE_KERNEL)
    (fake_lab / "results" / "records").mkdir(parents=True, exist_ok=True)
    write_baselines(fake_lab, textwrap.dedent('''\
        version: 1
        baselines:
          SLOWC:
            sm_90a:
              n=16:
                kind: compile
                record: 20260101-000000-0000.1
                src: stale0000000
                compile: {status: compiled, regs: 32, spill: 0, smem: 0, inv: {(all): 10}}
        '''))
    token, marker = uuid.uuid4().hex, tmp_path / "compiling"
    proc = _start(fake_lab, ["gate"], token, DSV4_SLOW_COMPILE_MARK=str(marker))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not marker.exists() and proc.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "the recompile never started: " + "".join(proc.communicate(timeout=5))
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, out + err
        assert "Traceback" not in out + err and "REGRESSIONS" not in out and "pass" not in out, out + err
        (run,) = read_runs(fake_lab).values()
        assert run["event"] == "end" and run["interrupted"] is True and run["signal"] == "SIGTERM"
        assert _wait_gone(token, 10) == [], "a compile worker (or what it started) outlived the gate"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_marked(token)


# Item 10: Ctrl-C while loading.

EARLY_CTRL_C = '''\
import builtins, os, signal, sys, time
sys.argv = ["dsv4-lab", "list"]
real_import = builtins.__import__


def ctrl_c_while_loading(name, *args, **kwargs):
    if name == "typer":  # the command line's first heavy import
        builtins.__import__ = real_import
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    return real_import(name, *args, **kwargs)


builtins.__import__ = ctrl_c_while_loading
import cli
cli.main()
'''


def test_ctrl_c_while_the_command_line_loads_is_one_line_and_130(fake_lab):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", EARLY_CTRL_C], cwd=fake_lab, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 130, r.stdout + r.stderr
    assert r.stderr.strip() == "dsv4-lab: interrupted"


# Item 14: the whole command's matrix is bounded.


def test_a_command_over_the_case_limit_is_refused_in_one_line_before_building_cases(fake_lab):
    """`run --all` past MAX_RUN_CASES is refused in one line, exit 2; a filtered stage is fine."""
    side = int((MAX_RUN_CASES * 0.8) ** 0.5) + 1
    values = ", ".join(str(i) for i in range(1, side + 1))
    with open(fake_lab / "stages.yaml", "a") as f:
        for name in ("BIG1", "BIG2"):
            f.write(textwrap.indent(textwrap.dedent(f'''\
                {name}:
                  title: a big matrix
                  dir: stages/fake
                  kernels: {{cpu: {{module: stages.fake.cpu, entry: Add}}}}
                  tensors: oracles.add:tensors
                  inputs: oracles.add:make_inputs
                  oracle: oracles.add:reference
                  matrix: {{n: [16], i: [{values}], j: [{values}]}}
                  kernel_params: [n]
                  tolerances: {{out: {{cosine_min: 0.9999}}}}
                '''), "  "))
    total = 2 * side * side + 2 + 6  # BIG1, BIG2, OK, BAD
    t0 = time.monotonic()
    r = run_cli(["run", "--all"], cwd=fake_lab, timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(total) in lines[0] and str(MAX_RUN_CASES) in lines[0], r.stderr
    assert "--where" in lines[0] and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60
    assert read_runs(fake_lab) == {}, "nothing may start"
