"""How fast is `dsv4-lab gate` when nothing changed? Builds a temporary lab with 200
baselined cases and 10,000 records, then times the gate as a user runs it (process start
included). Not a test: a measurement, printed.

    python scripts/bench_gate.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.baselines import Baseline, case_label, save  # noqa: E402
from harness.identity import source_hash  # noqa: E402
from harness.records import Record, RecordWriter  # noqa: E402
from harness.spec import load_spec  # noqa: E402

STAGE = """\
version: 1
stages:
  BIG:
    title: a fake stage with 200 cases
    dir: stages/fake
    kernels: {sm90: {module: stages.fake.cpu, entry: Add}}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix: {hd: [64, 128, 256, 512], n: [16, 32, 64, 128, 256], b: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}
    kernel_params: [n]
    tolerances: {out: {cosine_min: 0.99}}
"""


def build(lab: Path) -> None:
    shutil.copytree(ROOT / "tests" / "fixtures" / "lab", lab)
    shutil.copy(ROOT / "oracles" / "common.py", lab / "oracles" / "common.py")
    (lab / "stages.yaml").write_text(STAGE)
    spec = load_spec(root=lab)
    st = spec.stages["BIG"]
    src = source_hash(lab, st, "sm_90a")
    from harness.matrix import expand

    cases = [c.dict for c in expand(st)]
    assert len(cases) == 200
    w = RecordWriter(lab)
    for i in range(10_000):
        case = cases[i % 200]
        w.write(Record(
            id=f"run{i // 200}.{i}", run=f"run{i // 200}", t="2026-11-21T00:00:00Z", stage="BIG", arch="sm_90a",
            case=case, status="pass",
            metrics={"out": {"cosine": 0.99999, "rel_l2": 1e-3, "max_abs": 1e-3, "nonfinite": 0, "unwritten": 0}},
            compile={"key": "k", "s": 1.0, "cached": True, "regs": 90, "spill": 0},
            env={"host": "h", "gpu": "NVIDIA H200", "cc": "9.0", "cuda": "13.0", "torch": "2.11", "cute": "4.8.1"},
            code={"commit": "abc", "dirty": False, "src": src}, gpu=0,
        ))
    w.close()
    save(lab, [Baseline("BIG", "sm_90a", case_label(c), "run0.0", src,
                        {"out": {"cosine": 0.99999, "rel_l2": 1e-3, "max_abs": 1e-3}}) for c in cases])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lab = Path(tmp) / "lab"
        build(lab)
        size = (lab / "results" / "records" / "BIG.jsonl").stat().st_size
        cmd = [shutil.which("dsv4-lab") or sys.executable, *([] if shutil.which("dsv4-lab") else ["-m", "cli"]), "gate"]
        env = {**os.environ, "DSV4_LAB_ROOT": str(lab), "PYTHONPATH": str(ROOT)}
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            r = subprocess.run(cmd, cwd=lab, env=env, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stdout + r.stderr
        print(r.stdout.strip())
        print(f"gate over 200 baselined cases and 10,000 records ({size / 1e6:.1f} MB): "
              f"median {statistics.median(times):.3f} s wall, min {min(times):.3f} s, max {max(times):.3f} s "
              f"({args.repeat} runs, process start included)")


if __name__ == "__main__":
    main()
