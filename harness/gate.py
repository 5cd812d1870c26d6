"""The regression gate: every baselined case must still hold on the current tree.

For each baselined case the gate takes the newest record whose source hash matches the
current tree's. Fresh -> compare with the baseline; worse beyond tolerance -> regression.

* A run baseline compares the case's metrics (harness/baselines.py); any status but `pass`
  is a regression, and so is a non-finite or missing metric (a comparison with NaN never
  passes).
* A compile-only baseline (an arch no device here runs, e.g. sm_100a) compares what
  compiling proves: a compile error, any new spill, registers over the margin, a changed
  count of tensor-core MMA instructions (PTX, and SASS when both sides have it) are
  regressions; fewer registers or less shared memory is an improvement; more shared memory
  or a changed barrier count is reported as a change.

Not fresh (the stage changed since) -> compile-only cases are recompiled here (on the CPU,
records written as `dsv4-lab compile` writes them); run cases are run here when this
machine can run their arch, or the gate fails with one line naming the stale stages and the
command to run. The proven small cases (the smallest hd) are checked first, and the gate
stops at the first regression among them.

With no stage source changed, the gate decides from records alone: it imports neither
torch nor CuTeDSL. Exit codes: 0 pass, 1 regression or stale, 2 bad usage or config (a bad
baselines file is one line, never a pass).
"""

from __future__ import annotations

import math
import shlex
import signal
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines import Baseline, BaselineError, load, runnable_archs, shows_compile
from harness.identity import source_hash
from harness.inventory import mma_counts
from harness.labels import case_label
from harness.records import Record, print_warnings
from harness.spec import Spec, SpecError, Stage, load_spec
from harness.statuses import RAN as RESULT_STATUSES  # a run's verdict (not "compiled")


@dataclass
class Finding:
    kind: str  # "regression" | "improvement" | "change" | "stale" | "error"
    baseline: Baseline
    output: str = ""
    metric: str = ""
    base: float | None = None
    now: float | None = None
    record: str = ""
    text: str = ""


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def compare(b: Baseline, rec: Record) -> list[Finding]:
    """Regressions and improvements of one fresh record against its baseline."""
    if b.kind == "compile":
        return compare_compile(b, rec)
    out: list[Finding] = []
    if rec.status != "pass":
        why = rec.error or rec.status
        return [Finding("regression", b, metric="status", record=rec.id, text=f"{rec.status}: {why}"[:200])]
    for output, base_m in b.metrics.items():
        now_m = rec.metrics.get(output, {})
        for metric, base in base_m.items():
            now = now_m.get(metric)
            tol = b.tolerance.get(metric, 0.0)
            if not _finite(now) or not _finite(base) or not _finite(tol):
                out.append(Finding("regression", b, output, metric, base, now, rec.id))  # NaN never passes
                continue
            if metric == "cosine":
                worse = now < base - tol
                better = now > base + tol
            else:
                worse = now > base * (1 + tol) + 1e-12
                better = now < base / (1 + tol) - 1e-12
            if worse or better:
                out.append(Finding("regression" if worse else "improvement", b, output, metric, base, now, rec.id))
    return out


def regs_limit(b: Baseline) -> float:
    """The most registers a compile-only case may use: the baseline plus the margin
    (harness.baselines.REGS_MARGIN registers or REGS_MARGIN_REL of it, whichever is larger)."""
    base = (b.compile or {}).get("regs", 0)
    return base + max(b.tolerance.get("regs", 0), math.ceil(base * b.tolerance.get("regs_rel", 0)))


