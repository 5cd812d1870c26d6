"""`dsv4-lab inspect STAGE --arch A [filters]`: trace-time layouts of a kernel and their
agreement checks (harness/execution/kernelinspect.py). Not named inspect.py: that is the standard
library's."""

from __future__ import annotations

from typing import Optional

import typer

from harness.commands.base import Command, UsageError, archs_of, cases_of, option, spec_here


def inspect_cmd(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="stage name, e.g. stage-B or B"),
    arch: str = option("arch", ..., help="sm_90a or sm_100a"),
    where: Optional[str] = option("where", None, help="filters, e.g. hd=512"),
) -> None:
    """Trace-time layouts of the first matching case (no GPU): each MMA's atom, tiler, TV
    layouts and fragments, shared-memory swizzles, TMEM columns, and the agreement checks
    (e.g. the Q·Kᵀ accumulator vs the P·V A operand). Exit 1 names a check that fails."""
    from harness.execution import kernelinspect

    spec = spec_here()
    st = spec.stage(stage)
    archs = archs_of(arch) or []
    if len(archs) != 1:
        raise UsageError(f"--arch {arch}: name one arch, sm_90a or sm_100a")
    if archs[0] not in st.kernels:
        raise UsageError(f"{st.name} has no {archs[0]} kernel (it has {', '.join(st.kernels)})")
    cases = cases_of(st, ctx.args, where)
    if not cases:
        raise UsageError("no case matches these filters")
    raise typer.Exit(kernelinspect.main(spec.root, st, archs[0], cases))


COMMANDS = [Command("inspect", inspect_cmd, axes="matrix")]
