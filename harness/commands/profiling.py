"""`dsv4-lab profile STAGE [filters]`: Nsight Compute's metrics of one bench shape, recorded."""

from __future__ import annotations

import math
import sys
from typing import Optional

import typer

from harness.commands.base import Command, UsageError, filter_pairs, option, spec_here
from harness.execution.bench import BenchError


def profile_cmd(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="stage name, e.g. stage-E or E"),
    where: Optional[str] = option("where", None, help="filters on the bench shapes (the first shape left is profiled)"),
    timeout: float = option("timeout", 600.0, help="seconds for ncu (compile excluded)"),
    seed: int = option("seed", 0, help="base seed of the input generators"),
    gpu: int = option("gpu", 0, help="the GPU index to profile on"),
    compare: Optional[str] = option("compare", None, help="REV: profile the kernel at this commit too, side by side"),
) -> None:
    """Profile one bench shape with Nsight Compute (ncu): duration, SM and memory throughput, achieved
    occupancy, registers, L2 hit rate, DRAM bytes and the top warp-stall reasons, kept with the
    record (`dsv4-lab show ID` prints them). Without ncu, a GPU or counter permission: one line, exit 1."""
    from harness.execution import ncuprofile as profile

    spec = spec_here()
    st = spec.stage(stage)
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout {timeout:g}: must be a finite number of seconds > 0")
    raise typer.Exit(profile.main(spec.root, st, filter_pairs(ctx.args, where), timeout_s=timeout, seed=seed, gpu=gpu,
                                  argv=["profile"] + sys.argv[2:], compare=compare))


COMMANDS = [Command("profile", profile_cmd, axes="bench", errors=(BenchError,))]
