"""`dsv4-lab history`: one case's metrics across commits."""

from __future__ import annotations

from typing import Optional

import typer

from harness.commands.base import Command, archs_of, cases_of, filter_pairs, option, spec_here
from harness.execution.bench import BenchError


def history_cmd(ctx: typer.Context, stage: str = typer.Argument(...), arch: str = option("arch", "all"),
                where: Optional[str] = option("where", None),
                speed: bool = option("speed", False, help="µs per bench shape across commits (timed bench records, "
                                                          "Δ against the speed baseline); axis filters then filter "
                                                          "the bench shapes")) -> None:
    """One case's metrics across commits, oldest first, with a trend line."""
    from harness.workflows import history

    spec = spec_here()
    st = spec.stage(stage)
    if speed:
        from harness.execution.bench import plan_cases

        raise typer.Exit(history.speed(spec, st, archs_of(arch), plan_cases(st, filter_pairs(ctx.args, where))))
    raise typer.Exit(history.main(spec, st, archs_of(arch), cases_of(st, ctx.args, where)))


COMMANDS = [Command("history", history_cmd, axes="matrix", errors=(BenchError,))]
