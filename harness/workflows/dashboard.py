"""`dsv4-lab dashboard`: where every stage stands, stages × arch, on one screen.

One line per stage and arch: where it ran, cases passed / in the matrix, worst cosine, delta to
baseline, median µs, roofline, registers / spills / shared memory, staleness and age.  Columns
that do not fit are left out (and named), never cut.  From records alone (no torch, no CuTeDSL);
every state has a glyph and a word."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from harness.notebook.baselines import SUITE_LABEL, load as load_baselines
from harness.core.labels import case_label
from harness.spec.identity import source_hash
from harness.spec.matrix import count
from harness.notebook.records import Record, is_bench, is_fresh, newest_by_case, print_warnings, read_records
from harness.spec.spec import Spec, Stage, load_spec

from harness.core.statuses import RAN


@dataclass
class Cell:
    """The state of one (stage, arch)."""

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
    not_run: str = ""  # why no case of it ran ("no GPU on this machine (needs sm_100)")
    gpu: str = ""  # the GPU of the newest run ("H100 80GB HBM3"): `ran` without where, for a narrow terminal
    speed: str = "—"  # the bench shapes' µs against their speed baselines (Δ %), when there are any


NOT_RUN = "compiled, not run:"
STALE_MARK = "⚠"


def why_not_here(arch: str) -> str:
    """Why this machine does not run `arch`, in run's words ("" when it can)."""
    from harness.core.environment import gpu_capabilities
    from harness.execution.runner import not_runnable_reason

    caps = _caps_once(gpu_capabilities)
    if arch == "cpu" or any(a == arch for _, a in caps.values()):
        return ""
    return not_runnable_reason(arch, caps).removeprefix(NOT_RUN).strip()


_CAPS: list[dict] = []


def _caps_once(probe) -> dict:
    if not _CAPS:
        _CAPS.append(probe())
    return _CAPS[0]


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


def cell(spec: Spec, stage: Stage, arch: str, records: list[Record], baselines: dict, now: float,
         speed: dict | None = None) -> Cell:
    mine = [r for r in records if r.stage == stage.id and r.arch == arch]
    c = Cell()
    benched = [r for r in mine if is_bench(r)]  # bench shapes: timing and roofline, not the test matrix
    mine = [r for r in mine if not is_bench(r)]
    c.roof = roofline_text(benched, source_hash(spec.root, stage, arch) if benched else "", compact=True)
    mine_speed = [b for (st, a, _), b in (speed or {}).items() if st == stage.id and a == arch]
    if mine_speed:
        c.speed = speed_text(benched, mine_speed, source_hash(spec.root, stage, arch))
    src = source_hash(spec.root, stage, arch)
    suite = baselines.get((stage.id, arch, SUITE_LABEL))
    if suite is not None and (suite.src == src or not any(r.status in RAN and is_fresh(r, src) for r in mine)):
        return suite_cell(c, suite, src, count(stage), now)
    if not mine:
        c.ran = "not compiled yet"
        return c
    compiled = [r for r in mine if r.compile and r.status != "compile_error"]
    errors = [r for r in mine if r.status == "compile_error"]
    newest = mine[-1]
    compile_error = bool(errors and errors[-1] is newest)
    res = [r.compile for r in compiled if is_fresh(r, src)] or [r.compile for r in compiled]
    if res:
        regs = max((_int(x.get("regs")) for x in res), default=0)
        spill = max((_int(x.get("spill")) for x in res), default=0)
        smem = max((_int(x.get("smem", x.get("static_smem"))) for x in res), default=0)
        c.resources = f"{regs}r/{spill}s/{smem // 1024}K" + (" ⚠spill" if spill else "")
    ran = [r for r in mine if r.status in RAN]
    if not ran:
        # The reason in run's own words ("compiled, not run: no GPU on this machine (needs sm_100)"),
        # also for cases only `dsv4-lab compile` recorded: then the reason is this machine's.
        note = next((r.note for r in reversed(mine) if r.note and r.note.startswith(NOT_RUN)), None)
        c.not_run = note[len(NOT_RUN):].strip() if note else (why_not_here(arch) or "not run yet")
        c.ran = "✗ compile error" if compile_error else "○ compiled, not run"
        c.style = "red" if compile_error else "yellow"
        prepared = [r for r in mine if r.status == "prepared" and is_fresh(r, src)]
        if prepared and not compile_error:  # its own thing: the host path went up to the launch, nothing ran
            n = len({case_label(r.case) for r in prepared})
            gpu = str(prepared[-1].env.get("gpu", "?")).removeprefix("NVIDIA ")
            c.ran = f"◐ prepared on {gpu}, not run ({n}/{count(stage)})"
            c.style = "cyan"
        c.stale = "stale" if not is_fresh(newest, src) else ""
        c.age = _age(newest.t, now)
        return c
    # The newest result of each case of the matrix (a run may cover only some cases).
    run = sorted(newest_by_case(ran).values(), key=lambda r: r.t)
    env = run[-1].env
    host = str(env.get("host", "?")).split(".")[0]
    c.gpu = str(env.get("gpu", "?")).removeprefix("NVIDIA ")
    c.ran = f"{c.gpu} @ " + (host if run[-1].target == "local" else f"{run[-1].target}:{host}")
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
        c.us = f"{t['us']:.2f}"
        if not is_fresh(timed[-1], src):
            c.us += STALE_MARK
    c.stale = "stale" if any(not is_fresh(r, src) for r in run) else ""
    c.age = _age(run[-1].t, now)
    c.style = "green" if n_pass == total and not c.stale else ("red" if n_pass < len(run) else "yellow")
    if compile_error:  # the newest build failed: what ran before is not what the source builds now
        c.ran, c.style = "✗ compile error", "red"
    return c


