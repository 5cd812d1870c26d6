"""Stage E under compute-sanitizer: a small-batch case (every sequence cut, PartCombine), streamed
idx windows (topk 16384, and 2048 + 1024 with the pair) and merging cases (pieces of 2 and 3),
through the lab's runner into a scratch results folder.  On the GPU machine:

    compute-sanitizer --tool synccheck --target-processes all python3 scripts/e_synccheck.py

Exit 0 only when every case ran and passed (the sanitizer's "ERROR SUMMARY: 0 errors" is the
check)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = [  # (b, config, splits)
    (2, "s2h64_m128bs256_x1024bs64", "auto"),   # the latency regime: every sequence in pieces, PartCombine
    (2, "s2h128_m128bs256_x1024bs64", "auto"),  # … with the cluster pair
    (3, "s2h128_m128bs256_x1024bs64", 2),       # every sequence cut in two: merged in the attention kernel
    (3, "s2h64_m200bs2_x64bs256", 2),           # pieces of 2 and 3: the kernel merges, PartCombine the others
    (1, "s2h64_m16384bs256", 3),                # idx entries streamed through two windows (issue 35), parts of 86 tiles
    (2, "s2h128_m2048bs256_x1024bs64", 1),      # … a window crossing into the extra list, with the cluster pair
]


def main() -> int:
    from harness.execution.runner import RunOptions, Runner, Task
    from harness.spec.matrix import Case
    from harness.spec.spec import load_spec

    spec = load_spec(root=ROOT)
    stage = spec.stages["E"]
    cases = []
    for b, config, splits in CASES:
        params = dict(b=b, config=config, kv_format="model1", scenario="sink", splits=splits, epilogue="bf16")
        cases.append(Case("E", tuple((axis, params[axis]) for axis in stage.matrix)))
    with tempfile.TemporaryDirectory() as tmp:
        summary = Runner(spec, RunOptions(tasks=[Task(stage, "sm_90a", c) for c in cases], argv=["e_synccheck"]),
                         results_root=Path(tmp)).run()
    ok = len(summary.records) == len(cases)
    for rec in summary.records:
        print("e_synccheck", rec.case, rec.status, rec.error or "")
        ok = ok and rec.status == "pass"
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
