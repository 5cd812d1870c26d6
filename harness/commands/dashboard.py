"""`dsv4-lab dashboard`: where every stage stands, stages × arch."""

from __future__ import annotations

import math

import typer

from harness.commands.base import Command, UsageError, option
from harness.core.paths import lab_root


def dashboard_cmd(watch: bool = option("watch", False, help="refresh while records arrive"),
                  interval: float = option("interval", 2.0, help="seconds between refreshes with --watch")) -> None:
    """Where every stage stands: stages × arch."""
    from harness.workflows import dashboard

    if not (math.isfinite(interval) and interval > 0):
        raise UsageError(f"--interval {interval:g}: must be a finite number of seconds > 0 (e.g. --interval 2)")
    raise typer.Exit(dashboard.main(lab_root(), watch=watch, interval=interval))


COMMANDS = [Command("dashboard", dashboard_cmd)]
