"""`dsv4-lab gate --speed`: no baselined bench shape may have become slower.

For every speed baseline (results/speed_baselines.yaml, harness/notebook/speedbaselines.py):
  * its source unchanged (the record's source hash is the tree's): it holds — the kernel that was
    timed is the kernel there is;
  * its source changed: the shape is re-timed by A/B against the baseline's commit, in one
    process, interleaved (`bench --compare COMMIT`, harness/execution/abbench.py) — never by
    comparing a new number with the stored one (another day, other clocks). It fails when the
    verdict is "slower": the tree's median above the commit's by more than the stage's
    `bench: {speed_tolerance: …}` (default 3 %) with the 95 % interval excluding no change.

It runs only where a GPU of the baseline's model (name) runs the arch; anywhere else it says so in
one line and exits 1 (a speed gate that timed nothing never passes). A baseline without a commit,
or with a shape no longer in the bench block, cannot be re-timed: a failure, named.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.labels import case_label
from harness.notebook.speedbaselines import SpeedBaseline, load


@dataclass
class Plan:
    unchanged: list[SpeedBaseline]
    changed: list[SpeedBaseline]


def plan(spec, items: list[SpeedBaseline]) -> Plan:
    """Which speed baselines still describe the tree's kernel (source unchanged) and which must be
    re-timed (a baseline of a stage or arch the spec no longer has counts as changed)."""
    from harness.spec.identity import source_hash

    unchanged, changed = [], []
    srcs: dict[tuple[str, str], str | None] = {}
    for b in items:
        key = (b.stage, b.arch)
        if key not in srcs:
            st = spec.stages.get(b.stage)
            srcs[key] = source_hash(spec.root, st, b.arch) if st is not None and b.arch in st.kernels else None
        (unchanged if srcs[key] == b.src else changed).append(b)
    return Plan(unchanged, changed)


def verdicts(records: list[Any], wanted: list[SpeedBaseline]) -> tuple[list[str], list[str]]:
    """(regressions, unproven) from the records `bench --compare` wrote for `wanted`: a shape whose
    verdict is slower is a regression; one with no verdict (failed check, crash, not timed, never
    written) is unproven."""
    by_label = {case_label(r.case): r for r in records}
    slower, unproven = [], []
    for b in wanted:
        rec = by_label.get(b.case)
        c = (rec.compare or {}) if rec is not None else {}
        name = f"stage-{b.stage} {b.arch} {b.case}"
        if "verdict" not in c:
            unproven.append(f"{name}: {'not compared' if rec is None else (rec.error or rec.status)}")
        elif c["verdict"] == "slower":
            slower.append(f"{name}: {c['b_us']:.2f} µs vs {c['a_us']:.2f} µs at {c['commit']} — ×{c['ratio']:.3f} "
                          f"[{c['lo']:.3f}, {c['hi']:.3f}], over the {100 * c['threshold']:g} % threshold")
    return slower, unproven


def main(root: Path, gpu: int = 0, out=None) -> int:
    """0 when every speed baseline holds (unchanged, or re-timed and not slower); 1 otherwise."""
    from harness.core.environment import gpu_capabilities
    from harness.execution import abbench
    from harness.execution.bench import BenchError, plan_cases
    from harness.spec.spec import load_spec

    out = out or sys.stdout
    items = load(root)
    if not items:
        print("gate --speed: no speed baselines — nothing is guarded (dsv4-lab bench STAGE on the GPU machine, then "
              "dsv4-lab baseline accept STAGE --speed)", file=out)
        return 1
    spec = load_spec(root=root)
    p = plan(spec, items)
    if not p.changed:
        print(f"gate --speed: {len(items)} speed baseline(s) hold: their kernels' source is unchanged", file=out)
        return 0
    caps = gpu_capabilities()
    here = caps.get(gpu)
    models = sorted({f"{b.gpu_name or '?'} ({b.arch})" for b in p.changed})
    runnable = [b for b in p.changed if here is not None and here[1] == b.arch and b.gpu_name == here[0]]
    if not runnable:
        where = f"GPU {gpu} here is {here[0]} ({here[1]})" if here else "no GPU here"
        print(f"gate --speed: {len(p.changed)} speed-baselined shape(s) changed source and must be re-timed on "
              f"{', '.join(models)}; {where} — run dsv4-lab gate --speed on that machine", file=out)
        return 1
    slower: list[str] = []
    unproven = [f"stage-{b.stage} {b.arch} {b.case}: baselined on {b.gpu_name or '?'}, not re-timed here"
                for b in p.changed if b not in runnable]
    groups: dict[tuple[str, str], list[SpeedBaseline]] = {}
    for b in runnable:
        if not b.commit or b.dirty:
            unproven.append(f"stage-{b.stage} {b.arch} {b.case}: its baseline " +
                            ("was timed on a tree with uncommitted changes: its commit is not that kernel — "
                             "re-accept it from a committed tree" if b.commit else "names no commit to compare with"))
            continue
        groups.setdefault((b.stage, b.commit), []).append(b)
    for (stage_id, commit), bs in groups.items():
        st = spec.stages.get(stage_id)
        shapes = {case_label(c): c for c in plan_cases(st, [])} if st is not None and st.bench_plan else {}
        cases = [shapes[b.case] for b in bs if b.case in shapes]
        unproven += [f"stage-{b.stage} {b.arch} {b.case}: no longer a bench shape" for b in bs if b.case not in shapes]
        if not cases:
            continue
        done: list = []
        try:
            abbench.main(root, st, [], commit, gpu=gpu, cases=cases, done=done, argv=["gate", "--speed"])
        except BenchError as exc:
            unproven += [f"stage-{b.stage} {b.arch} {b.case}: {exc}" for b in bs]
            continue
        s, u = verdicts(done, [b for b in bs if b.case in shapes])
        slower += s
        unproven += u
    for line in slower:
        print(f"SLOWER  {line}", file=out)
    for line in unproven:
        print(f"UNPROVEN  {line}", file=out)
    held = len(items) - len(slower) - len(unproven)
    print(f"gate --speed: {held} of {len(items)} speed baseline(s) hold ({len(p.unchanged)} unchanged), "
          f"{len(slower)} slower, {len(unproven)} unproven", file=out)
    return 1 if slower or unproven else 0
