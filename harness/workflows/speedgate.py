"""`dsv4-lab gate --speed`: no baselined bench shape may have become slower.

For every speed baseline (notebook/speedbaselines.py): source unchanged -> it holds; source
changed -> the shape is re-timed by A/B against the baseline's commit, interleaved (`bench
--compare COMMIT`, abbench.py), never against the stored number; it fails on the verdict
"slower" (the stage's `speed_tolerance`, default 3 %, and the 95 % interval).

It runs only where a GPU of the baseline's model runs the arch; elsewhere one line, exit 1. A
baseline without a commit, or whose shape left the bench block, is a failure, named.
`gate --speed --target NAME` (`main_remote`): on an SSH target's GPU (remote_speedgate.py;
docs/BENCH.md, "The speed gate on a target")."""

from __future__ import annotations

import io
import signal
import sys
import tempfile
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
    """Which speed baselines still describe the tree's kernel and which must be re-timed (an unknown
        stage or arch counts as changed)."""
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
    """(regressions, unproven) from `bench --compare`'s records for `wanted`: verdict slower is a
        regression; none (failed, crash, untimed, unwritten) is unproven."""
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


Group = tuple[Any, list[dict], list[SpeedBaseline]]  # a stage, its bench shapes to re-time, their baselines


def retimable(spec, bs: list[SpeedBaseline]) -> tuple[dict[tuple[str, str], Group], list[str]]:
    """The baselines that can be re-timed, by (stage, commit): (stage, shapes, baselines); and an
        UNPROVEN line for each that cannot (no commit, not that kernel, a shape gone)."""
    from harness.execution.bench import plan_cases

    unproven: list[str] = []
    by_commit: dict[tuple[str, str], list[SpeedBaseline]] = {}
    for b in bs:
        if not b.commit or b.dirty:
            unproven.append(f"stage-{b.stage} {b.arch} {b.case}: its baseline " +
                            ("was timed on a tree with uncommitted changes: its commit is not that kernel — "
                             "re-accept it from a committed tree" if b.commit else "names no commit to compare with"))
            continue
        by_commit.setdefault((b.stage, b.commit), []).append(b)
    groups: dict[tuple[str, str], Group] = {}
    for (stage_id, commit), gbs in by_commit.items():
        st = spec.stages.get(stage_id)
        shapes = {case_label(c): c for c in plan_cases(st, [])} if st is not None and st.bench_plan else {}
        unproven += [f"stage-{b.stage} {b.arch} {b.case}: no longer a bench shape" for b in gbs if b.case not in shapes]
        keep = [b for b in gbs if b.case in shapes]
        if keep:
            groups[(stage_id, commit)] = (st, [shapes[b.case] for b in keep], keep)
    return groups, unproven


def _settled(items: list[SpeedBaseline], p: Plan | None, out, where: str = "") -> int | None:
    """The answer when nothing needs re-timing — 1 with no speed baselines, 0 when every source is
        unchanged — in one line; None when some must be re-timed."""
    if not items or p is None:
        print("gate --speed: no speed baselines — nothing is guarded (dsv4-lab bench STAGE on the GPU machine, then "
              "dsv4-lab baseline accept STAGE --speed)", file=out)
        return 1
    if not p.changed:
        print(f"gate --speed: {len(items)} speed baseline(s) hold: their kernels' source is unchanged{where}", file=out)
        return 0
    return None


def main(root: Path, gpu: int = 0, out=None, revs: dict[str, Path] | None = None, log: Any = None) -> int:
    """0 when every speed baseline holds (unchanged, or re-timed and not slower); 1 otherwise.  `revs`
        (the far side of `--target`): sha -> that commit's shipped tree; `log`: the session every
        compare record goes to."""
    from harness.core.environment import gpu_capabilities
    from harness.execution import abbench
    from harness.execution.bench import BenchError
    from harness.spec.spec import load_spec

    out = out or sys.stdout
    items = load(root)
    spec = load_spec(root=root) if items else None
    p = plan(spec, items) if items else None
    settled = _settled(items, p, out)
    if settled is not None:
        return settled
    caps = gpu_capabilities()
    here = caps.get(gpu)
    models = sorted({f"{b.gpu_name or '?'} ({b.arch})" for b in p.changed})
    runnable = [b for b in p.changed if here is not None and here[1] == b.arch and b.gpu_name == here[0]]
    if not runnable:
        on = "here" if revs is None else "on this target"  # revs: the far side of --target
        where = f"GPU {gpu} {on} is {here[0]} ({here[1]})" if here else f"no GPU {on}" if not caps else \
            f"no GPU {gpu} {on} (GPUs {', '.join(map(str, sorted(caps)))})"
        fix = "run dsv4-lab gate --speed on that machine" if revs is None else "name a target that has one"
        print(f"gate --speed: {len(p.changed)} speed-baselined shape(s) changed source and must be re-timed on "
              f"{', '.join(models)}; {where} — {fix}", file=out)
        return 1
    slower: list[str] = []
    unproven = [f"stage-{b.stage} {b.arch} {b.case}: baselined on {b.gpu_name or '?'}, not re-timed here"
                for b in p.changed if b not in runnable]
    groups, cannot = retimable(spec, runnable)
    unproven += cannot
    shared: list = []  # one session (`log`): record ids go on across the groups
    for (stage_id, commit), (st, cases, bs) in groups.items():
        rev_tree = None
        if revs is not None:
            sha = next((s for s in sorted(revs) if s.startswith(commit)), None)
            if sha is None:
                unproven += [f"stage-{b.stage} {b.arch} {b.case}: its commit {commit} was not sent with the tree"
                             for b in bs]
                continue
            rev_tree = (sha, revs[sha])
        done: list = shared if log is not None else []
        first = len(done)
        try:
            if abbench.main(root, st, [], commit, gpu=gpu, cases=cases, done=done, argv=["gate", "--speed"],
                            rev_tree=rev_tree, log=log) == 130:  # stopped (Ctrl-C; on a target: the link gone)
                raise KeyboardInterrupt
        except BenchError as exc:
            unproven += [f"stage-{b.stage} {b.arch} {b.case}: {exc}" for b in bs]
            continue
        s, u = verdicts(done[first:], bs)
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


