"""What the user sees of a run and of a compile: live progress, one line per finished case,
a results table, and a plain statement of what did not run and why."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.matrix import Case
from harness.records import Record, status_counts
from harness.spec import Spec, Stage

from harness.statuses import STYLE as STATUS_STYLE
from harness.console import case_line, make_console, worst  # noqa: F401  (make_console, case_line re-exported)


def _fmt(x: Any, spec: str = ".6f") -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def results_table(records: list[Record]) -> Table:
    t = Table(title="results", show_lines=False)
    peers = any(r.timing and r.timing.get("peer_us") is not None for r in records)
    several_gpus = len({r.gpu for r in records if r.gpu is not None}) > 1  # a run spread over GPUs
    cols = ["stage", "arch", "case", "status", "cosine", "rel L2", "max abs", "regs/spill", "µs", "TFLOP/s"]
    cols += ["torch µs"] if peers else []
    cols += ["gpu"] if several_gpus else []
    for col in cols:
        t.add_column(col, justify="left" if col in ("stage", "arch", "case", "status", "regs/spill") else "right")
    for r in records:
        glyph, style = STATUS_STYLE.get(r.status, ("?", "white"))
        res = r.compile or {}
        regs = f"{res['regs']}/{res.get('spill', 0)}" if "regs" in res else "—"
        t.add_row(
            r.stage, r.arch, ",".join(f"{k}={v}" for k, v in r.case.items()),
            f"[{style}]{glyph} {r.status}[/]",
            _fmt(worst(r, "cosine"), ".7f"), _fmt(worst(r, "rel_l2", max), ".2e"), _fmt(worst(r, "max_abs", max), ".2e"),
            regs, _fmt(r.timing.get("us") if r.timing else None, ".2f"),
            _fmt(r.timing.get("tflops") if r.timing else None, ".1f"),
            *([_fmt(r.timing.get("peer_us") if r.timing else None, ".2f")] if peers else []),
            *([_fmt(r.gpu)] if several_gpus else []),
        )
    return t


def summary_lines(records: list[Record], interrupted: bool, reasons: dict[str, str]) -> list[str]:
    counts = status_counts(records)
    ran = sum(v for k, v in counts.items() if k not in ("compiled", "compile_error", "skipped"))
    lines = [" · ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no cases"]
    for arch, why in sorted(reasons.items()):
        n = sum(1 for r in records if r.arch == arch and r.status == "compiled")
        if n:
            lines.append(f"{arch}: {n} case(s) {why}. Nothing was run or verified for {arch}.")
    if records and ran == 0:
        lines.append("No case ran on a GPU in this run.")
    if interrupted:
        lines.append("Interrupted: every finished case is recorded; the run is marked interrupted.")
    return lines


def run_local_and_report(spec: Spec, stages: list[Stage], archs: list[str] | None, cases: dict[str, list[Case]],
                         *, bench: bool, gpus: list[int] | None, workers_per_gpu: int, timeout: float | None,
                         seed: int, argv: list[str], shard: tuple[int, int] | None = None) -> int:
    from harness.runner import RunOptions, Runner, tasks_for

    tasks = tasks_for(stages, archs, lambda st: cases[st.id])
    if shard is not None:
        i, n = shard
        tasks = tasks[i::n]
    opts = RunOptions(tasks=tasks, bench=bench, gpus=gpus, workers_per_gpu=workers_per_gpu,
                      timeout_s=timeout, seed=seed, argv=argv)
    console = make_console()
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    bar = progress.add_task("compiling + running", total=len(tasks))

    def on_record(rec: Record) -> None:
        progress.console.print(case_line(rec), highlight=False)
        progress.advance(bar)

    runner = Runner(spec, opts, on_record=on_record)
    console.print(f"[bold]run {runner.run_id}[/]: {len(tasks)} case(s) — "
                  + ", ".join(f"{st.name} ({len(cases[st.id])})" for st in stages), highlight=False)
    with progress:
        summary = runner.run()
    if summary.records:
        console.print(results_table(summary.records))
    for line in summary_lines(summary.records, summary.interrupted, summary.no_device_reason):
        console.print(line, highlight=False)
    console.print(f"records: results/records/<stage>.jsonl (run {summary.run_id})", highlight=False)
    return summary.exit_code


def compile_and_report(spec: Spec, stage: Stage, archs: list[str], cases: list[Case], keep: Path | None) -> int:
    """`dsv4-lab compile`: compile each case in this process's pools; print inventory and
    resources; non-zero exit with the compiler's message on an error."""
    import shutil
    import subprocess

    from harness.compile import Compiler

    console = make_console()
    compiler = Compiler(spec.root)
    failed = 0
    table = Table(title=f"{stage.name} compile")
    for col in ("arch", "case", "status", "s", "regs", "spill", "smem", "inventory"):
        table.add_column(col)
    try:
        futs = [(a, c, compiler.submit(stage, a, c.dict)) for a in archs for c in cases]
        for arch, case, fut in futs:
            try:
                res = fut.result()
            except Exception as exc:
                res = None
                err = f"compiler process failed: {exc}"
            if res is None or not res.ok:
                failed += 1
                err = res.error if res else err
                table.add_row(arch, case.label, "[red]✗ compile_error[/]", "", "", "", "", "")
                console.print(f"[red]{arch} {case.label}: compile error[/]\n{err}", highlight=False)
                continue
            inv = ", ".join(f"{k} {v}" for k, v in res.inventory.items() if v)
            r = res.resources
            table.add_row(arch, case.label, "[green]✓ compiled[/]" + (" (cached)" if res.cached else ""),
                          f"{res.seconds:.1f}", _fmt(r.get("regs")), _fmt(r.get("spill")),
                          _fmt(r.get("smem", r.get("static_smem"))), inv)
            if keep is not None:
                dest = keep / arch / case.label.replace(",", "_").replace("=", "")
                dest.mkdir(parents=True, exist_ok=True)
                for src in (res.ptx_path, res.cubin_path):
                    if src and Path(src).is_file():
                        shutil.copy(src, dest / Path(src).name)
                cuobjdump = shutil.which("cuobjdump")
                if cuobjdump and res.cubin_path:
                    sass = subprocess.run([cuobjdump, "-sass", res.cubin_path], capture_output=True, text=True)
                    (dest / "kernel.sass").write_text(sass.stdout)
    finally:
        compiler.close()
    console.print(table)
    if not shutil.which("ptxas"):
        console.print("registers / spills: ptxas is not installed here, so they are not reported", highlight=False)
    if keep is not None:
        console.print(f"PTX / cubin{' / SASS' if shutil.which('cuobjdump') else ''} kept in {keep}", highlight=False)
    return 1 if failed else 0
