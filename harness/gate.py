"""The regression gate: every baselined case must still hold on the current tree.

For each baselined case the gate takes the newest record whose source hash matches the
current tree's. Fresh -> compare with the baseline; worse beyond tolerance -> regression.
Not fresh (the stage changed since) -> run those cases here when this machine can, or fail
with one line naming the stale stages and the command to run. The proven small cases
(the smallest hd, or the first case of a stage without hd) are checked first, and the gate
stops at the first regression among them.

With no stage source changed, the gate decides from records alone: it imports neither
torch nor CuTeDSL. Exit codes: 0 pass, 1 regression or stale, 2 bad usage or config.
"""

from __future__ import annotations

import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines import Baseline, load, newest
from harness.labels import case_label
from harness.identity import source_hash
from harness.records import Record, print_warnings, read_records
from harness.spec import Spec, SpecError, load_spec

from harness.statuses import RAN as RESULT_STATUSES  # a run's verdict (not "compiled")


@dataclass
class Finding:
    kind: str  # "regression" | "improvement" | "stale" | "error"
    baseline: Baseline
    output: str = ""
    metric: str = ""
    base: float | None = None
    now: float | None = None
    record: str = ""
    text: str = ""


def compare(b: Baseline, rec: Record) -> list[Finding]:
    """Regressions and improvements of one fresh record against its baseline."""
    out: list[Finding] = []
    if rec.status != "pass":
        why = rec.error or rec.status
        return [Finding("regression", b, metric="status", record=rec.id, text=f"{rec.status}: {why}"[:200])]
    for output, base_m in b.metrics.items():
        now_m = rec.metrics.get(output, {})
        for metric, base in base_m.items():
            now = now_m.get(metric)
            tol = b.tolerance.get(metric, 0.0)
            if metric == "cosine":
                worse = now is None or now < base - tol
                better = now is not None and now > base + tol
            else:
                worse = now is None or now > base * (1 + tol) + 1e-12
                better = now is not None and now < base / (1 + tol) - 1e-12
            if worse or better:
                out.append(Finding("regression" if worse else "improvement", b, output, metric, base, now, rec.id))
    return out


def small_first(spec: Spec, items: list[Baseline]) -> tuple[list[Baseline], list[Baseline]]:
    """(the proven small cases, the rest): the smallest hd of each stage's matrix."""
    small, rest = [], []
    for b in items:
        st = spec.stages.get(b.stage)
        params = dict(p.split("=", 1) for p in b.case.split(",") if "=" in p)
        if st is not None and "hd" in st.matrix:
            is_small = params.get("hd") == str(min(st.matrix["hd"]))
        else:
            is_small = False
        (small if is_small else rest).append(b)
    return small, rest


def evaluate(spec: Spec, items: list[Baseline], records: list[Record]) -> tuple[list[Finding], bool]:
    """All findings, and whether the gate stopped early on a small-case regression."""
    src = {(b.stage, b.arch): _src(spec, b) for b in items}
    findings: list[Finding] = []
    small, rest = small_first(spec, items)
    for group, stop_early in ((small, True), (rest, False)):
        for b in group:
            current = src[(b.stage, b.arch)]
            if current is None:
                findings.append(Finding("error", b, text=f"stage {b.stage} or arch {b.arch} is no longer in stages.yaml"))
                continue
            case = _case_dict(spec, b)
            rec = newest(records, b.stage, b.arch, case, current, RESULT_STATUSES) if case is not None else None
            if rec is None:
                findings.append(Finding("stale", b, text="no result for the current source"))
                continue
            found = compare(b, rec)
            findings += found
            if stop_early and any(f.kind == "regression" for f in found):
                return findings, True
    return findings, False


def _src(spec: Spec, b: Baseline) -> str | None:
    st = spec.stages.get(b.stage)
    if st is None or b.arch not in st.kernels:
        return None
    return source_hash(spec.root, st, b.arch)


def _case_dict(spec: Spec, b: Baseline) -> dict[str, Any] | None:
    from harness.matrix import expand

    for case in expand(spec.stages[b.stage]):
        if case_label(case.dict) == b.case:
            return case.dict
    return None


def _runnable_archs() -> set[str]:
    from harness.environment import gpu_capabilities

    return {a for _, a in gpu_capabilities().values() if a} | {"cpu"}


def _run_stale(spec: Spec, stale: list[Finding]) -> None:
    """Run the stale cases here (records are written as for any run)."""
    from harness.matrix import Case
    from harness.runner import RunOptions, Runner, Task

    tasks = []
    for f in stale:
        st = spec.stages[f.baseline.stage]
        case = _case_dict(spec, f.baseline)
        tasks.append(Task(st, f.baseline.arch, Case(st.id, tuple(case.items()))))
    print(f"gate: running {len(tasks)} stale case(s) on this machine …", file=sys.stderr)
    Runner(spec, RunOptions(tasks=tasks, argv=["gate"])).run()


