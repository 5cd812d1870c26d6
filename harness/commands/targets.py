"""`dsv4-lab targets list|check NAME`: the remote targets (SSH) of targets.yaml."""

from __future__ import annotations

import typer

from harness.commands.base import Command, Group
from harness.paths import lab_root
from harness.targets import TargetError

TARGETS = Group("targets", "Remote targets (SSH).")


def targets_list() -> None:
    """The targets declared in targets.yaml (and the per-user override)."""
    from harness import targets

    raise typer.Exit(targets.list_cmd(lab_root()))


def targets_check(name: str = typer.Argument(...)) -> None:
    """Connect to a target; report Python, torch, CuTeDSL, GPUs and the work folder."""
    from harness.target_check import check_cmd

    raise typer.Exit(check_cmd(lab_root(), name))


COMMANDS = [Command("list", targets_list, group=TARGETS, errors=(TargetError,)),
            Command("check", targets_check, group=TARGETS, errors=(TargetError,))]
