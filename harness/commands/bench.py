"""`dsv4-lab bench STAGE [filters] [--peers]`: time the kernel at the stage's bench shapes."""

from __future__ import annotations

import math
import sys
from typing import Optional

import typer

from harness.execution.bench import BenchError
from harness.commands.base import Command, UsageError, filter_pairs, option, precheck, spec_here


def bench_cmd(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="stage name, e.g. stage-D1 or D1"),
    peers: bool = option("peers", False, help="also time the bench block's peers on the same inputs"),
    peer: Optional[list[str]] = option("peer", None, help="NAME: time only this peer of the bench block's "
                                                            "(repeatable; implies --peers)"),
    where: Optional[str] = option("where", None, help="filters on the bench shapes, e.g. hd=128,n=4096"),
    reps: int = option("reps", 30, help="timed repetitions (each a CUDA graph of many launches)"),
    timeout: float = option("timeout", 600.0, help="seconds per bench shape (compile excluded)"),
    seed: int = option("seed", 0, help="base seed of the input generators"),
    gpu: int = option("gpu", 0, help="the GPU index to time on"),
    compare: Optional[str] = option("compare", None,
                                    help="REV: time the kernel at this commit against the working tree's, interleaved "
                                         "in one process on the same inputs; per shape both medians, the ratio with "
                                         "its 95 % interval and the verdict (docs/BENCH.md)"),
    rounds: int = option("rounds", 40, help="--compare: interleaved rounds per kernel (each --reps repetitions; "
                                            "--reps defaults to 5 there)"),
) -> None:
    """Time the kernel at the stage's bench shapes (stages.yaml bench:), beside its peers
    (--peers), as a fraction of the GPU's roofline (dsv4-lab calibrate). Exit 0 only when every
    shape passed its check and was timed."""
    from harness.execution import bench

    spec = spec_here()
    st = spec.stage(stage)
    if not (1 <= reps <= 10000):
        raise UsageError(f"--reps {reps}: give 1 to 10000")
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout {timeout:g}: must be a finite number of seconds > 0")
    pairs = filter_pairs(ctx.args, where)
    chosen: bool | tuple[str, ...] = peers
    if peer:
        listed = st.bench_plan.peers if st.bench_plan is not None else ()
        unknown = [p for p in peer if p not in listed]
        if unknown:
            raise UsageError(f"--peer {unknown[0]}: not a peer of {st.name}'s bench block (stages.yaml bench.peers: "
                             f"{', '.join(listed) or 'none'})")
        chosen = tuple(dict.fromkeys(peer))
    if compare is not None:
        from harness.execution import abbench

        if chosen:
            raise UsageError("--compare times the kernel at two commits; --peers/--peer time peers — give one")
        if not (5 <= rounds <= 1000):
            raise UsageError(f"--rounds {rounds}: give 5 to 1000")
        given = getattr(ctx.get_parameter_source("reps"), "name", "DEFAULT") != "DEFAULT"
        raise typer.Exit(abbench.main(spec.root, st, pairs, compare, rounds=rounds,
                                      reps=reps if given else 5, timeout_s=timeout, seed=seed,
                                      gpu=gpu, argv=["bench"] + sys.argv[2:]))
    bench.plan_cases(st, pairs)  # bad filters or no bench block: one line before anything is imported
    from harness.core.environment import gpu_capabilities

    if gpu_capabilities():  # the stage contract, before compiling and timing (no GPU: nothing will run)
        precheck(spec, [st])
    raise typer.Exit(bench.main(spec.root, st, pairs, peers=chosen, reps=reps, timeout_s=timeout, seed=seed, gpu=gpu,
                                argv=["bench"] + sys.argv[2:]))


COMMANDS = [Command("bench", bench_cmd, axes="bench", errors=(BenchError,))]
