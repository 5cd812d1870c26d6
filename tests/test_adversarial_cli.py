"""Newcomer mistakes that ran what nobody asked for; concurrency/signals."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli


def _usage(lab: Path, args: list[str]):
    r = run_cli(args, cwd=ROOT, env_extra={"DSV4_LAB_ROOT": str(lab), "DSV4_LAB_CACHE": str(lab.parent / "cache")},
                timeout=120)
    return r


@pytest.mark.parametrize("args", [["run", "stage-OK", "--all"], ["run", "--all", "stage-OK"]])
def test_a_stage_and_all_is_a_usage_error_not_every_stage(fake_lab, args):
    """`run stage-A --all` once ran the whole lab."""
    r = _usage(fake_lab, args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == "dsv4-lab: stage-OK and --all: give a stage or --all, not both"
    assert not (fake_lab / "results" / "runs.jsonl").exists()  # nothing ran


@pytest.mark.parametrize("cmd", [["run", "stage-OK"], ["baseline", "show", "stage-OK"], ["history", "stage-OK"]])
def test_where_given_twice_is_refused_not_the_first_dropped(fake_lab, cmd):
    """`--where n=16 --where n=32` once ran n=32 only, silently."""
    r = _usage(fake_lab, [*cmd, "--where", "n=16", "--where=n=32"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("dsv4-lab: --where given 2 times — give it once, the filters joined by commas "
                                "(e.g. --where n=16,n=32)")
    assert "Traceback" not in r.stdout + r.stderr
    assert not (fake_lab / "results" / "runs.jsonl").exists()


@pytest.mark.parametrize("where", ["n=", "n=,", "n=16,mode="])
def test_a_where_axis_with_no_value_says_so(fake_lab, where):
    """`--where hd=` has no value."""
    axis = where.split(",")[-1].split("=")[0] if where.endswith("=") else "n"
    r = _usage(fake_lab, ["run", "stage-BAD" if "mode" in where else "stage-OK", "--where", where])
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == f"dsv4-lab: --where {axis}=: no value — e.g. --where {axis}=512"


def test_dropping_a_baseline_that_is_not_there_says_so_and_exits_1(fake_lab):
    """`baseline drop` of nothing once exited 0."""
    from tests.test_notebook_safety import _records

    _records(fake_lab)
    assert _usage(fake_lab, ["baseline", "accept", "stage-OK", "--n", "16"]).returncode == 0
    before = (fake_lab / "results" / "baselines.yaml.xz").read_bytes()
    r = _usage(fake_lab, ["baseline", "drop", "stage-OK", "--n", "32"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip() == ("dsv4-lab: no baseline of stage-OK matches these filters — nothing dropped "
                                "(see dsv4-lab baseline show stage-OK)")
    assert (fake_lab / "results" / "baselines.yaml.xz").read_bytes() == before
    r = _usage(fake_lab, ["baseline", "drop", "stage-OK", "--n", "16"])
    assert r.returncode == 0 and "dropped 1 baseline(s) of stage-OK" in r.stdout, r.stdout + r.stderr


LATE_SIGNAL = '''\
import builtins, os, signal, sys, time
sys.argv = ["dsv4-lab", "list"]
real_import = builtins.__import__


def signal_while_main_imports(name, *args, **kwargs):
    if name == "harness.execution.runner":  # imported by main() itself, before its try
        builtins.__import__ = real_import
        os.kill(os.getpid(), signal.SIG{sig})
        time.sleep(2)
    return real_import(name, *args, **kwargs)


import cli
builtins.__import__ = signal_while_main_imports
cli.main()
'''


@pytest.mark.parametrize("sig,code", [("HUP", 129), ("TERM", 143), ("INT", 130)])
def test_a_stop_signal_while_main_imports_is_one_line_never_a_traceback(fake_lab, sig, code):
    """A hang-up ~0.25 s into `baseline accept` once printed a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", LATE_SIGNAL.replace("{sig}", sig)], cwd=fake_lab, env=env,
                       capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGHUP)])
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, r.stdout + r.stderr
    assert r.stderr.strip() == "dsv4-lab: interrupted"


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_an_interrupted_run_says_so_in_one_line_on_stderr(fake_lab, sig, code):
    """`run … > log` then a stop signal: stderr says so."""
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT), "DSV4_LAB_ROOT": str(fake_lab),
           "DSV4_LAB_CACHE": str(fake_lab.parent / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "stage-BAD", "--mode", "hang"], cwd=fake_lab, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        runs = fake_lab / "results" / "runs.jsonl"
        while not (runs.is_file() and '"start"' in runs.read_text()):  # the run has begun (its case hangs)
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"dsv4-lab: interrupted by {sig} — 0 of 1 case(s) finished (run "), err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("cmd", [[], ["run"], ["run", "stage-OK"], ["baseline", "accept"], ["new", "stage"]])
def test_dash_h_is_help_like_dash_dash_help(fake_lab, cmd):
    """`dsv4-lab -h` works."""
    short, long_ = _usage(fake_lab, [*cmd, "-h"]), _usage(fake_lab, [*cmd, "--help"])
    assert short.returncode == 0 and not short.stderr.strip(), short.stdout + short.stderr
    assert short.stdout == long_.stdout and "Usage: dsv4-lab" in short.stdout


@pytest.mark.parametrize("axis,line", [
    ("m=99999999999999999999999", "dsv4-lab: --in Q: dimension 'm' is 99999999999999999999999 on case "
                                  "m=99999999999999999999999 — a dimension is at most 2147483647 (a 32-bit index)"),
    ("m=abc", "dsv4-lab: --in Q:m:bfloat16: dimension 'm' names axis 'm' (not an int axis) — its values are abc; "
              "a dimension needs an int axis, e.g. --axes m=128"),
])
def test_new_stage_refuses_an_absurd_or_word_dimension_and_writes_nothing(fake_lab, axis, line):
    """`--axes m=<huge>` or `m=abc` are refused in words that fit."""
    r = _usage(fake_lab, ["new", "stage", "ZZ", "--axes", axis, "--in", "Q:m:bfloat16", "--out", "S:m:float32"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == line
    assert subprocess.run(["git", "status", "--porcelain"], cwd=fake_lab, capture_output=True, text=True).stdout == ""
