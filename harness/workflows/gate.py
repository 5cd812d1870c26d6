"""The regression gate: every baselined case must still hold on the current tree (README: Gate).

For each baselined case the gate takes the newest record whose source hash is the tree's.
Fresh -> compared with the baseline (run: any status but `pass`, any non-finite or missing
metric, a metric past tolerance is a regression; compile-only: what compiling proves,
notebook/baselines.py — more shared memory or a changed barrier count is a change, not a
failure). Not fresh -> compile-only cases are recompiled here (recorded as `dsv4-lab compile`
records); run cases are run here when this machine runs their arch, proven on the proof target
(`gate --target NAME` or `proof_target:`), or the gate fails with one line naming the stale
stages and the command. The smallest cases are checked first, stopping at their first
regression. `--staged` (the pre-commit hook) judges the git index (notebook/staged.py).

With no stage source changed it decides from records alone (no torch, no CuTeDSL). Exit codes:
0 pass, 1 regression or stale, 2 bad usage or config (a bad baselines file never passes)."""

from __future__ import annotations

import math
import shlex
import signal
import stat
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.notebook.baselines import Baseline, BaselineError, load, runnable_archs
from harness.spec.identity import source_hash
from harness.notebook.inventory import mma_counts
from harness.core.labels import case_label
from harness.core.paths import records_dir
from harness.notebook.records import Record, is_fresh, newest, print_warnings, shows_compile
from harness.spec.spec import Spec, SpecError, Stage, load_spec
from harness.remote.ssh import EXIT_LINK
from harness.core.statuses import RAN as RESULT_STATUSES  # a run's verdict (not "compiled")


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
    """The most registers a compile-only case may use: the baseline plus REGS_MARGIN or REGS_MARGIN_REL
        of it, the larger."""
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
    """The matrix's cases by label and the records by (stage, arch, case), built once; a record's
        case keyed by its items in order (cheaper than 10,000 labels)."""

    def __init__(self, spec: Spec, records: list[Record], stages: set[str]):
        from harness.spec.matrix import expand

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
        return newest(recs, b.stage, b.arch, case, src, _proves(b))


def newest_records(root: Path, items: list[Baseline], src: dict[tuple[str, str], str | None],
                   warn: list[str], spec: Spec | None = None) -> list[Record]:
    """The records the gate needs, oldest first: each stage's file read from its newest line back
        until every baselined case has its newest fresh result (a case without one reads it all);
        a suite baseline whose source moved wants every case of its list (`spec` lists them).
        Lines checked as `read_records` checks them; a bad one skipped with a file:line warning."""
    from harness.notebook.records import newest_fresh_in_file, stage_file

    out: list[Record] = []
    for stage in sorted({b.stage for b in items}):
        wanted = {(b.arch, b.case): (src[(b.stage, b.arch)], _proves(b)) for b in items
                  if b.stage == stage and src.get((b.stage, b.arch)) and b.kind != "suite"}
        for b in items:
            if b.stage == stage and b.kind == "suite" and spec is not None and _suite_moved(b, src):
                wanted.update({(b.arch, label): (src[(b.stage, b.arch)], _proves(b))
                               for label in _suite_labels(spec, b.stage)})
        _, met = newest_fresh_in_file(stage_file(root, stage), wanted,
                                      lambda rec, stage=stage: (rec.arch, case_label(rec.case)) if rec.stage == stage
                                      else None, warn)
        out += met
    return out


def _suite_moved(b: Baseline, src: dict[tuple[str, str], str | None]) -> bool:
    return src.get((b.stage, b.arch)) not in (None, b.src)


def _suite_labels(spec: Spec, stage: str) -> list[str]:
    from harness.spec.matrix import expand

    st = spec.stages.get(stage)
    return [] if st is None else [case_label(c.dict) for c in expand(st)]