def suite_cell(c: Cell, b, src: str, total: int, now: float) -> Cell:
    """A suite stage whose one baseline holds for the current source, or whose records left the live
        notebook with no newer ones (retired to git history once that baseline held every case,
        notebook/baselines.py: suite): what the baseline says."""
    n = (b.suite or {}).get("cases", 0)
    runs = (b.suite or {}).get("runs", [])
    c.passed = f"{'✓' if n == total else '✗'} {n}/{total}"
    c.ran = f"suite baseline: runs {runs[0]}" + (f" … {runs[-1]}" if len(runs) > 1 else "") + " (records in git history)"
    c.stale = "" if b.src == src else "stale"
    c.style = "green" if n == total and not c.stale else "yellow"
    try:
        c.age = _age(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.strptime(b.record[:15], "%Y%m%d-%H%M%S")), now)
    except ValueError:
        pass
    return c


def speed_text(benched: list[Record], speed: list, src: str) -> str:
    """The newest timed bench record of each speed-baselined shape against its baseline as Δ %
        (`+2.1%`, or `-3.0…+1.2%` over the shapes; + is slower), on the baseline's GPU model only;
        `⚠` when the source changed since.  A Δ is not a verdict: only an interleaved A/B is."""
    newest = newest_by_case(benched, lambda r: r.status == "pass" and bool(r.timing))
    deltas, stale = [], False
    for b in speed:
        rec = newest.get(b.case)
        if rec is None or (rec.timing or {}).get("gpu_name") != b.gpu_name:
            continue
        deltas.append(rec.timing["us"] / b.us - 1)
        stale = stale or not is_fresh(rec, src) or b.src != src
    if not deltas:
        return "no run on its GPU" if speed else "—"
    lo, hi = min(deltas), max(deltas)
    text = f"{lo:+.1%}" if round(lo, 3) == round(hi, 3) else f"{lo:+.1%}…{hi:+.1%}"
    return text + (STALE_MARK if stale else "")


def roofline_text(benched: list[Record], src: str, compact: bool = False) -> str:
    """The newest timed bench records as a fraction of the roofline: `62%` or `48–71%`, `stale` when the
        source changed (`compact`: no count, `⚠` for stale)."""
    newest = newest_by_case(benched, lambda r: r.status == "pass" and bool(r.timing))
    if not newest:
        return "—"
    fracs = [t for r in newest.values() if isinstance(t := (r.timing or {}).get("roofline"), (int, float))]
    if not fracs:
        return "not calibrated"
    lo, hi = min(fracs), max(fracs)
    text = f"{lo:.0%}" if round(lo, 2) == round(hi, 2) else f"{lo:.0%}–{hi:.0%}"
    if len(fracs) > 1 and not compact:
        text += f" ({len(fracs)} shapes)"
    if hi > 1.0:  # faster than the calibrated peak: a measurement error, never a result (roofline.py)
        text += "✗" if compact else " ✗ >100%: a measurement error"
    if any(not is_fresh(r, src) for r in newest.values()):
        text += STALE_MARK if compact else " stale"
    return text


def _int(x: object) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


COLUMNS = ("stage", "arch", "ran on", "passed", "worst cos", "Δ base", "µs (bench)", "roofline", "Δ speed",
           "regs/spill/smem", "fresh")
# What goes first when the terminal is too narrow for everything: a column (never stage, arch,
# ran on, passed, worst cos: a row without them says nothing), or the host (`ran on: host`) and
# then all but the GPU's model (`ran on: gpu`) of the ran-on column. Nothing is ever cut.
SQUEEZE = ("Δ speed", "roofline", "Δ base", "ran on: host", "regs/spill/smem", "µs (bench)", "fresh", "ran on: gpu")


def _ran_on(c: Cell, squeezed: set[str]) -> str:
    if not c.gpu or "ran on: host" not in squeezed:
        return c.ran
    return c.gpu.split()[0] if "ran on: gpu" in squeezed else c.gpu


