"""`dsv4-lab new stage ID …`: scaffold a new piece of the lab."""

from __future__ import annotations

from typing import Optional

import typer

from harness.commands.base import Command, Group, option
from harness.core.paths import lab_root

NEW = Group("new", "Scaffold a new piece of the lab (a stage).")


def new_stage(
    stage_id: str = typer.Argument(..., help="the new stage's id, e.g. E2"),
    axes: list[str] = option("axes", ..., help="a matrix axis: NAME=V1,V2 (repeat per axis)"),
    inputs: list[str] = option("in", ..., help="an input: NAME:DIMS[:DTYPE], e.g. Q:m,hd:bfloat16 (repeat)"),
    outputs: list[str] = option("out", ..., help="an output: NAME:DIMS[:DTYPE], e.g. S:m,n:float32 (repeat)"),
    title: Optional[str] = option("title", None, help="one line: what the stage computes"),
    slug: Optional[str] = option("slug", None, help="folder suffix: stages/<ID>_<slug> (default from the title)"),
) -> None:
    """Scaffold a stage: kernels for sm90 and sm100, an oracle module, its stages.yaml block."""
    from harness.spec import scaffold

    raise typer.Exit(scaffold.main(lab_root(), stage_id, axes, inputs, outputs, title, slug))


COMMANDS = [Command("stage", new_stage, group=NEW)]
