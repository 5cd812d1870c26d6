"""`dsv4-lab baseline accept|show|drop`: the metric values a case must keep (results/baselines.yaml.xz)."""

from __future__ import annotations

from typing import Optional

import typer

from harness.execution.bench import BenchError
from harness.notebook.baselines import BaselineError
from harness.commands.base import Command, Group, UsageError, archs_of, cases_of, filter_pairs, option, spec_here
from harness.core.paths import lab_root

BASELINE = Group("baseline", "Baselines: the metric values a case must keep.")


def accept(
    ctx: typer.Context,
    stage: str = typer.Argument(...),
    arch: str = option("arch", "all"),
    where: Optional[str] = option("where", None),
    compile_only: bool = option("compile_only", False,
                                help="baseline what compiling proves (status, registers, spills, smem, instruction "
                                     "inventory) even where a passing result exists"),
    speed: bool = option("speed", False,
                         help="keep the kernel's speed at the bench shapes instead (median µs, spread, peers' "
                              "ratios, GPU) from the newest fresh bench records: results/speed_baselines.yaml.xz; "
                              "axis filters then filter the bench shapes"),
) -> None:
    """Make the newest passing, fresh result of each selected case its baseline; for an arch no
    device here runs (sm_100a), what compiling proves. With --speed: each bench shape's speed."""
    from harness.notebook import baselines

    spec = spec_here()
    st = spec.stage(stage)
    if speed:
        from harness.execution.bench import plan_cases
        from harness.notebook import speedbaselines

        if compile_only:
            raise UsageError("--speed and --compile-only: give one (a speed baseline comes from a bench record)")
        shapes = plan_cases(st, filter_pairs(ctx.args, where))
        raise typer.Exit(speedbaselines.accept(spec.root, st, archs_of(arch), shapes))
    raise typer.Exit(baselines.accept(spec, st, archs_of(arch), cases_of(st, ctx.args, where),
                                      compile_only=compile_only))


def show(ctx: typer.Context, stage: Optional[str] = typer.Argument(None), arch: str = option("arch", "all"),
         where: Optional[str] = option("where", None),
         speed: bool = option("speed", False, help="the speed baselines (results/speed_baselines.yaml.xz)")) -> None:
    """The baselines, per stage, arch and case (filters: --arch, axis flags like --hd 64, --where)."""
    from harness.notebook import baselines

    if speed:
        from harness.notebook import speedbaselines

        if ctx.args or where:
            raise UsageError("baseline show --speed takes a stage and --arch, no axis filters")
        raise typer.Exit(speedbaselines.show(lab_root() if stage is None else spec_here().root,
                                             None if stage is None else spec_here().stage(stage), archs_of(arch)))

    if stage is None:
        if ctx.args or where:
            raise UsageError("axis filters need a stage, e.g. dsv4-lab baseline show stage-D1 --hd 64")
        raise typer.Exit(baselines.show(lab_root(), None, archs_of(arch)))
    spec = spec_here()
    st = spec.stage(stage)
    cases = cases_of(st, ctx.args, where) if (ctx.args or where) else None
    raise typer.Exit(baselines.show(spec.root, st, archs_of(arch), cases))


def drop(
    ctx: typer.Context,
    stage: str = typer.Argument(...),
    arch: str = option("arch", "all"),
    where: Optional[str] = option("where", None),
    every: bool = option("all", False, help="every baseline of the stage, those of cases its matrix no longer "
                                            "has included (an axis renamed, a case list changed)"),
    gone: bool = option("gone", False, help="only the baselines whose case the stage's matrix no longer has "
                                            "(orphans after its axes changed), and the speed baselines of "
                                            "shapes its bench block no longer has; the rest kept"),
) -> None:
    """Remove the baselines of the selected cases (--all: every baseline of the stage; --gone:
    those of cases its matrix no longer has)."""
    from harness.notebook import baselines

    spec = spec_here()
    st = spec.stage(stage)
    if gone:
        if every:
            raise UsageError("--gone drops the baselines of cases the matrix no longer has, --all every one: give one")
        if ctx.args or where:
            raise UsageError("--gone drops the baselines of cases the matrix no longer has: axis filters cannot "
                             "name those — give none with it")
        code = baselines.drop(spec, st, archs_of(arch), [], gone=True)
        raise typer.Exit(code or _drop_gone_speed(spec, st, archs_of(arch)))
    if every:
        if ctx.args or where:
            raise UsageError("--all drops every baseline of the stage: give no axis filters with it")
        raise typer.Exit(baselines.drop(spec, st, archs_of(arch), [], every=True))
    raise typer.Exit(baselines.drop(spec, st, archs_of(arch), cases_of(st, ctx.args, where)))


def _drop_gone_speed(spec, stage, archs: list[str] | None) -> int:
    """--gone for the speed baselines too: those of shapes the stage's bench block no longer has."""
    from rich.console import Console

    from harness.execution.bench import plan_cases
    from harness.notebook import speedbaselines

    shapes = [] if stage.bench_plan is None else plan_cases(stage, [])  # no bench block: every one is gone
    gone = speedbaselines.drop_gone(spec.root, stage, archs, shapes)
    if gone:
        shown = ", ".join(f"{b.arch} {b.case}" for b in gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        Console(highlight=False, markup=False, soft_wrap=True).print(
            f"dropped {len(gone)} speed baseline(s) of {stage.name} whose bench shape its bench block no longer has: {shown}")
    return 0


COMMANDS = [Command(name, fn, group=BASELINE, axes="matrix", errors=(BaselineError, BenchError))
            for name, fn in (("accept", accept), ("show", show), ("drop", drop))]
