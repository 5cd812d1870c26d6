"""`dsv4-lab note RUN "text"`: annotate a run."""

from __future__ import annotations

import typer

from harness.commands.base import Command
from harness.core.paths import lab_root


def note_cmd(run: str = typer.Argument(...), text: str = typer.Argument(...)) -> None:
    """Annotate a run; shown by show and history."""
    from harness.workflows import history

    raise typer.Exit(history.note(lab_root(), run, text))


COMMANDS = [Command("note", note_cmd)]