def suite_findings(spec: Spec, b: Baseline, current: str, look: "_Lookup") -> list[Finding]:
    """A suite baseline (notebook/baselines.py: suite) on the current tree: it holds while the stage's
        source hash and case count are its own; else each case's fresh result must be a pass (a
        regression naming the case), a case without one leaves it stale."""
    labels = list(look.cases.get(b.stage, {}))
    count = (b.suite or {}).get("cases")
    if current == b.src and len(labels) == count:
        return []
    failed: list[Finding] = []
    missing = 0
    for label in labels:
        recs = look.records.get((b.stage, b.arch, *look.cases[b.stage][label].items()), [])
        rec = newest(recs, b.stage, b.arch, look.cases[b.stage][label], current, _proves(b))
        if rec is None:
            missing += 1
        elif rec.status != "pass":
            failed.append(Finding("regression", replace(b, case=label), metric="status", record=rec.id,
                                  text=f"{rec.status}: {rec.error or rec.status}"[:200]))
    if failed:
        return failed
    if missing:
        why = ("its source changed" if current != b.src
               else f"its list has {len(labels)} cases now, {count} when it was baselined")
        return [Finding("stale", b, text=f"{missing} of {len(labels)} cases have no result for the current source "
                                         f"({why})")]
    return [Finding("change", b, metric="src", text=f"all {len(labels)} pass at the new source — re-accept it "
                                                     f"(dsv4-lab baseline accept stage-{b.stage})")]


def _proves(b: Baseline):
    """What a fresh record must show to stand for baseline `b`: a build (compile baseline) or a
    run's verdict (run baseline)."""
    return shows_compile if b.kind == "compile" else (lambda rec: rec.status in RESULT_STATUSES)


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
            if b.kind == "suite":
                if spec.stages[b.stage].suite is None:
                    findings.append(Finding("error", b, text=f"stage-{b.stage} is no suite any more — drop its suite "
                                                             f"baseline: dsv4-lab baseline drop stage-{b.stage} --gone"))
                else:
                    findings += suite_findings(spec, b, current, look)
                continue
            if look.case(b) is None:
                findings.append(Finding("error", b, text=f"case {b.case} is no longer in stage-{b.stage}'s matrix — "
                                                         f"drop it: dsv4-lab baseline drop stage-{b.stage} --gone, then "
                                                         f"dsv4-lab baseline accept stage-{b.stage}"))
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
    from harness.spec.matrix import Case, expand

    st: Stage = spec.stages[b.stage]
    for case in expand(st):
        if case_label(case.dict) == b.case:
            return case
    return Case(st.id, ())


def _cases_of(spec: Spec, b: Baseline) -> list:
    """The cases a stale baseline is re-proven with: its case, or a suite's whole list."""
    from harness.spec.matrix import expand

    return list(expand(spec.stages[b.stage])) if b.kind == "suite" else [_case_of(spec, b)]


def _run_stale(spec: Spec, stale: list[Finding]) -> None:
    """Run the stale cases here (records are written as for any run)."""
    from harness.execution.runner import RunOptions, Runner, Task

    tasks = [Task(spec.stages[f.baseline.stage], f.baseline.arch, case) for f in stale for case in _cases_of(spec, f.baseline)]
    print(f"gate: running {len(tasks)} stale case(s) on this machine …", file=sys.stderr)
    summary = Runner(spec, RunOptions(tasks=tasks, argv=["gate"]), on_record=_progress(len(tasks), _run_line)).run()
    if summary.interrupted:  # stopped by a signal: the gate stops too, 128 + signal (never a verdict)
        from harness.core.interrupts import Interrupted

        raise Interrupted(summary.signum or signal.SIGINT)


def _recompile_stale(spec: Spec, stale: list[Finding]) -> None:
    """Recompile the stale compile-only cases here, on the CPU (records written)."""
    from harness.execution.compilerun import CompileJob, compile_recorded

    jobs = [CompileJob(spec.stages[f.baseline.stage], f.baseline.arch, _case_of(spec, f.baseline)) for f in stale]
    names = sorted({f"stage-{f.baseline.stage} {f.baseline.arch}" for f in stale})
    print(f"gate: compiling {len(jobs)} stale compile-only case(s) ({', '.join(names)}) …", file=sys.stderr)
    compile_recorded(spec, jobs, ["gate"], on_done=_progress(len(jobs), _compile_line))


def _run_line(rec) -> str:
    from harness.notebook.recordview import case_line

    return case_line(rec)


def _compile_line(done) -> str:
    from harness.execution.report import compile_line

    return compile_line(done)


def _progress(total: int, line_of):
    """A numbered line per finished case on stderr (the verdict stays on stdout)."""
    from rich.console import Console

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    done = 0

    def show(item) -> None:
        nonlocal done
        done += 1
        console.print(f"[dim]gate {done}/{total}[/]  {line_of(item)}")

    return show


