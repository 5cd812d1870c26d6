"""Nothing in the notebook is lost or hangs a reader (issue 27 items 1, 2, 4, 9, 15): compaction
during a run, duplicate or forged baselines, missing baselines, and results/ files that are not
what they claim (symbolic links, FIFOs, decompression bombs)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.records import read_records, read_runs
from tests.conftest import ROOT

CHILD = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from harness.records import Record, RecordWriter, append_event, runs_file
root, n = Path(sys.argv[1]), int(sys.argv[2])
w = RecordWriter(root)
append_event(runs_file(root), {"run": "child", "t": "2026-01-01T00:00:00Z", "event": "start"})
print("started", flush=True)
for i in range(n):
    fresh = i % 2 == 0  # half of them stale: compaction moves those to the archive
    w.write(Record(id=f"child.{i}", run="child", t="2026-01-01T00:00:00Z", stage="OK", arch="cpu",
                   case={"n": 16}, status="pass", env={"host": "h", "gpu": f"g{i % 7}", "i": i % 5},
                   code={"src": sys.argv[4] if fresh else "0ld0ld0ld0ld"}))
    time.sleep(0.03)
w.close()
append_event(runs_file(root), {"run": "child", "t": "2026-01-01T00:00:01Z", "event": "end"})
"""


def _compact_script():
    spec = importlib.util.spec_from_file_location("compact_results", ROOT / "scripts" / "compact_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compacting_while_a_run_appends_loses_no_record(fake_lab, capsys):
    """A real process appends 30 records (and their env blocks, and its run events) while
    compaction runs again and again: every record survives, in the records file or the archive."""
    from harness.identity import source_hash
    from harness.spec import load_spec

    spec = load_spec(root=fake_lab)
    fresh = source_hash(spec.root, spec.stages["OK"], "cpu")
    compact = _compact_script()
    n = 30
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(fake_lab), str(n), str(ROOT), fresh],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "started"
    rounds = 0
    while child.poll() is None:
        assert compact.main(fake_lab) == 0
        rounds += 1
        time.sleep(0.1)  # flock is not fair: leave the run a moment to append between rounds
    assert child.wait() == 0
    assert rounds >= 3, rounds  # compaction really ran during the run
    warn: list[str] = []
    ids = [r.id for r in read_records(fake_lab, ["OK"], warn) if r.run == "child"]
    assert not warn, warn
    assert sorted(ids) == sorted(f"child.{i}" for i in range(n)), f"{n - len(set(ids))} of {n} lost"
    envs = {r.id: r.env for r in read_records(fake_lab, ["OK"]) if r.run == "child"}
    assert all(envs[f"child.{i}"] == {"host": "h", "gpu": f"g{i % 7}", "i": i % 5} for i in range(n))
    assert compact.main(fake_lab) == 0  # once more, with nothing appending: still all there
    assert len([r for r in read_records(fake_lab, ["OK"]) if r.run == "child"]) == n
    assert read_runs(fake_lab, warn)["child"]["event"] == "end"