def main_emitting(root: Path, gpu: int, shas: list[str]) -> int:
    """The far side of `gate --speed --target NAME` (started by remote_side.py, its channel open): the
        gate over the trees shipped under REV_DIR, every compare record sent on the channel, then an
        end event with the gate's lines.  SIGHUP (the link gone) ends it interrupted."""
    from harness.core.labels import printable
    from harness.notebook.records import new_run_id
    from harness.remote.channel import ChannelError, open_sender
    from harness.remote.remote_side import ChannelLog
    from harness.remote.remote_speedgate import REV_DIR

    try:
        sender = open_sender()
    except ChannelError as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        return 2
    log = ChannelLog(sender, new_run_id())

    def hangup(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGHUP, hangup)
    log.event("start")
    buf = io.StringIO()
    errors: list[str] = []
    try:
        rc = main(root, gpu, out=buf, revs={sha: root / REV_DIR / sha for sha in shas}, log=log)
    except KeyboardInterrupt:
        rc = 130
    except Exception as exc:  # one line back on the channel, never a silent end
        errors.append(printable(f"{type(exc).__name__}: {exc}".splitlines()[0], 300))
        rc = 2
    lines = buf.getvalue().splitlines()
    for line in lines:
        print(line, file=sys.stderr)
    try:
        log.event("end", interrupted=rc == 130, errors=errors, lines=lines)
    except OSError:  # the sending side is gone (it marks the run interrupted itself)
        pass
    return rc


def main_remote(root: Path, target: str, out=None, sync_method: str | None = None) -> int:
    """`gate --speed --target NAME`: plan here (nothing changed: no connection), else ship each needed
        commit's tree, run the gate there, write its records here, print its lines.  0 only when the
        remote gate passed and its records prove it; 3 for a failed link; else 1.  TargetError for a
        bad target."""
    from harness.execution.abbench import take_tree
    from harness.execution.bench import BenchError
    from harness.execution.compilediff import _git
    from harness.remote import remote_speedgate
    from harness.spec.spec import load_spec

    out = out or sys.stdout
    t = remote_speedgate.speed_target(root, target)
    items = load(root)
    spec = load_spec(root=root) if items else None
    p = plan(spec, items) if items else None
    settled = _settled(items, p, out, f" (nothing to re-time on {t.name})")
    if settled is not None:
        return settled
    groups, unproven = retimable(spec, p.changed)
    with tempfile.TemporaryDirectory(prefix="dsv4-speedgate-revs-") as tmp:
        revs: dict[str, Path] = {}
        for commit in sorted({c for _, c in groups}):
            sha = _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").stdout.strip()
            if not sha or commit.startswith("-"):
                print(f"gate --speed: commit {commit} of a speed baseline is not a commit git knows here (git fetch "
                      "it): its shapes stay unproven", file=out)
                continue
            try:
                revs[sha] = take_tree(root, commit, sha, Path(tmp) / sha)
            except BenchError as exc:
                print(f"gate --speed: {exc}: its shapes stay unproven", file=out)
        sent = {key: g for key, g in groups.items() if any(s.startswith(key[1]) for s in revs)}
        planned = [(st.id, b.arch, case) for st, cases, bs in sent.values() for case, b in zip(cases, bs)]
        if not planned:
            for line in unproven:
                print(f"UNPROVEN  {line}", file=out)
            print(f"gate --speed: {len(p.changed)} speed-baselined shape(s) changed source and none can be re-timed "
                  f"(see above): nothing was sent to {t.name}", file=out)
            return 1
        res = remote_speedgate.gate_on_target(spec, t, planned, revs, ["gate", "--speed", "--target", target],
                                              sync_method)
    tr = res.run
    for line in (tr.end or {}).get("lines", []):
        print(line, file=out)
    out.flush()
    for line in remote_speedgate.problems(res):
        print(line, file=sys.stderr, flush=True)
    if res.interrupted:
        return 128 + res.signum
    if res.local_error:
        return 1
    code = tr.exit_code
    if code == 0:  # the remote said every baseline holds: its records must say so too
        bad = []
        for (stage_id, _), (st, _, bs) in sent.items():
            s, u = verdicts([r for r in tr.records if r.stage == stage_id], bs)
            bad += s + u
        if bad:
            print(f"gate --speed: {t.name} said every speed baseline holds, but its records do not prove "
                  f"{len(bad)} shape(s) (first: {bad[0]})", file=out)
            code = 1
    return code