def main(root: Path, allow_run: bool = True, out=None) -> int:
    out = out or sys.stdout
    try:
        spec = load_spec(root=root)
    except SpecError as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        return 2
    items = load(root)
    if not items:
        print("gate: no baselines yet — nothing to hold. Add some: dsv4-lab baseline accept STAGE", file=out)
        return 0
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    warn: list[str] = []
    records = read_records(root, sorted({b.stage for b in items}), warn)
    print_warnings(warn)
    findings, stopped = evaluate(spec, items, records)
    stale = [f for f in findings if f.kind == "stale"]
    if stale and allow_run and not stopped:
        runnable = _runnable_archs()
        can = [f for f in stale if f.baseline.arch in runnable]
        if can:
            _run_stale(spec, can)
            records = read_records(root, sorted({b.stage for b in items}), warn)
            findings, stopped = evaluate(spec, items, records)
            stale = [f for f in findings if f.kind == "stale"]
    return report(findings, stale, stopped, len(items), out)


def report(findings: list[Finding], stale: list[Finding], stopped: bool, total: int, out) -> int:
    regressions = [f for f in findings if f.kind in ("regression", "error")]
    improvements = [f for f in findings if f.kind == "improvement"]
    if regressions:
        _table(out, "REGRESSIONS", regressions)
        if stopped:
            print("gate: stopped at the first regression among the proven small cases (hd = smallest): "
                  "fix that before anything else.", file=out)
    if improvements:
        _table(out, "improvements", improvements)
        for key in sorted({(f.baseline.stage, f.baseline.arch, f.baseline.case) for f in improvements}):
            stage, arch, case = key
            flags = " ".join(f"--{p.replace('=', ' ')}" for p in case.split(","))
            print(f"  adopt: dsv4-lab baseline accept stage-{stage} --arch {arch} {flags}", file=out)
    if stale:
        groups: dict[tuple[str, str], int] = {}
        for f in stale:
            groups[(f.baseline.stage, f.baseline.arch)] = groups.get((f.baseline.stage, f.baseline.arch), 0) + 1
        names = ", ".join(f"stage-{s} {a} ({n} case{'s' if n > 1 else ''})" for (s, a), n in sorted(groups.items()))
        cmds = "; ".join(f"dsv4-lab run stage-{s} --arch {a}" for (s, a) in sorted(groups))
        print(f"gate: stale — the source changed since the last result of {names}, and no device here can run "
              f"it: run {cmds}", file=out)
    if regressions or stale:
        return 1
    print(f"gate: pass — {total} baselined case(s) hold" + (f", {len(improvements)} improved" if improvements else ""),
          file=out)
    return 0


def _table(out, title: str, items: list[Finding]) -> None:
    rows = [("case", "metric", "baseline", "now", "delta", "record")]
    for f in items:
        b = f.baseline
        case = f"stage-{b.stage} {b.arch} {b.case}"
        if f.metric in ("", "status"):
            rows.append((case, f.metric or "-", "-", f.text, "-", f.record or "-"))
            continue
        delta = "-" if f.now is None or f.base is None else f"{f.now - f.base:+.3g}"
        rows.append((case, f"{f.output}.{f.metric}", _g(f.base), _g(f.now), delta, f.record))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"gate: {title}", file=out)
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=out)


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.9g}"


# ---------------------------------------------------------------------------------------
# The git hook.

HOOK_MARK = "# dsv4-lab gate hook"
HOOK = f"""#!/bin/sh
{HOOK_MARK} (installed by `dsv4-lab gate --install-hook`; remove this file to uninstall)
# Refuses the commit when a baselined case regressed or is stale.
if command -v dsv4-lab >/dev/null 2>&1; then
  exec dsv4-lab gate
fi
exec python3 -m cli gate
"""


def install_hook(root: Path, force: bool = False) -> int:
    import subprocess

    try:
        hooks = subprocess.run(["git", "rev-parse", "--git-path", "hooks"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        print(f"dsv4-lab: {root} is not a git repository — run `git init` first", file=sys.stderr)
        return 2
    path = (root / hooks / "pre-commit").resolve()
    if path.exists():
        text = path.read_text(errors="replace")
        if HOOK_MARK in text and text == HOOK:
            print(f"gate hook already installed: {path}")
            return 0
        if HOOK_MARK not in text and not force:
            print(f"dsv4-lab: {path} exists and was not written by dsv4-lab — keep it, or replace it with "
                  "`dsv4-lab gate --install-hook --force`", file=sys.stderr)
            return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HOOK)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    print(f"gate hook installed: {path}")
    return 0