def compare_compile(b: Baseline, rec: Record) -> list[Finding]:
    """What compiling proves, against a compile-only baseline."""
    if rec.status == "compile_error":
        return [Finding("regression", b, metric="status", record=rec.id, text=f"compile_error: {rec.error}"[:300])]
    base, now = b.compile or {}, rec.compile or {}
    out: list[Finding] = []

    def add(kind: str, metric: str, was: Any, is_: Any, text: str = "") -> None:
        out.append(Finding(kind, b, "compile", metric, was, is_, rec.id, text))

    for key in ("regs", "spill", "smem"):
        if key in base and not _finite(now.get(key)):
            add("error", key, base[key], None, f"{key}: not reported now (is ptxas installed?) — nothing proven")
    if _finite(now.get("regs")) and "regs" in base:
        if now["regs"] > regs_limit(b):
            add("regression", "regs", base["regs"], now["regs"])
        elif now["regs"] < base["regs"]:
            add("improvement", "regs", base["regs"], now["regs"])
    if _finite(now.get("spill")) and "spill" in base and now["spill"] > base["spill"]:
        add("regression", "spill", base["spill"], now["spill"])
    if _finite(now.get("smem")) and "smem" in base and now["smem"] != base["smem"]:
        add("improvement" if now["smem"] < base["smem"] else "change", "smem", base["smem"], now["smem"])
    if "barriers" in base and _finite(now.get("barriers")) and now["barriers"] != base["barriers"]:
        add("change", "barriers", base["barriers"], now["barriers"])
    pairs = [("inv", "PTX")] + ([("sass", "SASS")] if base.get("sass") and now.get("sass") else [])
    for field_, what in pairs:
        was, is_ = mma_counts(base.get(field_) or {}), mma_counts(now.get(field_) or {})
        for key in sorted(set(was) | set(is_)):
            if was.get(key, 0) != is_.get(key, 0):
                add("regression", f"{what} {key}", was.get(key, 0), is_.get(key, 0))
    return out


class _Lookup:
    """The matrix's cases by label, and the records by (stage, arch, case): built once. A
    record's case is keyed by its items in order (records hold the case in axis order, as the
    matrix builds it), which is cheaper than building 10,000 labels."""

    def __init__(self, spec: Spec, records: list[Record], stages: set[str]):
        from harness.matrix import expand

        self.cases: dict[str, dict[str, dict[str, Any]]] = {}
        for sid in stages:
            st = spec.stages.get(sid)
            if st is not None:
                self.cases[sid] = {case_label(c.dict): c.dict for c in expand(st)}
        self.records: dict[tuple, list[Record]] = {}
        for r in records:
            self.records.setdefault((r.stage, r.arch, *r.case.items()), []).append(r)

    def case(self, b: Baseline) -> dict[str, Any] | None:
        return self.cases.get(b.stage, {}).get(b.case)

    def newest(self, b: Baseline, src: str) -> Record | None:
        case = self.case(b) or {}
        recs = self.records.get((b.stage, b.arch, *case.items()), [])
        for rec in reversed(recs):
            if rec.code.get("src") != src or rec.case != case:
                continue
            if b.kind == "compile" and shows_compile(rec):
                return rec
            if b.kind == "run" and rec.status in RESULT_STATUSES:
                return rec
        return None


def newest_records(root: Path, items: list[Baseline], src: dict[tuple[str, str], str | None],
                   warn: list[str]) -> list[Record]:
    """The records the gate needs, oldest first: each stage's file is read from its newest
    line back, only until every baselined case of it has its newest fresh result (a case
    without one reads the whole file). With nothing changed that is a few hundred lines of
    however many thousand the notebook holds. Lines are checked as `read_records` checks
    them; a bad one met on the way is skipped with a file:line warning."""
    from harness.records import iter_records, stage_file

    out: list[Record] = []
    for stage in sorted({b.stage for b in items}):
        todo = {(b.arch, b.case): b for b in items if b.stage == stage and src.get((b.stage, b.arch))}
        found: list[Record] = []
        for rec in iter_records(stage_file(root, stage), warn, newest_first=True) if todo else ():
            b = todo.get((rec.arch, case_label(rec.case))) if rec.stage == stage else None
            if b is None or rec.code.get("src") != src[(b.stage, b.arch)]:
                continue
            found.append(rec)
            if (shows_compile(rec) if b.kind == "compile" else rec.status in RESULT_STATUSES):
                del todo[(rec.arch, case_label(rec.case))]
                if not todo:  # stop before the generator reads another line
                    break
        out += reversed(found)
    return out


def small_first(spec: Spec, items: list[Baseline], look: _Lookup) -> tuple[list[Baseline], list[Baseline]]:
    """(the proven small cases, the rest): the smallest hd of each stage's matrix."""
    small, rest = [], []
    for b in items:
        st = spec.stages.get(b.stage)
        case = look.case(b)
        is_small = (st is not None and case is not None and "hd" in st.matrix
                    and case.get("hd") == min(st.matrix["hd"]))
        (small if is_small else rest).append(b)
    return small, rest


