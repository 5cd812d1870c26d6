"""`dsv4-lab run`: run a stage's matrix (here, on the GPUs of a target, or as the remote side
of `run --target`) and record every case."""

from __future__ import annotations

import math
import sys
from typing import Optional

import typer

from harness.commands.base import (Command, UsageError, archs_of, cases_of, check_run_size_of, option, precheck,
                                   spec_here, stages_of)
from harness.execution.runner import RunSetupError
from harness.remote.targets import TargetError


def gpu_list(gpus: str | None) -> list[int] | None:
    """`--gpus 0,1`: the GPU indices (None: every GPU)."""
    if gpus is None:
        return None
    try:
        out = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise UsageError(f"--gpus {gpus}: expected GPU indices like 0,1") from None
    if not out or any(g < 0 for g in out) or len(set(out)) != len(out):
        raise UsageError(f"--gpus {gpus}: expected distinct GPU indices like 0,1")
    return out


def check_local_gpus(gpus: list[int]) -> None:
    """`--gpus` naming a GPU this machine does not have is bad usage, also on a machine with none
    (a silent run on the rest, or on nothing, would not be what was asked)."""
    from harness.core.environment import gpu_capabilities

    caps = gpu_capabilities()
    absent = [g for g in gpus if g not in caps]
    if absent:
        has = f"it has {', '.join(map(str, sorted(caps)))}" if caps else "it has no GPU: leave --gpus out"
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: no GPU {', '.join(map(str, absent))} on this machine "
                         f"({has})")


def run(
    ctx: typer.Context,
    stage: Optional[str] = typer.Argument(None, help="stage name, e.g. stage-D1 or D1"),
    all_: bool = option("all", False, help="every stage"),
    arch: str = option("arch", "all", help="sm_90a, sm_100a or all"),
    bench: bool = option("bench", False, help="also time the stage's bench case"),
    where: Optional[str] = option("where", None, help="filters, e.g. hd=512,n=256"),
    target: str = option("target", "local", help="where to run: local, or a target from targets.yaml (a,b splits)"),
    gpus: Optional[str] = option("gpus", None, help="GPU indices to use, e.g. 0,1"),
    workers_per_gpu: int = option("workers_per_gpu", 1, help="worker processes per GPU"),
    timeout: Optional[float] = option("timeout", None, help="per-case timeout in seconds (default: the stage's)"),
    seed: int = option("seed", 0, help="base seed of the input generators"),
    emit_jsonl: bool = option("emit_jsonl", False, help="remote mode: send records on the record channel (used by --target)"),
    shard: Optional[str] = option("shard", None, help="run only every n-th case from the i-th: i/n (used to split runs)"),
    record: bool = option("record", False, help="also record a case compiled, not run, where it says what "
                                                "its newest record for this source already says"),
    debug_hangs: bool = option("debug_hangs", False, help="build with every mbarrier wait bounded (4 s): a hang is "
                                                          "recorded as `hang` naming role, pipeline, slot, phase and CTA"),
    prepare: bool = option("prepare", False, help="a case of an arch no GPU here runs (sm_100a on an H100): run its "
                                                  "host path up to, not including, the launch on the GPU that is here "
                                                  "— status `prepared`, never a pass (docs/BLACKWELL.md)"),
    first_light: bool = option("first_light", False, help="the first Blackwell session's plan: its cases in order, "
                                                          "stopping at the first failure (docs/BLACKWELL.md); with "
                                                          "--target NAME"),
    print_job: bool = option("print_job", False, help="slurm targets: print the sbatch script the run would submit, "
                                                      "and submit nothing"),
) -> None:
    """Run a stage's matrix (filtered by axis flags like --hd 512); live progress, a table, records."""
    from harness.execution.report import run_local_and_report

    spec = spec_here()
    if first_light:
        run_first_light(spec, ctx, stage, all_, where, arch, target)
    if all_ and stage is not None and stage.startswith("--"):  # `run --all --hd 64`: the filter was read as the stage
        ctx.args[:0] = [stage]
        stage = None
    stages = stages_of(spec, stage, all_)
    archs = archs_of(arch)
    gpus_given = gpu_list(gpus)
    if gpus_given is not None and target == "local" and not emit_jsonl:
        check_local_gpus(gpus_given)
    if workers_per_gpu < 1:
        raise UsageError(f"--workers-per-gpu {workers_per_gpu}: must be at least 1")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout {timeout:g}: must be a finite number of seconds > 0 (or leave it out for the "
                         "stage's own)")
    check_run_size_of(stages, archs, ctx.args, where)
    cases = {st.id: cases_of(st, ctx.args, where) for st in stages}
    if sum(len(c) for c in cases.values()) == 0:
        raise UsageError("no case matches these filters")
    if not emit_jsonl:  # the sending side already checked a remote run's stages
        precheck(spec, stages)
    argv = ["run"] + sys.argv[2:]
    shard_t = shard_of(shard)
    if not emit_jsonl:  # a run that selects no case proves nothing: never exit 0 (one line, exit 1)
        refuse_empty_run(stages, archs, cases, shard_t, shard)
    slurm = slurm_target_of(spec.root, target, emit_jsonl, print_job)
    if slurm is not None:  # through the cluster's scheduler (harness/remote/slurm_run.py)
        from harness.remote.slurm_run import run_slurm

        raise typer.Exit(run_slurm(spec, slurm, argv, stages, archs, cases, gpus=gpus, shard=shard_t,
                                   print_job=print_job))
    if target != "local":
        from harness.remote.remote_run import run_remote

        code = run_remote(spec, target, argv, stages, archs, cases, shard=shard_t)
    elif emit_jsonl:  # the remote side of `run --target` (harness/remote/remote_side.py)
        from harness.remote.remote_side import run_emitting

        code = run_emitting(spec, stages, archs, cases, bench=bench, gpus=gpus_given, workers_per_gpu=workers_per_gpu,
                            timeout=timeout, seed=seed, argv=argv, shard=shard_t, debug_hangs=debug_hangs,
                            prepare=prepare)
    else:
        code = run_local_and_report(
            spec, stages, archs, cases, bench=bench, gpus=gpus_given, workers_per_gpu=workers_per_gpu,
            timeout=timeout, seed=seed, argv=argv, shard=shard_t, record=record, debug_hangs=debug_hangs,
            prepare=prepare,
        )
    raise typer.Exit(code)


