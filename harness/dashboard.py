"""`dsv4-lab dashboard`: where every stage stands, stages × arch, on one screen.

Per stage and arch: compiled (and when), ran (where: host and GPU), cases whose newest
result passed / cases in the matrix, worst cosine, delta to baseline, median µs of the benched case,
registers / spills / shared memory, a stale marker, and the age of the newest result.
Built from records alone (no torch, no CuTeDSL). Readable without colour: every state has a
glyph and a word.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from harness.baselines import load as load_baselines
from harness.bench import is_bench
from harness.labels import case_label
from harness.identity import source_hash
from harness.matrix import count
from harness.records import Record, print_warnings, read_records
from harness.spec import Spec, Stage, load_spec

from harness.statuses import RAN


@dataclass
class Cell:
    """The state of one (stage, arch)."""

    compiled: str = "—"
    ran: str = "—"
    passed: str = "—"
    cosine: str = "—"
    delta: str = "—"
    us: str = "—"
    roof: str = "—"
    resources: str = "—"
    stale: str = ""
    age: str = "—"
    style: str = "dim"


def _age(iso: str, now: float) -> str:
    try:
        t = time.mktime(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    except (ValueError, OverflowError):
        return "?"
    s = max(0, now - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def cell(spec: Spec, stage: Stage, arch: str, records: list[Record], baselines: dict, now: float) -> Cell:
    mine = [r for r in records if r.stage == stage.id and r.arch == arch]
    c = Cell()
    benched = [r for r in mine if is_bench(r)]  # bench shapes: timing and roofline, not the test matrix
    mine = [r for r in mine if not is_bench(r)]
    c.roof = roofline_text(benched, source_hash(spec.root, stage, arch) if benched else "")
    if not mine:
        c.compiled = "not yet"
        return c
    src = source_hash(spec.root, stage, arch)
    compiled = [r for r in mine if r.compile and r.status != "compile_error"]
    errors = [r for r in mine if r.status == "compile_error"]
    newest = mine[-1]
    if errors and errors[-1] is newest:
        c.compiled = f"✗ error {_age(newest.t, now)} ago"
    elif compiled:
        c.compiled = f"✓ {_age(compiled[-1].t, now)} ago"
    res = [r.compile for r in compiled if r.code.get("src") == src] or [r.compile for r in compiled]
    if res:
        regs = max((_int(x.get("regs")) for x in res), default=0)
        spill = max((_int(x.get("spill")) for x in res), default=0)
        smem = max((_int(x.get("smem", x.get("static_smem"))) for x in res), default=0)
        c.resources = f"{regs}r/{spill}s/{smem // 1024}K" + (" ⚠spill" if spill else "")
    ran = [r for r in mine if r.status in RAN]
    if not ran:
        note = next((r.note for r in reversed(mine) if r.note), None)
        why = note.split(": ", 1)[-1].split(" (")[0] if note else ""
        c.ran = "○ compiled, not run" + (f": {why}" if why else "")
        c.style = "yellow"
        c.stale = "stale" if newest.code.get("src") != src else ""
        c.age = _age(newest.t, now)
        return c
    # The newest result of each case of the matrix (a run may cover only some cases).
    latest: dict[str, Record] = {}
    for r in ran:
        latest[case_label(r.case)] = r
    run = sorted(latest.values(), key=lambda r: r.t)
    env = run[-1].env
    c.ran = f"{env.get('gpu', '?')} @ {run[-1].target}:{env.get('host', '?')}"
    n_pass = sum(1 for r in run if r.status == "pass")
    total = count(stage)
    c.passed = f"{'✓' if n_pass == total else '✗'} {n_pass}/{total}"
    cos = [m.get("cosine") for r in run for m in r.metrics.values()]
    known = [x for x in cos if x is not None]
    c.cosine = "n/a" if not known or len(known) < len(cos) else f"{min(known):.7f}"
    deltas = []
    for r in run:
        b = baselines.get((stage.id, arch, case_label(r.case)))
        if b is None:
            continue
        for out, bm in b.metrics.items():
            now_cos = r.metric(out, "cosine")
            if now_cos is not None and bm.get("cosine") is not None:
                deltas.append(now_cos - bm["cosine"])
    if deltas:
        c.delta = f"{min(deltas):+.1e}"
    timed = [r for r in ran if r.timing]
    if timed:
        t = timed[-1].timing or {}
        c.us = f"{t['us']:.2f}" + (f" ({t['tflops']:.0f} TF/s)" if t.get("tflops") else "")
        if timed[-1].code.get("src") != src:
            c.us += " stale"
    c.stale = "stale" if any(r.code.get("src") != src for r in run) else ""
    c.age = _age(run[-1].t, now)
    c.style = "green" if n_pass == total and not c.stale else ("red" if n_pass < len(run) else "yellow")
    return c


def roofline_text(benched: list[Record], src: str) -> str:
    """The newest timed bench record of each bench shape as a fraction of the roofline:
    `62%` or `48–71%` over the shapes, `stale` when the source changed since."""
    newest: dict[str, Record] = {}
    for r in benched:
        if r.status == "pass" and r.timing:
            newest[case_label(r.case)] = r
    if not newest:
        return "—"
    fracs = [t for r in newest.values() if isinstance(t := (r.timing or {}).get("roofline"), (int, float))]
    if not fracs:
        return "not calibrated"
    lo, hi = min(fracs), max(fracs)
    text = f"{lo:.0%}" if round(lo, 2) == round(hi, 2) else f"{lo:.0%}–{hi:.0%}"
    if len(fracs) > 1:
        text += f" ({len(fracs)} shapes)"
    if any(r.code.get("src") != src for r in newest.values()):
        text += " stale"
    return text


def _int(x: object) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def render(root: Path) -> Group | Text:
    spec = load_spec(root=root)
    warn: list[str] = []
    records = read_records(root, list(spec.stages), warn, bench=True)
    print_warnings(warn)
    if not records:
        return Text("No records yet. Start with: dsv4-lab run stage-A   (with no GPU it compiles both archs "
                    "and records that nothing ran)")
    baselines = {(b.stage, b.arch, b.case): b for b in load_baselines(root)}
    now = time.time()
    table = Table(title="dsv4-lab dashboard", show_lines=True)
    for col in ("stage", "arch", "compiled", "ran on", "passed", "worst cos", "Δ base", "µs (bench)",
                "roofline", "regs/spill/smem", "fresh", "age"):
        table.add_column(col)
    for st in spec.stages.values():
        for i, arch in enumerate(st.kernels):
            c = cell(spec, st, arch, records, baselines, now)
            table.add_row(
                f"{st.name}" if i == 0 else "", arch, c.compiled, Text(c.ran, style=c.style), c.passed, c.cosine,
                c.delta, c.us, c.roof, c.resources, "⚠ stale" if c.stale else "✓ fresh" if c.age != "—" else "—", c.age,
            )
    legend = Text("✓ pass/fresh  ✗ failure  ○ compiled, not run (no device of that arch: never verified)  "
                  "⚠ stale: the source changed since this result — re-run it", style="dim")
    return Group(table, legend)


def main(root: Path, watch: bool = False, interval: float = 2.0) -> int:
    from harness.report import make_console

    console = make_console()
    if not watch:
        console.print(render(root))
        return 0
    try:
        if console.is_terminal:
            from rich.live import Live

            with Live(render(root), console=console, refresh_per_second=4, screen=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(render(root))
        else:  # piped: a fresh table each interval, flushed
            import sys

            while True:
                console.print(f"--- {time.strftime('%H:%M:%S')}", highlight=False)
                console.print(render(root))
                sys.stdout.flush()
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
