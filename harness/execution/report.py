"""What the user sees of a run and of a compile: live progress, one line per finished case,
a results table, and a plain statement of what did not run and why."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.core.labels import case_label
from harness.spec.matrix import Case
from harness.notebook.records import Record, run_peer_us, status_counts
from harness.spec.spec import Spec, Stage

from harness.core.statuses import STYLE as STATUS_STYLE
from harness.core.console import make_console  # noqa: F401  (re-exported)
from harness.notebook.recordview import case_line, worst  # noqa: F401  (case_line re-exported)


def _fmt(x: Any, spec: str = ".6f") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def results_table(records: list[Record]) -> Table:
    t = Table(title="results", show_lines=False)
    peers = any(run_peer_us(r) is not None for r in records)
    several_gpus = len({r.gpu for r in records if r.gpu is not None}) > 1  # a run spread over GPUs
    cols = ["stage", "arch", "case", "status", "cosine", "rel L2", "max abs", "regs/spill", "µs", "TFLOP/s"]
    cols += ["torch µs"] if peers else []
    cols += ["gpu"] if several_gpus else []
    for col in cols:  # a case label is never cut (two cases never read alike): folded, or printed whole
        t.add_column(col, justify="left" if col in ("stage", "arch", "case", "status", "regs/spill") else "right",
                     no_wrap=col != "case", overflow="fold" if col == "case" else "ellipsis")
    for r in records:
        glyph, style = STATUS_STYLE.get(r.status, ("?", "white"))
        res = r.compile or {}
        regs = f"{res['regs']}/{res.get('spill', 0)}" if "regs" in res else "—"
        t.add_row(
            escape(r.stage), escape(r.arch), escape(case_label(r.case)),
            f"[{style}]{glyph} {r.status}[/]",
            _fmt(worst(r, "cosine"), ".7f"), _fmt(worst(r, "rel_l2", max), ".2e"), _fmt(worst(r, "max_abs", max), ".2e"),
            regs, _fmt(r.timing.get("us") if r.timing else None, ".2f"),
            _fmt(r.timing.get("tflops") if r.timing else None, ".1f"),
            *([_fmt(run_peer_us(r), ".2f")] if peers else []),
            *([_fmt(r.gpu)] if several_gpus else []),
        )
    return t


def summary_lines(records: list[Record], interrupted: bool, reasons: dict[str, str], *, planned: int | None = None,
                  errors: list[str] | None = None, signal_name: str | None = None) -> list[str]:
    counts = status_counts(records)
    ran = sum(v for k, v in counts.items() if k not in ("compiled", "compile_error", "skipped", "prepared"))
    lines = [" · ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no cases"]
    for arch, why in sorted(reasons.items()):
        n = sum(1 for r in records if r.arch == arch and r.status == "compiled")
        if n:
            lines.append(f"{arch}: {n} case(s) {why}. Nothing was run or verified for {arch}.")
    for arch in sorted({r.arch for r in records if r.status == "prepared"}):
        n = sum(1 for r in records if r.arch == arch and r.status == "prepared")
        lines.append(f"{arch}: {n} case(s) prepared: the host path ran up to the launch on a GPU of another arch "
                     f"(--prepare). Nothing was launched or verified for {arch}.")
    if records and ran == 0:
        lines.append("No case ran on a GPU in this run.")
    for err in errors or []:
        lines.append(f"The run itself failed: {err}")
    if planned is not None and len(records) < planned and not interrupted:
        lines.append(f"{planned - len(records)} of {planned} planned case(s) have no result: this run proved "
                     "nothing about them.")
    if interrupted:
        how = f" by {signal_name}" if signal_name else ""
        lines.append(f"Interrupted{how}: every finished case is recorded; the run is marked interrupted.")
    return lines


def run_local_and_report(spec: Spec, stages: list[Stage], archs: list[str] | None, cases: dict[str, list[Case]],
                         *, bench: bool, gpus: list[int] | None, workers_per_gpu: int, timeout: float | None,
                         seed: int, argv: list[str], shard: tuple[int, int] | None = None, record: bool = False,
                         debug_hangs: bool = False, prepare: bool = False) -> int:
    """`dsv4-lab run` here: progress, a line per case, the table and the summary.  A case this machine
        cannot run is not recorded again when it repeats its newest fresh record, unless `record`."""
    from harness.execution.runner import RunOptions, Runner, tasks_for

    tasks = tasks_for(stages, archs, lambda st: cases[st.id])
    if shard is not None:
        i, n = shard
        tasks = tasks[i::n]
    opts = RunOptions(tasks=tasks, bench=bench, gpus=gpus, workers_per_gpu=workers_per_gpu,
                      timeout_s=timeout, seed=seed, argv=argv, only_new=not record, debug_hangs=debug_hangs,
                      prepare=prepare)
    console = make_console()
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    bar = progress.add_task("compiling + running", total=len(tasks))

    show_trace = bool(os.environ.get("DSV4_LAB_TRACEBACK"))

    def on_record(rec: Record) -> None:
        line = case_line(rec)
        if rec.id in runner.unchanged:
            line += f"  [dim]unchanged: as recorded in {escape(rec.id)}[/]"
        progress.console.print(line, highlight=False)
        if rec.trace and show_trace:  # `--traceback`: the kept traceback, as well as the one line
            progress.console.print(rec.trace.rstrip(), highlight=False, markup=False)
        elif rec.trace:
            progress.console.print(f"    full traceback: dsv4-lab show {rec.id}  (or run with --traceback)",
                                   highlight=False, markup=False, style="dim")
        progress.advance(bar)

    runner = Runner(spec, opts, on_record=on_record)
    console.print(f"[bold]run {runner.run_id}[/]: {len(tasks)} case(s) — "
                  + ", ".join(f"{escape(st.name)} ({len(cases[st.id])})" for st in stages), highlight=False)
    with progress:
        summary = runner.run()
    if summary.records:
        print_whole(console, results_table(summary.records))
    signal_name = signal.Signals(summary.signum).name if summary.signum else None
    for line in summary_lines(summary.records, summary.interrupted, summary.no_device_reason,
                              planned=summary.planned, errors=summary.errors, signal_name=signal_name):
        console.print(line, highlight=False, markup=False)
    files = sorted(runner.files_written)
    if files:
        shown = ", ".join(_display_path(p, spec.root) for p in files)
        console.print(f"records: {shown} (run {summary.run_id})", highlight=False, markup=False)
    elif runner.unchanged:
        console.print(f"records: none written — every case compiled to what its newest record already says "
                      f"(to record them anyway: --record)", highlight=False, markup=False)
    else:
        console.print(f"records: none written (run {summary.run_id})", highlight=False, markup=False)
    if summary.interrupted:  # the one line a user sees on the terminal when stdout goes to a file or a pipe
        of = f" of {summary.planned}" if summary.planned is not None else ""
        print(f"dsv4-lab: interrupted{f' by {signal_name}' if signal_name else ''} — {len(summary.records)}{of} "
              f"case(s) finished (run {summary.run_id})", file=sys.stderr, flush=True)
    return summary.exit_code


def _display_path(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def compile_line(done) -> str:
    """One finished compile as rich markup: status, arch, the whole case label, time, resources,
        whether a record was written."""
    from harness.core.console import printable
    from harness.notebook.inventory import mma_counts

    res, rec = done.result, done.record
    glyph, style = STATUS_STYLE.get(rec.status, ("?", "white"))
    parts = [f"[{style}]{glyph} {escape(rec.status):<13}[/]", f"{escape(rec.stage):<3} {escape(rec.arch):<8}",
             escape(printable(done.job.case.label)), f"{res.seconds:.1f} s" + (" (cached)" if res.cached else "")]
    if not res.ok:
        first = (res.error or "").splitlines()[0] if (res.error or "").strip() else (res.error or "")
        parts.append(f"[dim]{escape(printable(first))}[/]")
        return "  ".join(parts)
    r = res.resources
    if "regs" in r:
        parts.append(f"regs {r['regs']}/{r.get('spill', 0)}")
    if r.get("smem", r.get("static_smem")) is not None:
        parts.append(f"smem {r.get('smem', r.get('static_smem'))}")
    parts.append(f"MMA {sum(mma_counts(res.inventory).values())}")
    if done.same_as is not None:
        parts.append(f"[dim]unchanged: as recorded in {escape(done.same_as)}[/]")
    return "  ".join(parts)


def compile_table(title: str, rows: list[tuple[str, ...]]) -> Table:
    """The compile summary table; a case label is never cut (printed whole, or folded on a narrow
        terminal); the inventory wraps."""
    table = Table(title=title)
    for col in ("arch", "case", "status", "s", "regs", "spill", "smem", "bar", "MMA", "inventory"):
        table.add_column(col, no_wrap=col not in ("case", "inventory"),
                         overflow="fold" if col == "case" else "ellipsis")
    for row in rows:
        table.add_row(*row)
    return table


def print_whole(console: Console, table: Table) -> None:
    """Print `table` without cutting a cell: at the width it needs when the output is no terminal,
        at the terminal's width on one (where the compile table folds a label)."""
    if console.is_terminal:
        console.print(table)
        return
    need = Measurement.get(console, console.options.update_width(100_000), table).maximum
    if need <= console.width:
        console.print(table)
        return
    Console(width=need, no_color=True, file=console.file, highlight=False).print(table)