def _row(stage: Stage, arch: str, c: Cell, first: bool, squeezed: set[str] = frozenset()) -> dict[str, Text]:
    fresh = "—" if c.age == "—" else f"{STALE_MARK if c.stale else '✓'} {c.age}"
    texts = {"stage": stage.name if first else "", "arch": arch, "ran on": _ran_on(c, squeezed), "passed": c.passed,
             "worst cos": c.cosine, "Δ base": c.delta, "µs (bench)": c.us, "roofline": c.roof,
             "regs/spill/smem": c.resources, "fresh": fresh, "Δ speed": c.speed}
    return {k: Text(v, style=c.style if k == "ran on" else "") for k, v in texts.items()}


def _table(rows: list[dict[str, Text]], columns: list[str]) -> Table:
    table = Table(title="dsv4-lab dashboard", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True,
                  title_justify="left")
    for col in columns:
        table.add_column(col, no_wrap=True, overflow="fold")
    for row in rows:
        table.add_row(*(row[col] for col in columns))
    return table


def _natural_width(rows: list[dict[str, Text]], columns: list[str]) -> int:
    """The width one line of the table takes with every cell whole."""
    from rich.console import Console

    wide = Console(width=10_000)
    return wide.measure(_table(rows, columns)).maximum


def render(root: Path, width: int = 160) -> Group | Text:
    """One line per stage × arch, with every number whole: the columns that do not fit `width`
    are left out (and named), never cut."""
    spec = load_spec(root=root)
    warn: list[str] = []
    records = read_records(root, list(spec.stages), warn, bench=True)
    print_warnings(warn)
    baselines = {(b.stage, b.arch, b.case): b for b in load_baselines(root)}
    if not records and not any(b.kind == "suite" for b in baselines.values()):  # a suite's may all be retired
        return Text("No records yet. Start with: dsv4-lab run stage-A   (with no GPU it compiles both archs "
                    "and records that nothing ran)")
    from harness.notebook.speedbaselines import load as load_speed

    speed = {(b.stage, b.arch, b.case): b for b in load_speed(root)}
    now = time.time()
    cells: list[tuple[Stage, str, Cell, bool]] = []
    not_run: dict[str, list[str]] = {}
    for st in spec.stages.values():
        for i, arch in enumerate(st.kernels):
            c = cell(spec, st, arch, records, baselines, now, speed)
            cells.append((st, arch, c, i == 0))
            if c.not_run:
                not_run.setdefault(c.not_run, [])
                if arch not in not_run[c.not_run]:
                    not_run[c.not_run].append(arch)
    columns = [col for col in COLUMNS if speed or col != "Δ speed"]  # the column only where speed is baselined
    squeezed: set[str] = set()
    rows = [_row(st, arch, c, first) for st, arch, c, first in cells]
    for step in SQUEEZE:
        if _natural_width(rows, columns) <= width:
            break
        squeezed.add(step)
        if step in columns:
            columns.remove(step)
        rows = [_row(st, arch, c, first, squeezed) for st, arch, c, first in cells]
    shown_as = {"ran on: host": "the host in ran on", "ran on: gpu": "all but the GPU's model in ran on"}
    left_out = [shown_as.get(step, step) for step in SQUEEZE if step in squeezed and (speed or step != "Δ speed")]
    notes = [Text(f"○ {', '.join(archs)}: compiled, not run: {why}", style="yellow") for why, archs in not_run.items()]
    legend = Text("✓ pass/fresh  ✗ failure  ○ compiled, not run (never verified)  "
                  f"{STALE_MARK} stale: the source changed since this result — re-run it", style="dim")
    parts: list = [_table(rows, columns), *notes, legend]
    if left_out:
        parts.append(Text(f"left out to fit {width} columns: {', '.join(left_out)} (a wider terminal shows them)",
                          style="dim"))
    return Group(*parts)


def main(root: Path, watch: bool = False, interval: float = 2.0) -> int:
    """Print the dashboard (`watch`: again every `interval` seconds until Ctrl-C, exit 130)."""
    import os

    from rich.console import Console

    from harness.execution.report import make_console

    console = make_console()
    columns = os.environ.get("COLUMNS", "")
    if not console.is_terminal and columns.isdigit() and int(columns) > 0:  # piped, with a width given
        console = Console(width=int(columns), no_color=True)
    if not watch:
        console.print(render(root, console.width))
        return 0
    try:
        if console.is_terminal:
            from rich.live import Live

            with Live(render(root, console.width), console=console, refresh_per_second=4, screen=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(render(root, console.width))
        else:  # piped: a fresh table each interval, flushed
            import sys

            while True:
                console.print(f"--- {time.strftime('%H:%M:%S')}", highlight=False)
                console.print(render(root, console.width))
                sys.stdout.flush()
                time.sleep(interval)
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends: interrupted, as every command says it (130)
        return 130
