"""`history`, `show` and `note`: a case across commits, one record or run in full, and
annotations of runs."""

from __future__ import annotations

import json
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from harness.core.console import make_console
from harness.notebook import retired
from harness.notebook.recordview import worst
from harness.core.labels import case_label
from harness.notebook.records import append_event, notes_file, now_iso, print_warnings, read_notes, read_records, read_runs

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None]) -> str:
    """One character per value, scaled between the smallest and largest; '·' for missing."""
    known = [v for v in values if v is not None]
    if not known:
        return "·" * len(values)
    lo, hi = min(known), max(known)
    span = hi - lo
    out = []
    for v in values:
        if v is None:
            out.append("·")
        else:
            out.append(SPARK[0] if span == 0 else SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1) + 0.5))])
    return "".join(out)


def _digits(cos: float | None) -> float | None:
    """Cosine as 'nines' (-log10(1 - cos)): a trend that shows small moves near 1."""
    import math

    if cos is None:
        return None
    return 16.0 if cos >= 1.0 else -math.log10(max(1e-16, 1.0 - cos))


def main(spec, stage, archs: list[str] | None, cases) -> int:
    console = make_console()
    warn: list[str] = []
    records = read_records(spec.root, [stage.id], warn)
    print_warnings(warn)
    notes = read_notes(spec.root, warn)
    wanted = [c.dict for c in cases]
    shown = 0
    for arch in stage.kernels:
        if archs and arch not in archs:
            continue
        for case in wanted:
            rows = [r for r in records if r.arch == arch and r.case == case]
            if not rows:
                continue
            shown += 1
            label = case_label(case)
            t = Table(title=f"{stage.name} {arch} {label}")
            for col in ("time", "commit", "run", "status", "cosine", "rel L2", "µs", "note"):
                t.add_column(col)
            for r in rows:
                commit = str(r.code.get("commit") or "none")[:8] + ("*" if r.code.get("dirty") else "")
                note = escape("; ".join(n["text"] for n in notes.get(r.run, [])))
                timing = r.timing or {}
                t.add_row(r.t.replace("T", " ").rstrip("Z"), commit, r.run, r.status,
                          _f(worst(r, "cosine"), ".9f"), _f(worst(r, "rel_l2", max), ".2e"),
                          _f(timing.get("us"), ".2f"), note)
            console.print(t)
            cos = [_digits(worst(r, "cosine")) for r in rows]
            console.print(f"  cosine (nines, higher is better)  {sparkline(cos)}", highlight=False)
            us = [(r.timing or {}).get("us") for r in rows]
            if any(u is not None for u in us):
                console.print(f"  µs (lower is better)              {sparkline(us)}", highlight=False)
            console.print("  commit* = recorded from a tree with uncommitted changes", style="dim", highlight=False)
    if not shown:
        console.print(f"no records for {stage.name} with these filters — run: dsv4-lab run {stage.name}", highlight=False)
    for entry in retired.of_stage(spec.root, stage.id):  # older records left the tree; git holds them
        console.print(retired.line(entry), highlight=False, markup=False, soft_wrap=True)
    return 0 if shown else 1


def speed(spec, stage, archs: list[str] | None, cases: list[dict]) -> int:
    """`history STAGE --speed`: each bench shape's timed records across commits, oldest first — µs,
        spread, GPU, Δ against the speed baseline (its GPU model only), an A/B verdict for a
        `bench --compare` record — with a trend line."""
    from harness.notebook.speedbaselines import find, load

    console = make_console()
    warn: list[str] = []
    records = [r for r in read_records(spec.root, [stage.id], warn, bench=True)
               if r.is_bench and r.status == "pass" and r.timing]
    print_warnings(warn)
    base = load(spec.root)
    shown = 0
    for arch in stage.kernels:
        if archs and arch not in archs:
            continue
        for case in cases:
            rows = [r for r in records if r.arch == arch and r.case == case]
            if not rows:
                continue
            shown += 1
            label = case_label(case)
            b = find(base, stage.id, arch, label)
            t = Table(title=f"{stage.name} {arch} {label} — speed" +
                      (f" (baseline {b.us:.2f} µs on {b.gpu_name or '?'}, {b.record})" if b else ""))
            for col in ("time", "commit", "run", "µs", "spread", "GPU", "Δ base", "A/B"):
                t.add_column(col)
            for r in rows:
                tm = r.timing or {}
                commit = str(r.code.get("commit") or "none")[:8] + ("*" if r.code.get("dirty") else "")
                gpu = str(tm.get("gpu_name") or r.env.get("gpu") or "?").removeprefix("NVIDIA ")
                same = b is not None and tm.get("gpu_name") == b.gpu_name
                c = r.compare or {}
                ab = f"{c['verdict']} ×{c['ratio']:.3f} vs {c['commit'][:8]}" if "verdict" in c else ""
                t.add_row(r.t.replace("T", " ").rstrip("Z"), commit, r.run, _f(tm.get("us"), ".2f"),
                          _f(tm.get("spread"), ".1%"), escape(gpu), f"{tm['us'] / b.us - 1:+.1%}" if same else "—",
                          escape(ab))
            console.print(t)
            console.print(f"  µs (lower is better)  {sparkline([(r.timing or {}).get('us') for r in rows])}",
                          highlight=False)
    if not shown:
        console.print(f"no timed bench records for {stage.name} with these filters — run: dsv4-lab bench {stage.name}",
                      highlight=False)
        return 1
    console.print("  commit* = recorded from a tree with uncommitted changes; Δ base only on the baseline's GPU "
                  "model; a Δ between runs is not a verdict (bench --compare is)", style="dim", highlight=False)
    return 0


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _usage_error(text: str) -> None:
    """A name that names nothing: one line on stderr, as every usage error (the caller exits 2)."""
    import sys

    from harness.core.console import printable

    print(f"dsv4-lab: {printable(text)}", file=sys.stderr)


