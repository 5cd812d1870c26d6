"""`dsv4-lab targets list|check NAME`: the remote targets (SSH hosts and Slurm clusters) of targets.yaml."""

from __future__ import annotations

import typer

from harness.commands.base import Command, Group
from harness.core.paths import lab_root
from harness.remote.targets import TargetError

TARGETS = Group("targets", "Remote targets (SSH, Slurm).")


def targets_list() -> None:
    """The targets declared in targets.yaml (and the per-user override)."""
    from harness.remote import targets

    raise typer.Exit(targets.list_cmd(lab_root()))


def targets_check(name: str = typer.Argument(...)) -> None:
    """Connect to a target; report Python, torch, CuTeDSL, GPUs and the work folder."""
    from harness.remote.target_check import check_cmd
    from harness.remote.targets import slurm_target

    if slurm_target(lab_root(), name) is not None:  # the partition, its GPUs and limits (sinfo), the shared folder
        from harness.remote.slurm_check import check_slurm

        raise typer.Exit(check_slurm(lab_root(), name))
    raise typer.Exit(check_cmd(lab_root(), name))


COMMANDS = [Command("list", targets_list, group=TARGETS, errors=(TargetError,)),
            Command("check", targets_check, group=TARGETS, errors=(TargetError,))]