def main(root: Path, allow_run: bool = True, out=None, target: str | None = None, staged: bool = False) -> int:
    """The gate. `target`: where stale run cases are proven — a target name (`a,b` splits), `local`,
        or None for the user's `proof_target`.  `staged`: judge the git index (notebook/staged.py)."""
    out = out or sys.stdout
    if not staged:
        return _judge(root, root, allow_run, out, target)
    from harness.notebook.staged import StagedError, index_snapshot

    try:
        with index_snapshot(root) as snap:  # only its setup raises StagedError
            try:
                return _judge(snap.folder, snap.baselines_root, allow_run, out, target, snap)
            finally:
                if str(snap.folder) in sys.path:  # the folder goes away with the snapshot
                    sys.path.remove(str(snap.folder))
    except StagedError as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        return 2


def _judge(root: Path, baselines_root: Path, allow_run: bool, out, target: str | None, snap=None) -> int:
    """The gate on the lab at `root` (the working tree, or the index's snapshot `snap`)."""
    from harness.remote.targets import TargetError, resolve_targets

    lab = snap.lab if snap is not None else root  # the real lab: its targets, its remote folder
    try:
        spec = load_spec(root=root)
        items = load(baselines_root)
        if target not in (None, "local"):
            resolve_targets(lab, target)  # a bad name is one line before anything runs
    except (SpecError, BaselineError, TargetError) as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        return 2
    if not items:
        if notebook_has_records(root):  # baselines were kept here once: their loss is no pass
            print("gate: no baselines, but the notebook has records — results/baselines.yaml.xz is missing or "
                  "empty: restore it (git checkout results/baselines.yaml.xz) or accept baselines "
                  "(dsv4-lab baseline accept STAGE)", file=out)
            return 1
        print("gate: no baselines yet — nothing to hold. Add some: dsv4-lab baseline accept STAGE", file=out)
        return 0
    if not records_dir(root).is_dir():
        print(f"gate: results/records/ is missing — the notebook's records are gone, so none of the {len(items)} "
              "baselined case(s) can be checked: restore them (git checkout results/records)", file=out)
        return 1
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    warn: list[str] = []
    src = sources(spec, items)
    records = newest_records(root, items, src, warn, spec)
    print_warnings(warn)
    findings, stopped = evaluate(spec, items, records, src)
    stale = [f for f in findings if f.kind == "stale"]
    proof: str | None = None
    remote_rc = 0
    runnable: set[str] | None = None
    if stale and allow_run and not stopped:
        compile_stale = [f for f in stale if f.baseline.kind == "compile"]
        run_all = [f for f in stale if f.baseline.kind != "compile"]
        try:
            proof = _proof(lab, target) if run_all else None
        except TargetError as exc:
            print(f"dsv4-lab: {exc}", file=sys.stderr)
            return 2
        runnable = runnable_archs() if run_all and proof is None else None
        run_stale = [f for f in run_all if runnable is not None and f.baseline.arch in runnable]
        if compile_stale:
            _recompile_stale(spec, compile_stale)
        if run_stale:
            _run_stale(spec, run_stale)
        if proof is not None:
            try:
                remote_rc = _prove_on_target(spec, proof, run_all, snap)
            except TargetError as exc:
                print(f"dsv4-lab: {exc}", file=sys.stderr)
                return 2
        if compile_stale or run_stale or proof is not None:
            records = newest_records(root, items, src, [], spec)
            findings, stopped = evaluate(spec, items, records, src)
            stale = [f for f in findings if f.kind == "stale"]
    lead, tail = _stale_hint(lab, spec, stale, records, src, proof, remote_rc, runnable, allow_run) if stale \
        else ("", "")
    code = report(findings, stale, stopped, len(items), out, tail, lead)
    if code == 0 and proof is not None and snap is not None:
        print(f"gate: proven on {proof} — commit its records too (git add results/)", file=out)
    return 3 if code and remote_rc == EXIT_LINK else code


def _proof(lab: Path, target: str | None) -> str | None:
    """Where stale run cases are proven: the named target(s), None for `local`, else the
    user's proof_target (None when unset)."""
    if target == "local":
        return None
    if target is not None:
        return target
    from harness.remote.targets import proof_target

    return proof_target(lab)