def run_first_light(spec, ctx: typer.Context, stage: Optional[str], all_: bool, where: Optional[str], arch: str,
                    target: str) -> None:
    """`run --first-light [--target NAME]`: the plan of harness/workflows/first_light.py; exits with its code."""
    from harness.workflows.first_light import first_light

    if stage is not None or all_ or where or ctx.args or arch != "all":
        raise UsageError("--first-light runs its own plan of cases (docs/BLACKWELL.md): give no stage, filters or "
                         "--arch, only --target NAME")
    try:
        code = first_light(spec, None if target == "local" else target)
    except ValueError as exc:
        print(f"dsv4-lab: {exc}", file=sys.stderr)
        code = 2
    raise typer.Exit(code)


def slurm_target_of(root, target: str, emit_jsonl: bool, print_job: bool):
    """The slurm target `--target` names (None for local and SSH targets); --print-job needs one."""
    from harness.remote.targets import slurm_target

    found = None if emit_jsonl or target == "local" else slurm_target(root, target)
    if print_job and found is None:
        from harness.remote.targets import load_targets

        known = load_targets(root)
        what = (f"no target {target} is declared (declared: {', '.join(sorted(known)) or 'none yet'})"
                if target != "local" and "," not in target and target.strip() not in known
                else f"--target {target} is not a slurm target")
        raise UsageError(f"--print-job: {what} — it prints the sbatch script of a run on a `kind: slurm` target")
    return found


def shard_of(shard: str | None) -> tuple[int, int] | None:
    """`--shard i/n` as (i, n); None without one; UsageError (one line) for anything else."""
    if not shard:
        return None
    try:
        i, n = (int(x) for x in shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise UsageError(f"--shard {shard}: expected i/n with 0 <= i < n, e.g. 0/2")
    return i, n


def refuse_empty_run(stages: list, archs: list[str] | None, cases: dict, shard_t: tuple[int, int] | None,
                     shard: str | None) -> None:
    """Exit 1 with one line when the run would select no case (a shard past the end, an arch no
    chosen stage has): nothing would be proved, so it is never a green exit."""
    from harness.execution.runner import tasks_for

    tasks = tasks_for(stages, archs, lambda st: cases[st.id])
    selected = tasks[shard_t[0]::shard_t[1]] if shard_t is not None else tasks
    if selected:
        return
    if tasks:
        print(f"dsv4-lab: --shard {shard} selects none of the {len(tasks)} case(s): nothing would be proved — "
              f"give i/n with i < {len(tasks)}", file=sys.stderr)
    else:
        print(f"dsv4-lab: no case to run: {', '.join(st.name for st in stages)} has no kernel for "
              f"{', '.join(archs or [])} — nothing would be proved", file=sys.stderr)
    raise typer.Exit(1)


COMMANDS = [Command("run", run, axes="matrix", errors=(RunSetupError, TargetError))]