def sources(spec: Spec, items: list[Baseline]) -> dict[tuple[str, str], str | None]:
    """The current source hash of every baselined (stage, arch): one hash each, not per case."""
    src: dict[tuple[str, str], str | None] = {}
    for b in items:
        if (b.stage, b.arch) not in src:
            src[(b.stage, b.arch)] = _src(spec, b)
    return src


def evaluate(spec: Spec, items: list[Baseline], records: list[Record],
             src: dict[tuple[str, str], str | None] | None = None) -> tuple[list[Finding], bool]:
    """All findings, and whether the gate stopped early on a small-case regression."""
    look = _Lookup(spec, records, {b.stage for b in items})
    src = src if src is not None else sources(spec, items)
    findings: list[Finding] = []
    small, rest = small_first(spec, items, look)
    for group, stop_early in ((small, True), (rest, False)):
        for b in group:
            current = src[(b.stage, b.arch)]
            if current is None:
                findings.append(Finding("error", b, text=f"stage {b.stage} or arch {b.arch} is no longer in stages.yaml"))
                continue
            if look.case(b) is None:
                findings.append(Finding("error", b, text=f"case {b.case} is no longer in stage-{b.stage}'s matrix — "
                                                         f"drop it: dsv4-lab baseline drop stage-{b.stage}"))
                continue
            rec = look.newest(b, current)
            if rec is None:
                findings.append(Finding("stale", b, text="no result for the current source"))
                continue
            found = compare(b, rec)
            findings += found
            if stop_early and any(f.kind in ("regression", "error") for f in found):
                return findings, True
    return findings, False


def _src(spec: Spec, b: Baseline) -> str | None:
    st = spec.stages.get(b.stage)
    if st is None or b.arch not in st.kernels:
        return None
    return source_hash(spec.root, st, b.arch)


def _case_of(spec: Spec, b: Baseline):
    from harness.matrix import Case, expand

    st: Stage = spec.stages[b.stage]
    for case in expand(st):
        if case_label(case.dict) == b.case:
            return case
    return Case(st.id, ())


def _run_stale(spec: Spec, stale: list[Finding]) -> None:
    """Run the stale cases here (records are written as for any run)."""
    from harness.runner import RunOptions, Runner, Task

    tasks = [Task(spec.stages[f.baseline.stage], f.baseline.arch, _case_of(spec, f.baseline)) for f in stale]
    print(f"gate: running {len(tasks)} stale case(s) on this machine …", file=sys.stderr)
    summary = Runner(spec, RunOptions(tasks=tasks, argv=["gate"])).run()
    if summary.interrupted:  # stopped by a signal: the gate stops too, 128 + signal (never a verdict)
        from harness.interrupts import Interrupted

        raise Interrupted(summary.signum or signal.SIGINT)


def _recompile_stale(spec: Spec, stale: list[Finding]) -> None:
    """Recompile the stale compile-only cases here, on the CPU (records written)."""
    from harness.compilerun import CompileJob, compile_recorded

    jobs = [CompileJob(spec.stages[f.baseline.stage], f.baseline.arch, _case_of(spec, f.baseline)) for f in stale]
    names = sorted({f"stage-{f.baseline.stage} {f.baseline.arch}" for f in stale})
    print(f"gate: compiling {len(jobs)} stale compile-only case(s) ({', '.join(names)}) …", file=sys.stderr)
    compile_recorded(spec, jobs, ["gate"])


def main(root: Path, allow_run: bool = True, out=None) -> int:
    out = out or sys.stdout
    try:
        spec = load_spec(root=root)
        items = load(root)
    except (SpecError, BaselineError) as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        return 2
    if not items:
        print("gate: no baselines yet — nothing to hold. Add some: dsv4-lab baseline accept STAGE", file=out)
        return 0
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    warn: list[str] = []
    src = sources(spec, items)
    records = newest_records(root, items, src, warn)
    print_warnings(warn)
    findings, stopped = evaluate(spec, items, records, src)
    stale = [f for f in findings if f.kind == "stale"]
    if stale and allow_run and not stopped:
        compile_stale = [f for f in stale if f.baseline.kind == "compile"]
        runnable = runnable_archs() if any(f.baseline.kind == "run" for f in stale) else set()
        run_stale = [f for f in stale if f.baseline.kind == "run" and f.baseline.arch in runnable]
        if compile_stale:
            _recompile_stale(spec, compile_stale)
        if run_stale:
            _run_stale(spec, run_stale)
        if compile_stale or run_stale:
            records = newest_records(root, items, src, [])
            findings, stopped = evaluate(spec, items, records, src)
            stale = [f for f in findings if f.kind == "stale"]
    return report(findings, stale, stopped, len(items), out)


