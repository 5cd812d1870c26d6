"""`dsv4-lab check [STAGE]`: the stage contract on the CPU, without compiling."""

from __future__ import annotations

from typing import Optional

import typer

from harness.commands.base import Command, spec_here


def check_cmd(stage: Optional[str] = typer.Argument(None, help="stage name; every stage when left out")) -> None:
    """The stage contract on the CPU, without compiling: axes vs Kernel.__init__, tensors vs
    __call__, inputs and oracle shapes, tolerance keys. One line per problem, exit 2."""
    from harness.spec import check

    spec = spec_here()
    stages = [spec.stage(stage)] if stage else list(spec.stages.values())
    raise typer.Exit(check.main(spec, stages))


COMMANDS = [Command("check", check_cmd)]