def compile_and_report(spec: Spec, stage: Stage, archs: list[str], cases: list[Case], keep: Path | None,
                       argv: list[str] | None = None, record: bool = False) -> int:
    """`dsv4-lab compile`: compile each case (parallel, cached) with a progress bar, write a record per
        case unless it repeats the newest fresh one (`record` writes it anyway), print resources and
        the inventory; exit 1 with the one-line error on a failure."""
    import shutil

    from harness.execution.compilerun import CompileJob, compile_recorded
    from harness.core.console import printable
    from harness.notebook.inventory import SASS_MISSING, families, find_tool, mma_counts, sass_tool
    from harness.notebook.records import stage_file

    # the families shown per case (the full inventory is in the record: `dsv4-lab show ID`, `compile --diff`)
    SHOWN = ("wgmma", "mma.sync", "tcgen05.mma", "tcgen05.ld", "tcgen05.st", "cp.async.bulk.tensor", "stmatrix",
             "ldmatrix", "mbarrier")

    console = make_console()
    rows: list[tuple[str, ...]] = []
    jobs = [CompileJob(stage, a, c) for a in archs for c in cases]
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    bar = progress.add_task("compiling", total=len(jobs))

    def show(done) -> None:
        res, rec = done.result, done.record
        arch, label = done.job.arch, escape(printable(done.job.case.label))
        progress.console.print(compile_line(done), highlight=False)
        progress.advance(bar)
        if not res.ok:
            rows.append((arch, label, "[red]✗ compile_error[/]", f"{res.seconds:.1f}", "", "", "", "", "", ""))
            progress.console.print(f"    full traceback: dsv4-lab show {rec.id}", highlight=False, markup=False,
                                   style="dim")
            return
        r = res.resources
        mma = sum(mma_counts(res.inventory).values())
        inv = ", ".join(f"{k} {v}" for k, v in families(res.inventory).items() if v and k in SHOWN)
        rows.append((arch, label, "[green]✓ compiled[/]" + (" (cached)" if res.cached else ""),
                     f"{res.seconds:.1f}", _fmt(r.get("regs")), _fmt(r.get("spill")),
                     _fmt(r.get("smem", r.get("static_smem"))), _fmt(r.get("barriers")), str(mma), inv))
        if keep is not None:
            dest = keep / arch / done.job.case.label.replace(",", "_").replace("=", "")
            dest.mkdir(parents=True, exist_ok=True)
            for src in (res.ptx_path, res.cubin_path, res.sass_path):
                if src and Path(src).is_file():
                    shutil.copy(src, dest / Path(src).name)

    console.print(f"[bold]compile {escape(stage.name)}[/]: {len(jobs)} case(s) — {', '.join(archs)}", highlight=False)
    with progress:
        run_id, done = compile_recorded(spec, jobs, argv or ["compile", stage.name], on_done=show,
                                        only_new=not record)
    failed = sum(1 for d in done if not d.result.ok)
    print_whole(console, compile_table(f"{stage.name} compile", rows))
    if not find_tool("ptxas"):
        console.print("registers / spills: ptxas is not installed here, so they are not reported", highlight=False)
    if sass_tool() is None:
        console.print(SASS_MISSING, highlight=False, markup=False)
    if keep is not None:
        console.print(f"PTX / cubin{' / SASS' if sass_tool() else ''} kept in {keep}", highlight=False)
    same = sum(1 for d in done if d.same_as is not None)
    written = len(done) - same
    where = stage_file(spec.root, stage.id)
    if not written:
        console.print(f"records: none written — every case compiled to what its newest record already says "
                      f"(to record them anyway: --record)", highlight=False, markup=False)
    elif same:
        console.print(f"records: {written} written to {where} (run {run_id}); {same} case(s) unchanged, not "
                      f"recorded again (--record records them)", highlight=False, markup=False)
    else:
        console.print(f"records: {where} (run {run_id})", highlight=False, markup=False)
    return 1 if failed else 0
