"""`dsv4-lab show ID`: a record or a run in full (the record viewer; not `baseline show`)."""

from __future__ import annotations

import typer

from harness.commands.base import Command
from harness.core.paths import lab_root


def show_cmd(record_or_run: str = typer.Argument(..., help="a record id (RUN.N) or a run id")) -> None:
    """A record or a run in full, error text and notes included."""
    from harness.workflows import history

    raise typer.Exit(history.show(lab_root(), record_or_run))


COMMANDS = [Command("show", show_cmd)]
