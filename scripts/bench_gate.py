"""How fast is `dsv4-lab gate` when nothing changed? A temporary lab with 200 baselined cases and
10,000 records, the gate timed as a user runs it.  A measurement, printed.

    python scripts/bench_gate.py [--repeat 5] [--compile-only]

`--compile-only`: compile-only baselines (sm_100a) and `compiled` records with inventories."""

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

from harness.notebook.baselines import COMPILE_TOLERANCE, Baseline, save  # noqa: E402
from harness.core.labels import case_label  # noqa: E402
from harness.spec.identity import source_hash  # noqa: E402
from harness.notebook.records import Record, RecordWriter  # noqa: E402
from harness.spec.spec import load_spec  # noqa: E402

STAGE = """\
version: 1
stages:
  BIG:
    title: a fake stage with 200 cases
    dir: stages/fake
    kernels: {sm90: {module: stages.fake.cpu, entry: Add}, sm100: {module: stages.fake.cpu, entry: Add}}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix: {hd: [64, 128, 256, 512], n: [16, 32, 64, 128, 256], b: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}
    kernel_params: [n]
    tolerances: {out: {cosine_min: 0.99}}
"""


INV = {"(all)": 1380, "bar.sync": 6, "bar.sync.named": 2, "cp.async.bulk.tensor.2d.shared.global": 3,
       "ex2.approx.f32": 129, "mbarrier.try_wait.parity": 18, "mbarrier.init": 16, "st.global.128b": 8,
       "tcgen05.alloc.cta_group::1": 1, "tcgen05.commit.cta_group::1": 6, "tcgen05.ld.32x32b.x32": 6,
       "tcgen05.mma.cta_group::1.kind::f16": 12, "tcgen05.st.32x32b.x16": 4, "tcgen05.wait::ld": 3}
SASS = {"(all)": 1224, "BAR.SYNC.DEFER_BLOCKING": 8, "MUFU.EX2": 129, "STG.E.128": 8, "SYNCS.EXCH.64": 16,
        "UTCHMMA": 12, "UTMALDG.2D": 3}


def build(lab: Path, compile_only: bool = False) -> None:
    shutil.copytree(ROOT / "tests" / "fixtures" / "lab", lab)
    shutil.copy(ROOT / "oracles" / "common.py", lab / "oracles" / "common.py")
    (lab / "stages.yaml").write_text(STAGE)
    spec = load_spec(root=lab)
    st = spec.stages["BIG"]
    arch = "sm_100a" if compile_only else "sm_90a"
    src = source_hash(lab, st, arch)
    from harness.spec.matrix import expand

    cases = [c.dict for c in expand(st)]
    assert len(cases) == 200
    w = RecordWriter(lab)
    for i in range(10_000):
        case = cases[i % 200]
        if compile_only:
            w.write(Record(
                id=f"run{i // 200}.{i}", run=f"run{i // 200}", t="2026-11-21T00:00:00Z", stage="BIG", arch=arch,
                case=case, status="compiled", note="compiled, not run: no sm_100 device",
                compile={"key": "k", "s": 1.0, "cached": True, "regs": 165, "spill": 0, "smem": 82944, "barriers": 3,
                         "inv": INV, "sass": SASS},
                env={"host": "h", "cute": "4.8.1", "cpus": 2}, code={"commit": "abc", "dirty": False, "src": src},
            ))
            continue
        w.write(Record(
            id=f"run{i // 200}.{i}", run=f"run{i // 200}", t="2026-11-21T00:00:00Z", stage="BIG", arch="sm_90a",
            case=case, status="pass",
            metrics={"out": {"cosine": 0.99999, "rel_l2": 1e-3, "max_abs": 1e-3, "nonfinite": 0, "unwritten": 0}},
            compile={"key": "k", "s": 1.0, "cached": True, "regs": 90, "spill": 0},
            env={"host": "h", "gpu": "NVIDIA H200", "cc": "9.0", "cuda": "13.0", "torch": "2.11", "cute": "4.8.1"},
            code={"commit": "abc", "dirty": False, "src": src}, gpu=0,
        ))
    w.close()
    if compile_only:
        facts = {"status": "compiled", "regs": 165, "spill": 0, "smem": 82944, "barriers": 3, "inv": INV, "sass": SASS}
        save(lab, [Baseline("BIG", arch, case_label(c), "run0.0", src, {}, dict(COMPILE_TOLERANCE), None, dict(facts))
                   for c in cases])
        return
    save(lab, [Baseline("BIG", "sm_90a", case_label(c), "run0.0", src,
                        {"out": {"cosine": 0.99999, "rel_l2": 1e-3, "max_abs": 1e-3}}) for c in cases])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--compile-only", action="store_true", help="compile-only baselines (sm_100a) and compiled records")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lab = Path(tmp) / "lab"
        build(lab, args.compile_only)
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
        kind = "compile-only" if args.compile_only else "run"
        print(f"gate over 200 {kind} baselined cases and 10,000 records ({size / 1e6:.1f} MB): "
              f"median {statistics.median(times):.3f} s wall, min {min(times):.3f} s, max {max(times):.3f} s "
              f"({args.repeat} runs, process start included)")


if __name__ == "__main__":
    main()
