"""`dsv4-lab suite NAME`: a peer's own test suite (oracles/suites/, docs/SUITES.md) run against the
stages — its suite stages (stages.yaml `suite:` blocks) run and recorded like any run; `--list`
(CPU) counts its cases: total, supported, and per reason the ones the stages do not take."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from harness.commands.base import Command, UsageError, archs_of, cases_of, option, precheck, spec_here
from harness.execution.runner import RunSetupError
from harness.spec.suitecases import UnknownSuite


def suite_stages(spec, modules: list) -> list:
    """The stages whose `suite.cases` is one of `modules`' `cases`."""
    names = {m.__name__ for m in modules}
    return [st for st in spec.stages.values() if st.suite is not None and st.suite.cases.module in names]


def suite(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="the suite: flashmla or deepgemm"),
    list_: bool = option("list", False, help="count the cases (total, supported, per reason) and run nothing"),
    arch: str = option("arch", "sm_90a", help="sm_90a, sm_100a or all"),
    where: Optional[str] = option("where", None, help="filters, e.g. b=4,group=performance"),
    gpus: Optional[str] = option("gpus", None, help="GPU indices to use, e.g. 0,1"),
    timeout: Optional[float] = option("timeout", None, help="per-case timeout in seconds (default: the stage's)"),
    shard: Optional[str] = option("shard", None, help="run only every n-th case from the i-th: i/n"),
) -> None:
    """Run a peer's own test suite against the stages (recorded like `run`); --list counts it."""
    from harness.spec.suitecases import suite_modules, summary

    spec = spec_here()
    modules = suite_modules(spec.root, name)
    stages = suite_stages(spec, modules)
    if list_:
        if ctx.args or where:
            raise UsageError("--list counts the whole suite: give no filters")
        params = {st.suite.cases.module: st.kernel_params for st in stages}
        counts = [summary(m, params.get(m.__name__, ())) for m in modules]
        if len(modules) > 1:
            print(f"suite {name}: {sum(c['total'] for c in counts)} cases, {sum(c['supported'] for c in counts)} "
                  "supported")
        for m in modules:
            s = summary(m, params.get(m.__name__, ()))
            stage = next((st.name for st in stages if st.suite.cases.module == m.__name__), "no suite stage")
            print(f"{m.__name__}  ({'; '.join(s['upstream'][:2])})")
            print(f"  {stage} (on stage-{s['stage']}): {s['total']} cases, {s['supported']} supported over "
                  f"{s['shapes']} compiled kernels, {s['total'] - s['supported']} unsupported")
            for why, n in s["reasons"].items():
                print(f"    {n:5d}  unsupported: {why}")
        raise typer.Exit(0)
    if not stages:
        raise UsageError(f"suite {name}: no stage of stages.yaml runs it — add its suite stage (docs/SUITES.md)")
    from harness.commands.run import gpu_list, refuse_empty_run, shard_of
    from harness.execution.report import run_local_and_report

    archs = archs_of(arch)
    cases = {}
    for st in stages:
        try:
            cases[st.id] = cases_of(st, ctx.args, where)
        except Exception as exc:  # a filter on an axis one suite stage has and another has not
            if len(stages) == 1 or "no axis" not in str(exc):
                raise
            cases[st.id] = []
    if sum(len(c) for c in cases.values()) == 0:
        raise UsageError("no case matches these filters")
    stages = [st for st in stages if cases[st.id]]
    shard_t = shard_of(shard)
    refuse_empty_run(stages, archs, cases, shard_t, shard)
    precheck(spec, stages)
    code = run_local_and_report(spec, stages, archs, cases, bench=False, gpus=gpu_list(gpus), workers_per_gpu=1,
                                timeout=timeout, seed=0, argv=["suite"] + sys.argv[2:], shard=shard_t)
    raise typer.Exit(code)


COMMANDS = [Command("suite", suite, axes="matrix", errors=(RunSetupError, UnknownSuite))]