def show(root: Path, ident: str) -> int:
    console = make_console()
    warn: list[str] = []
    records = read_records(root, None, warn, bench=True)
    runs = read_runs(root, warn)
    notes = read_notes(root, warn)
    print_warnings(warn)
    rec = next((r for r in records if r.id == ident), None)
    if rec is not None:
        shown = {k: v for k, v in json.loads(rec.to_json()).items() if k != "trace"}
        console.print_json(json.dumps(shown))
        if rec.profile:
            from harness.execution.ncuprofile import lines

            for line in lines(rec.profile):
                console.print(line, highlight=False, markup=False)
        if rec.profile and rec.compare and isinstance(rec.compare.get("profile"), dict):
            from harness.execution.ncuprofile import side_by_side

            for line in side_by_side(rec.compare["profile"], rec.profile, str(rec.compare.get("rev", "REV"))):
                console.print(line, highlight=False, markup=False)
        if rec.compare and "ratio" in rec.compare:
            from harness.execution.abbench import compare_line

            console.print("compared:" + compare_line(rec), highlight=False, markup=False)
        if rec.trace:
            console.print("traceback (kept in the record):", highlight=False)
            console.out(rec.trace, highlight=False)
        for n in notes.get(rec.run, []):
            console.print(f"note ({n.get('t', '?')}): {n['text']}", highlight=False, markup=False)
        return 0
    of_run = [r for r in records if r.run == ident]
    gone = retired.where(root, ident) if not of_run else None
    if gone is not None and (gone[0] == "record" or ident not in runs):
        console.print(retired.say(gone[0], ident, gone[1]), highlight=False, markup=False, soft_wrap=True)
        return 1
    if ident not in runs and not of_run:
        _usage_error(f"no record or run '{ident}' — ids look like 20261121-142649-5461 (run) or "
                     "20261121-142649-5461.3 (record); see `dsv4-lab history`")
        return 2
    from harness.execution.report import results_table

    ev = runs.get(ident, {})
    console.print(f"run {ident}  target {ev.get('target', '?')}  argv {' '.join(map(str, ev.get('argv', [])))}  "
                  f"interrupted {ev.get('interrupted', 'unknown (no end event)')}", highlight=False, markup=False)
    if of_run:
        console.print(results_table(of_run))
        for r in of_run:
            if r.error and r.status != "pass":
                console.print(f"{r.id} {r.status}: {r.error}", highlight=False, markup=False)
        for entry in retired.read_retired(root):  # its other lines of a stage, retired: where git holds them
            if isinstance(entry.get("ids"), dict) and isinstance(entry["ids"].get(ident), str):
                console.print(retired.say("run", ident, entry), highlight=False, markup=False, soft_wrap=True)
    elif gone is not None:
        console.print(retired.say(gone[0], ident, gone[1]), highlight=False, markup=False, soft_wrap=True)
    for n in notes.get(ident, []):
        console.print(f"note ({n.get('t', '?')}): {n['text']}", highlight=False, markup=False)
    return 0


def note(root: Path, run: str, text: str) -> int:
    console = make_console()
    runs = read_runs(root)
    known = run in runs or any(r.run == run for r in read_records(root, bench=True))
    if not known:
        _usage_error(f"no run '{run}' — see `dsv4-lab dashboard` or results/runs.jsonl for run ids")
        return 2
    if not text.strip():
        _usage_error("an empty note says nothing — give some text")
        return 2
    append_event(notes_file(root), {"run": run, "t": now_iso(), "text": text.strip()})
    console.print(f"noted on run {run}", highlight=False)
    return 0
