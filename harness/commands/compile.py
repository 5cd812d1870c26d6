"""`dsv4-lab compile`: compile a stage's cases (no GPU needed) — inventory, resources, records."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from harness.commands.base import Command, UsageError, archs_of, cases_of, option, precheck, spec_here


def compile_stage(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="stage name"),
    arch: str = option("arch", "all", help="sm_90a, sm_100a or all"),
    where: Optional[str] = option("where", None, help="filters, e.g. hd=512"),
    keep: Optional[Path] = option("keep", None, help="copy PTX and cubin (and SASS when the CUDA binary tools are here) to this folder"),
    diff: Optional[str] = option("diff", None, help="show what changed in inventory and resources against a commit (e.g. HEAD~1)"),
    record: bool = option("record", False, help="write a record for every case, also where it says what the "
                                                "case's newest record for this source already says"),
) -> None:
    """Compile only (no GPU needed): instruction inventory, registers / shared memory / spills; a record per case
    whose result is new (nothing is written for a case compiled to what its newest record says, unless --record)."""
    from harness.execution.report import compile_and_report

    spec = spec_here()
    st = spec.stage(stage)
    archs = archs_of(arch) or list(st.kernels)
    for a in archs:
        if a not in st.kernels:
            raise UsageError(f"{st.name} has no {a} kernel (it has {', '.join(st.kernels)})")
    cases = cases_of(st, ctx.args, where)
    if not cases:
        raise UsageError("no case matches these filters")
    precheck(spec, [st])
    if diff is not None:
        from harness.execution.compilediff import diff_main

        raise typer.Exit(diff_main(spec, st, archs, cases, diff))
    raise typer.Exit(compile_and_report(spec, st, archs, cases, keep, argv=["compile"] + sys.argv[2:], record=record))


COMMANDS = [Command("compile", compile_stage, axes="matrix")]
