"""`dsv4-lab history`: one case's metrics across commits."""

from __future__ import annotations

from typing import Optional

import typer

from harness.commands.base import Command, archs_of, cases_of, option, spec_here


def history_cmd(ctx: typer.Context, stage: str = typer.Argument(...), arch: str = option("arch", "all"),
                where: Optional[str] = option("where", None)) -> None:
    """One case's metrics across commits, oldest first, with a trend line."""
    from harness.workflows import history

    spec = spec_here()
    st = spec.stage(stage)
    raise typer.Exit(history.main(spec, st, archs_of(arch), cases_of(st, ctx.args, where)))


COMMANDS = [Command("history", history_cmd, axes="matrix")]