def report(findings: list[Finding], stale: list[Finding], stopped: bool, total: int, out) -> int:
    regressions = [f for f in findings if f.kind in ("regression", "error")]
    improvements = [f for f in findings if f.kind == "improvement"]
    changes = [f for f in findings if f.kind == "change"]
    if regressions:
        _table(out, "REGRESSIONS", regressions)
        if stopped:
            print("gate: stopped at the first regression among the proven small cases (hd = smallest): "
                  "fix that before anything else.", file=out)
    if changes:
        _table(out, "changes (not regressions)", changes)
    if improvements:
        _table(out, "improvements", improvements)
        for key in sorted({(f.baseline.stage, f.baseline.arch, f.baseline.case) for f in improvements}):
            stage, arch, case = key
            flags = " ".join(f"--{p.replace('=', ' ')}" for p in case.split(","))
            print(f"  adopt: dsv4-lab baseline accept stage-{stage} --arch {arch} {flags}", file=out)
    if stale:
        groups: dict[tuple[str, str, str], int] = {}
        for f in stale:
            k = (f.baseline.stage, f.baseline.arch, f.baseline.kind)
            groups[k] = groups.get(k, 0) + 1
        names = ", ".join(f"stage-{s} {a} ({n} case{'s' if n > 1 else ''})" for (s, a, _), n in sorted(groups.items()))
        cmds = "; ".join(f"dsv4-lab {'compile' if kind == 'compile' else 'run'} stage-{s} --arch {a}"
                         for (s, a, kind) in sorted(groups))
        print(f"gate: stale — the source changed since the last result of {names}, and it was not re-proven here: "
              f"{cmds}", file=out)
    if regressions or stale:
        return 1
    kinds = {f.kind for f in findings}
    print(f"gate: pass — {total} baselined case(s) hold" + (f", {len(improvements)} improved" if improvements else "")
          + (" (see changes)" if "change" in kinds else ""), file=out)
    return 0


def _table(out, title: str, items: list[Finding]) -> None:
    rows = [("case", "metric", "baseline", "now", "delta", "record")]
    for f in items:
        b = f.baseline
        case = f"stage-{b.stage} {b.arch} {b.case}"
        if f.metric in ("", "status") or f.text:
            rows.append((case, f.metric or "-", "-", f.text, "-", f.record or "-"))
            continue
        delta = "-" if not (_finite(f.now) and _finite(f.base)) else f"{f.now - f.base:+.3g}"
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


def hook_text(python: str | None = None, code_root: Path | None = None, prefix: str = "") -> str:
    """The pre-commit hook: the lab run with the absolute interpreter it was installed from
    (a venv need not be on PATH or activated), its code root on PYTHONPATH, in this
    repository's lab folder (`prefix`: the lab root relative to the repository's top)."""
    python = python or sys.executable
    code_root = code_root or Path(__file__).resolve().parent.parent
    return f"""#!/bin/sh
{HOOK_MARK} (installed by `dsv4-lab gate --install-hook`; remove this file to uninstall)
# Refuses the commit when a baselined case regressed or is stale.
top=$(git rev-parse --show-toplevel) || exit 2
cd "$top"/{shlex.quote(prefix) if prefix else ""} || exit 2
unset DSV4_LAB_ROOT
PYTHONPATH={shlex.quote(str(code_root))}${{PYTHONPATH:+:$PYTHONPATH}}
export PYTHONPATH
exec {shlex.quote(str(Path(python).absolute()))} -m cli gate
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
    prefix = subprocess.run(["git", "rev-parse", "--show-prefix"], cwd=root, capture_output=True,
                            text=True).stdout.strip()
    hook = hook_text(prefix=prefix)
    if path.exists():
        text = path.read_text(errors="replace")
        if HOOK_MARK in text and text == hook:
            print(f"gate hook already installed: {path}")
            return 0
        if HOOK_MARK not in text and not force:
            print(f"dsv4-lab: {path} exists and was not written by dsv4-lab — keep it, or replace it with "
                  "`dsv4-lab gate --install-hook --force`", file=sys.stderr)
            return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hook)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    print(f"gate hook installed: {path}")
    return 0
