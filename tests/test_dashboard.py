"""Dashboard, history, show and note rendered to text."""

import re

from harness.notebook.baselines import save
from harness.workflows.history import sparkline
from harness.notebook.records import Record, RecordWriter
from tests.conftest import run_cli
from tests.test_gate import C64, C512, add_hd_stage, base, rec
from harness.spec.spec import load_spec


def test_empty_lab_says_what_to_run_first(fake_lab):
    r = run_cli(["dashboard"], cwd=fake_lab)
    assert r.returncode == 0 and "No records yet. Start with: dsv4-lab run stage-A" in r.stdout


def test_dashboard_rows_glyphs_and_states(fake_lab):
    add_hd_stage(fake_lab)
    spec = load_spec(root=fake_lab)
    w = RecordWriter(fake_lab)
    r1 = rec(spec, "HD", "sm_90a", C64, 0.99999, i=1)
    r1.env = {"gpu": "NVIDIA H200", "host": "gpubox"}
    r1.compile = {"regs": 90, "spill": 0, "smem": 65536}
    r1.timing = {"us": 12.5, "tflops": 3.0}
    r2 = rec(spec, "HD", "sm_90a", C512, 0.2, status="fail", i=1)
    r2.env = r1.env
    w.write(r1)
    w.write(r2)
    comp = Record(id="c.1", run="c", t="2026-11-21T00:00:00Z", stage="HD", arch="cpu", case=C64, status="compiled",
                  compile={"regs": 1, "spill": 8}, note="compiled, not run: no sm_100 device (this machine has X)",
                  code={"src": "0ld0ld0ld0ld"})
    w.write(comp)
    w.close()
    save(fake_lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    out = run_cli(["dashboard"], cwd=fake_lab).stdout
    assert "stage-HD" in out and "stage-OK" in out
    assert "H200 @ gpubox" in out and "✗ 1/2" in out
    assert "+9.0e-05" in out                       # delta of the hd=64 case to its baseline
    assert "12.50" in out and "90r/0s/64K" in out
    assert "○ compiled, not run" in out and re.search(r"⚠ \d+[dhms]\b", out) and "⚠spill" in out  # ⚠ age: stale
    assert "\x1b[" not in out                      # no colour codes when piped


def test_history_sparkline_and_notes(fake_lab):
    add_hd_stage(fake_lab)
    spec = load_spec(root=fake_lab)
    w = RecordWriter(fake_lab)
    for i, cos in enumerate([0.99, 0.999, 0.9999], 1):
        r = rec(spec, "HD", "sm_90a", C64, cos, i=i)
        r.t = f"2026-11-2{i}T00:00:00Z"
        r.code["commit"] = f"c{i}"
        r.code["dirty"] = i == 3
        w.write(r)
    w.close()
    (fake_lab / "results" / "runs.jsonl").write_text('{"run":"run2","event":"start"}\n')
    assert run_cli(["note", "run2", "switched to exp2"], cwd=fake_lab).returncode == 0
    out = run_cli(["history", "stage-HD", "--hd", "64", "--arch", "sm_90a"], cwd=fake_lab).stdout
    assert out.index("run1") < out.index("run2") < out.index("run3")
    assert "c3*" in out and "switched to exp2" in out
    trend = next(ln for ln in out.splitlines() if "cosine (nines" in ln).split()[-1]
    assert len(trend) == 3 and trend[0] == "▁" and trend[-1] == "█"   # rising
    shown = run_cli(["show", "run2.2"], cwd=fake_lab)
    assert shown.returncode == 0 and '"cosine": 0.999' in shown.stdout and "switched to exp2" in shown.stdout
    assert run_cli(["show", "nope"], cwd=fake_lab).returncode == 2
    assert run_cli(["note", "nope", "x"], cwd=fake_lab).returncode == 2


def test_sparkline():
    assert sparkline([1, 2, 3]) == "▁▅█"
    assert sparkline([None, 5, 5]) == "·▁▁"


def test_watch_refreshes_while_records_arrive(fake_lab):
    """Frames read as they come (no fixed sleeps)."""
    import os
    import queue
    import subprocess
    import sys
    import threading
    import time

    from tests.conftest import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "cli", "dashboard", "--watch", "--interval", "0.5"], cwd=fake_lab,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()
    seen: list[str] = []

    def wait_for(pred, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                continue
            if pred("".join(seen)):
                return True
        return False

    try:
        assert wait_for(lambda text: text.count("--- ") >= 2), "no frames"
        before = "".join(seen)
        w = RecordWriter(fake_lab)
        w.write(Record(id="r.1", run="r", t="2026-11-21T00:00:00Z", stage="OK", arch="cpu", case={"n": 16},
                       status="pass", metrics={"out": {"cosine": 1.0}}, env={"host": "h"}, code={"src": "x"}))
        w.close()
        assert wait_for(lambda text: "1/2" in text[len(before):]), "the new record never showed"
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    assert "1/2" not in before