def _prove_on_target(spec: Spec, target: str, stale: list[Finding], snap) -> int:
    """Run the stale cases on `target` through `run --target` (records written here as they arrive),
        one run per stage and arch selecting them with --where.  Returns the worst exit code."""
    from harness.spec.matrix import expand, parse_filters, parse_where
    from harness.remote.remote_run import run_remote

    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    whole: set[tuple[str, str]] = set()  # a suite: its whole list, no --where
    for f in stale:
        groups.setdefault((f.baseline.stage, f.baseline.arch), []).extend(c.dict for c in _cases_of(spec, f.baseline))
        if f.baseline.kind == "suite":
            whole.add((f.baseline.stage, f.baseline.arch))
    print(f"gate: proving {len(stale)} stale case(s) on {target} ("
          + ", ".join(f"stage-{s} {a}" for s, a in sorted(groups)) + ") …", file=sys.stderr)
    worst = 0
    for (sid, arch), cases in sorted(groups.items()):
        st = spec.stages[sid]
        where = "" if (sid, arch) in whole else ",".join(
            f"{axis}=" + "|".join(str(v) for v in sorted({c[axis] for c in cases if axis in c}, key=str))
            for axis in st.matrix if any(axis in c for c in cases))
        chosen = expand(st, parse_filters(st, parse_where(where)))
        argv = ["run", f"stage-{sid}", "--arch", arch] + (["--where", where] if where else [])
        rc = run_remote(spec, target, argv, [st], [arch], {st.id: chosen}, snapshot=snap)
        worst = rc if rc == EXIT_LINK or worst == EXIT_LINK else max(worst, rc)
    return worst


def _stale_hint(lab: Path, spec: Spec, stale: list[Finding], records: list[Record], src, proof: str | None,
                remote_rc: int, runnable: set[str] | None, allow_run: bool) -> tuple[str, str]:
    """What the stale line says around its commands: how to prove what this machine cannot run, or
        what the proof target said."""
    runs = [f for f in stale if f.baseline.kind != "compile"]
    if not runs:
        return "", ""
    if proof is not None:
        look = _Lookup(spec, records, {f.baseline.stage for f in runs})
        whys: list[str] = []
        for f in runs:
            case = look.case(f.baseline) or {}
            tried = [r for r in look.records.get((f.baseline.stage, f.baseline.arch, *case.items()), [])
                     if r.target and is_fresh(r, src.get((f.baseline.stage, f.baseline.arch)))]
            if tried:
                r = tried[-1]
                why = f"{r.status}" + (f" ({r.note or r.error})" if (r.note or r.error) else "")
                whys.append(" ".join(f"stage-{f.baseline.stage} {f.baseline.arch} on {r.target}: {why}".split())[:200])
        if whys:
            return "", "; not proven there — " + "; ".join(sorted(set(whys)))
        return "", f"; the proof on {proof} brought back no result (exit {remote_rc}: see above)"
    if runnable is None:
        runnable = runnable_archs()
    far = sorted({f.baseline.arch for f in runs if f.baseline.arch not in runnable})
    if not far:
        return "", "" if allow_run else " (--no-run was given)"
    from harness.remote.targets import TARGETS_NAME, TargetError, load_targets, user_targets_shown

    try:
        declared = sorted(load_targets(lab))
    except TargetError:
        declared = []
    name = declared[0] if len(declared) == 1 else "NAME"
    known = f" (declared: {', '.join(declared)}" if declared else f" (declare one in {TARGETS_NAME}"
    return (f"this machine cannot run {', '.join(far)} — prove it on a target: dsv4-lab gate --target {name}"
            f"{known}; `proof_target: {name}` in {user_targets_shown(lab)} makes the hook use it), "
            f"or on a machine that can: ", "")


def notebook_has_records(root: Path) -> bool:
    """Whether results/ holds any record line (a records file, a segment or an archive that is
    not empty: harness/notebook/records.py)."""
    from harness.notebook.records import has_record_lines

    return has_record_lines(root)


def report(findings: list[Finding], stale: list[Finding], stopped: bool, total: int, out, hint: str = "",
           lead: str = "") -> int:
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
              f"{lead}{cmds}{hint}", file=out)
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
    """The pre-commit hook: the lab run with the absolute interpreter it was installed from, its code
        root on PYTHONPATH, in the repository's lab folder (`prefix`, relative to the top)."""
    python = python or sys.executable
    code_root = code_root or Path(__file__).resolve().parents[2]  # harness/workflows/gate.py -> the code root
    return f"""#!/bin/sh
{HOOK_MARK} (installed by `dsv4-lab gate --install-hook`; remove this file to uninstall)
# Refuses the commit when a baselined case regressed or is stale in what the commit holds (the index).
top=$(git rev-parse --show-toplevel) || exit 2
cd "$top"/{shlex.quote(prefix) if prefix else ""} || exit 2
unset DSV4_LAB_ROOT
PYTHONPATH={shlex.quote(str(code_root))}${{PYTHONPATH:+:$PYTHONPATH}}
export PYTHONPATH
exec {shlex.quote(str(Path(python).absolute()))} -m cli gate --staged
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
