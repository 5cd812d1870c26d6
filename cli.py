"""dsv4-lab: the command line of the lab (typer + rich).

Every command loads stages.yaml first; a bad spec, a bad filter or a bad targets file is
one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Optional

from harness.interrupts import exit_on_stop_signals

if Path(sys.argv[0]).name in ("dsv4-lab", "cli.py"):  # the command itself, not an import by a test
    exit_on_stop_signals()  # a Ctrl-C while the command line loads: one line, exit 130

import typer  # noqa: E402

from harness.matrix import (FilterError, check_run_size, count, expand, parse_axis_flags, parse_filters,  # noqa: E402
                            parse_where)
from harness.paths import lab_root  # noqa: E402
from harness.spec import ARCHS, ARCH_KEYS, Spec, SpecError, Stage, load_spec  # noqa: E402


class UsageError(Exception):
    """Bad command-line usage, phrased as one line."""


HELP_CTX = {"help_option_names": ["-h", "--help"]}  # `-h`, what people type first, is --help too
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, context_settings=HELP_CTX,
                  help="Staged kernel lab for DeepSeek-V4 attention: run, gate, dashboard.")
baseline_app = typer.Typer(no_args_is_help=True, help="Baselines: the metric values a case must keep.")
targets_app = typer.Typer(no_args_is_help=True, help="Remote targets (SSH).")
app.add_typer(baseline_app, name="baseline")
app.add_typer(targets_app, name="targets")


def version_text() -> str:
    """`dsv4-lab --version`: the lab's version and the versions that change a verdict (package
    metadata only: nothing is imported)."""
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "missing"

    lab = version("dsv4-lab")
    if lab == "missing":  # a checkout run as `python3 -m cli` without installing it
        import re

        m = re.search(r'^version\s*=\s*"([^"]+)"', (Path(__file__).with_name("pyproject.toml")).read_text()
                      if Path(__file__).with_name("pyproject.toml").is_file() else "", re.M)
        lab = m.group(1) if m else "unknown"
    return (f"dsv4-lab {lab} (nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}, torch {version('torch')}, "
            f"python {sys.version.split()[0]})")


def _version_callback(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit(0)


@app.callback()
def _main_options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version_callback,
                                               help="print the lab's version (and CuTeDSL's, torch's) and exit")) -> None:
    """Staged kernel lab for DeepSeek-V4 attention: run, gate, dashboard."""

FILTER_CTX = {"allow_extra_args": True, "ignore_unknown_options": True, **HELP_CTX}


_loaded_specs: list[Spec] = []  # the spec this command loaded (for the names of every stage's axes)


def _spec() -> Spec:
    root = lab_root()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = load_spec(root=root)
    _loaded_specs[:] = [spec]
    return spec


def _archs(arch: str) -> list[str] | None:
    if arch in ("all", ""):
        return None
    out = []
    for a in arch.split(","):
        a = a.strip()
        if a in ARCHS:
            out.append(ARCHS[a])
        elif a in ARCH_KEYS:
            out.append(a)
        else:
            raise UsageError(f"--arch {a}: unknown — use {', '.join(v for v in ARCHS.values() if v != 'cpu')} or all")
    return out


def _cases_of(stage: Stage, extra: list[str], where: str | None):
    _check_option_names(extra, [stage])
    filters = parse_filters(stage, _filter_pairs(extra, where))
    return expand(stage, filters)


def _filter_pairs(extra: list[str], where: str | None) -> list[tuple[str, str]]:
    """The axis flags and --where as (axis, values) pairs. An axis given both ways (`--hd 64
    --where hd=128`) is refused: neither the union nor either one is what both words say."""
    flags = parse_axis_flags(extra)
    wheres = parse_where(where) if where else []
    empty = next((a for a, v in wheres if not v.strip(", ")), None)
    if empty is not None:  # `--where hd=`: a filter with no value (not "no case matches")
        raise UsageError(f"--where {empty}=: no value — e.g. --where {empty or 'hd'}=512")
    both = sorted({a for a, _ in flags} & {a for a, _ in wheres})
    if both:
        a = both[0]
        flag = ",".join(v for x, v in flags if x == a)
        wh = ",".join(v for x, v in wheres if x == a)
        raise UsageError(f"--{a.replace('_', '-')} {flag} and --where {a}={wh.replace(',', '|')} both filter {a} — "
                         f"give {a} once (e.g. --{a.replace('_', '-')} {flag},{wh})")
    return flags + wheres


def _current_context():
    """The running command's click context (typer vendors click in recent releases: never
    import `click` itself when typer has its own)."""
    import importlib

    for name in ("typer._click.globals", "click.globals"):
        try:
            return importlib.import_module(name).get_current_context(silent=True)
        except ImportError:
            continue
    return None


def _check_option_names(extra: list[str], stages: list[Stage]) -> None:
    """Every `--word` the command itself does not take must be an axis of a selected stage:
    a misspelt option (`--arhc`) or one the lab does not have (`--dry-run`) is named as such,
    with the closest option or axis, before any value is read as a filter."""
    import difflib

    axes = {a for st in stages for a in st.matrix}
    any_axis = {a for spec in _loaded_specs for st in spec.stages.values() for a in st.matrix}
    for word in extra:
        if not word.startswith("--") or word == "--":
            continue
        name = word[2:].split("=", 1)[0]
        if name.replace("-", "_") in axes | any_axis:  # another stage's axis: the filter names the stage's own
            continue
        ctx = _current_context()
        options = sorted({o for p in (ctx.command.params if ctx else []) for o in getattr(p, "opts", [])
                          if o.startswith("--")} | {"--help"})
        axis_flags = sorted(f"--{a.replace('_', '-')}" for a in axes)
        close = difflib.get_close_matches(f"--{name}", options + axis_flags, n=1, cutoff=0.6)
        command = ctx.command_path if ctx else "dsv4-lab"
        hint = (f"did you mean {close[0]}?" if close else
                f"{command} takes {', '.join(o for o in options if o != '--help')}"
                + (f"; axis filters here: {', '.join(axis_flags)}" if axis_flags else ""))
        raise UsageError(f"no such option '--{name}' — {hint} (see {command} --help)")


def _run_size(stages: list[Stage], archs: list[str] | None, extra: list[str], where: str | None) -> None:
    """The whole command's case count, counted before anything is built: over MAX_RUN_CASES is
    one line and exit 2 (harness.matrix.check_run_size)."""
    _check_option_names(extra, stages)  # a misspelt option is named as such before any value is read
    pairs = _filter_pairs(extra, where)
    check_run_size([(st.name, count(st, parse_filters(st, pairs))
                     * sum(1 for a in st.kernels if not archs or a in archs)) for st in stages])


def _gpu_list(gpus: str | None) -> list[int] | None:
    if gpus is None:
        return None
    try:
        out = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise UsageError(f"--gpus {gpus}: expected GPU indices like 0,1") from None
    if not out or any(g < 0 for g in out) or len(set(out)) != len(out):
        raise UsageError(f"--gpus {gpus}: expected distinct GPU indices like 0,1")
    return out


def _check_local_gpus(gpus: list[int]) -> None:
    """`--gpus` naming a GPU this machine does not have is bad usage, also on a machine with none
    (a silent run on the rest, or on nothing, would not be what was asked)."""
    from harness.environment import gpu_capabilities

    caps = gpu_capabilities()
    absent = [g for g in gpus if g not in caps]
    if absent:
        has = f"it has {', '.join(map(str, sorted(caps)))}" if caps else "it has no GPU: leave --gpus out"
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: no GPU {', '.join(map(str, absent))} on this machine "
                         f"({has})")


def _precheck(spec: Spec, stages: list[Stage]) -> None:
    """The stage contract (`dsv4-lab check`) before anything compiles or runs: a broken stage
    is one line per problem and exit 2. A stage whose sources and check code are unchanged
    since it last passed is not checked again (the mark lives in the compile cache folder)."""
    import hashlib

    from harness import check
    from harness.identity import file_digest, source_hash
    from harness.paths import cache_dir

    marks = cache_dir(spec.root) / "check"
    todo, keys = [], {}
    for st in stages:
        h = hashlib.sha256(file_digest(Path(check.__file__)).encode())
        for arch in sorted(st.kernels):
            h.update(f"{arch}:{source_hash(spec.root, st, arch)}".encode())
        keys[st.id] = h.hexdigest()[:24]
        if not (marks / keys[st.id]).is_file():
            todo.append(st)
    problems = [p for st in todo for p in check.check_stage(spec, st)]
    for st in todo:  # code the staleness hash cannot follow: said once, while the stage is unchecked
        for w in check.dynamic_warnings(spec, st):
            print(f"dsv4-lab: {w}", file=sys.stderr)
    if problems:
        for p in problems:
            print(f"dsv4-lab: {p}", file=sys.stderr)
        raise typer.Exit(2)
    for st in todo:
        try:
            marks.mkdir(parents=True, exist_ok=True)
            (marks / keys[st.id]).write_text(st.name + "\n")
        except OSError:
            pass


def _stages(spec: Spec, name: str | None, all_: bool) -> list[Stage]:
    if name is not None and name.startswith("--"):  # `run --dry-run`: an option where the stage goes
        _check_option_names([name], list(spec.stages.values()) if all_ else [])
        raise UsageError(f"{name} is an axis filter — name a stage first (e.g. dsv4-lab run stage-A {name} …) "
                         "or pass --all")
    if all_ and name is not None:  # `run stage-A --all`: neither is what both words say
        raise UsageError(f"{name} and --all: give a stage or --all, not both")
    if all_ or name is None:
        if not all_ and name is None:
            raise UsageError("name a stage (e.g. dsv4-lab run stage-A) or pass --all")
        return list(spec.stages.values())
    return [spec.stage(name)]


# ---------------------------------------------------------------------------------------


@app.command("list")
def list_cmd() -> None:
    """Stages, their archs, matrix sizes, and whether each arch can run here."""
    from rich.markup import escape
    from rich.table import Table

    from harness.environment import gpu_capabilities
    from harness.report import make_console

    spec = _spec()
    caps = gpu_capabilities()
    runnable = {"cpu"} | {a for _, a in caps.values() if a}
    gpus = ", ".join(sorted({n for n, _ in caps.values()})) or "no GPU"
    table = Table(title=f"dsv4-lab stages — this machine: {gpus}")
    for col in ("stage", "title", "axes", "cases", "archs"):
        table.add_column(col)
    for st in spec.stages.values():
        n = count(st)
        axes = " × ".join(f"{k}{{{','.join(map(str, v))}}}" for k, v in st.matrix.items())
        archs = ", ".join(f"{a} ({'runs here' if a in runnable else 'compile only'})" for a in st.kernels)
        table.add_row(escape(st.name), escape(st.title), escape(axes), str(n), escape(archs))
    make_console().print(table)


@app.command("run", context_settings=FILTER_CTX)
def run_cmd(
    ctx: typer.Context,
    stage: Optional[str] = typer.Argument(None, help="stage name, e.g. stage-D1 or D1"),
    all_: bool = typer.Option(False, "--all", help="every stage"),
    arch: str = typer.Option("all", help="sm_90a, sm_100a or all"),
    bench: bool = typer.Option(False, "--bench", help="also time the stage's bench case"),
    where: Optional[str] = typer.Option(None, help="filters, e.g. hd=512,n=256"),
    target: str = typer.Option("local", help="where to run: local, or a target from targets.yaml (a,b splits)"),
    gpus: Optional[str] = typer.Option(None, help="GPU indices to use, e.g. 0,1"),
    workers_per_gpu: int = typer.Option(1, help="worker processes per GPU"),
    timeout: Optional[float] = typer.Option(None, help="per-case timeout in seconds (default: the stage's)"),
    seed: int = typer.Option(0, help="base seed of the input generators"),
    emit_jsonl: bool = typer.Option(False, "--emit-jsonl", help="remote mode: send records on the record channel (used by --target)"),
    shard: Optional[str] = typer.Option(None, help="run only every n-th case from the i-th: i/n (used to split runs)"),
    record: bool = typer.Option(False, "--record", help="also record a case compiled, not run, where it says what "
                                                        "its newest record for this source already says"),
) -> None:
    """Run a stage's matrix (filtered by axis flags like --hd 512); live progress, a table, records."""
    from harness.report import run_local_and_report

    spec = _spec()
    if all_ and stage is not None and stage.startswith("--"):  # `run --all --hd 64`: the filter was read as the stage
        ctx.args[:0] = [stage]
        stage = None
    stages = _stages(spec, stage, all_)
    archs = _archs(arch)
    gpu_list = _gpu_list(gpus)
    if gpu_list is not None and target == "local" and not emit_jsonl:
        _check_local_gpus(gpu_list)
    if workers_per_gpu < 1:
        raise UsageError(f"--workers-per-gpu {workers_per_gpu}: must be at least 1")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout {timeout:g}: must be a finite number of seconds > 0 (or leave it out for the "
                         "stage's own)")
    _run_size(stages, archs, ctx.args, where)
    cases = {st.id: _cases_of(st, ctx.args, where) for st in stages}
    if sum(len(c) for c in cases.values()) == 0:
        raise UsageError("no case matches these filters")
    if not emit_jsonl:  # the sending side already checked a remote run's stages
        _precheck(spec, stages)
    argv = ["run"] + sys.argv[2:]
    shard_t = None
    if shard:
        try:
            i, n = (int(x) for x in shard.split("/"))
            assert 0 <= i < n
        except (ValueError, AssertionError):
            raise UsageError(f"--shard {shard}: expected i/n with 0 <= i < n, e.g. 0/2")
        shard_t = (i, n)
    if not emit_jsonl:  # a run that selects no case proves nothing: never exit 0 (one line, exit 1)
        _refuse_empty_run(stages, archs, cases, shard_t, shard)
    if target != "local":
        from harness.remote_run import run_remote

        code = run_remote(spec, target, argv, stages, archs, cases, shard=shard_t)
    elif emit_jsonl:  # the remote side of `run --target` (harness/remote_side.py)
        from harness.remote_side import run_emitting

        code = run_emitting(spec, stages, archs, cases, bench=bench, gpus=gpu_list, workers_per_gpu=workers_per_gpu,
                            timeout=timeout, seed=seed, argv=argv, shard=shard_t)
    else:
        code = run_local_and_report(
            spec, stages, archs, cases, bench=bench, gpus=gpu_list, workers_per_gpu=workers_per_gpu,
            timeout=timeout, seed=seed, argv=argv, shard=shard_t, record=record,
        )
    raise typer.Exit(code)


def _refuse_empty_run(stages: list, archs: list[str] | None, cases: dict, shard_t: tuple[int, int] | None,
                      shard: str | None) -> None:
    """Exit 1 with one line when the run would select no case (a shard past the end, an arch no
    chosen stage has): nothing would be proved, so it is never a green exit."""
    from harness.runner import tasks_for

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


@app.command("compile", context_settings=FILTER_CTX)
def compile_cmd(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="stage name"),
    arch: str = typer.Option("all", help="sm_90a, sm_100a or all"),
    where: Optional[str] = typer.Option(None, help="filters, e.g. hd=512"),
    keep: Optional[Path] = typer.Option(None, help="copy PTX and cubin (and SASS when the CUDA binary tools are here) to this folder"),
    diff: Optional[str] = typer.Option(None, "--diff", help="show what changed in inventory and resources against a commit (e.g. HEAD~1)"),
    record: bool = typer.Option(False, "--record", help="write a record for every case, also where it says what the "
                                                        "case's newest record for this source already says"),
) -> None:
    """Compile only (no GPU needed): instruction inventory, registers / shared memory / spills; a record per case
    whose result is new (nothing is written for a case compiled to what its newest record says, unless --record)."""
    from harness.report import compile_and_report

    spec = _spec()
    st = spec.stage(stage)
    archs = _archs(arch) or list(st.kernels)
    for a in archs:
        if a not in st.kernels:
            raise UsageError(f"{st.name} has no {a} kernel (it has {', '.join(st.kernels)})")
    cases = _cases_of(st, ctx.args, where)
    if not cases:
        raise UsageError("no case matches these filters")
    _precheck(spec, [st])
    if diff is not None:
        from harness.compilediff import diff_main

        raise typer.Exit(diff_main(spec, st, archs, cases, diff))
    raise typer.Exit(compile_and_report(spec, st, archs, cases, keep, argv=["compile"] + sys.argv[2:], record=record))


@app.command("gate")
def gate_cmd(
    install_hook: bool = typer.Option(False, "--install-hook", help="install the git pre-commit hook"),
    force: bool = typer.Option(False, "--force", help="with --install-hook: replace a hook the lab did not write"),
    no_run: bool = typer.Option(False, "--no-run", help="never run stale cases; report them"),
    target: Optional[str] = typer.Option(None, help="prove stale run cases on this target (default: proof_target "
                                                    "in ~/.config/dsv4-lab/targets.yaml; local: here only)"),
    staged: bool = typer.Option(False, "--staged", help="judge what the git index holds, not the working tree "
                                                        "(what the pre-commit hook runs)"),
) -> None:
    """Regression gate: every baselined case must still hold on the current tree."""
    from harness import gate

    root = lab_root()
    if install_hook:
        raise typer.Exit(gate.install_hook(root, force=force))
    raise typer.Exit(gate.main(root, allow_run=not no_run, target=target, staged=staged))


@baseline_app.command("accept", context_settings=FILTER_CTX)
def baseline_accept(
    ctx: typer.Context,
    stage: str = typer.Argument(...),
    arch: str = typer.Option("all"),
    where: Optional[str] = typer.Option(None),
    compile_only: bool = typer.Option(False, "--compile-only",
                                      help="baseline what compiling proves (status, registers, spills, smem, instruction "
                                           "inventory) even where a passing result exists"),
) -> None:
    """Make the newest passing, fresh result of each selected case its baseline; for an arch no
    device here runs (sm_100a), what compiling proves."""
    from harness import baselines

    spec = _spec()
    st = spec.stage(stage)
    raise typer.Exit(baselines.accept(spec, st, _archs(arch), _cases_of(st, ctx.args, where),
                                      compile_only=compile_only))


@baseline_app.command("show", context_settings=FILTER_CTX)
def baseline_show(ctx: typer.Context, stage: Optional[str] = typer.Argument(None), arch: str = typer.Option("all"),
                  where: Optional[str] = typer.Option(None)) -> None:
    """The baselines, per stage, arch and case (filters: --arch, axis flags like --hd 64, --where)."""
    from harness import baselines

    if stage is None:
        if ctx.args or where:
            raise UsageError("axis filters need a stage, e.g. dsv4-lab baseline show stage-D1 --hd 64")
        raise typer.Exit(baselines.show(lab_root(), None, _archs(arch)))
    spec = _spec()
    st = spec.stage(stage)
    cases = _cases_of(st, ctx.args, where) if (ctx.args or where) else None
    raise typer.Exit(baselines.show(spec.root, st, _archs(arch), cases))


@baseline_app.command("drop", context_settings=FILTER_CTX)
def baseline_drop(
    ctx: typer.Context,
    stage: str = typer.Argument(...),
    arch: str = typer.Option("all"),
    where: Optional[str] = typer.Option(None),
) -> None:
    """Remove the baselines of the selected cases."""
    from harness import baselines

    spec = _spec()
    st = spec.stage(stage)
    raise typer.Exit(baselines.drop(spec, st, _archs(arch), _cases_of(st, ctx.args, where)))


@app.command("dashboard")
def dashboard_cmd(watch: bool = typer.Option(False, "--watch", help="refresh while records arrive"),
                  interval: float = typer.Option(2.0, help="seconds between refreshes with --watch")) -> None:
    """Where every stage stands: stages × arch."""
    from harness import dashboard

    if not (math.isfinite(interval) and interval > 0):
        raise UsageError(f"--interval {interval:g}: must be a finite number of seconds > 0 (e.g. --interval 2)")
    raise typer.Exit(dashboard.main(lab_root(), watch=watch, interval=interval))


@app.command("history", context_settings=FILTER_CTX)
def history_cmd(ctx: typer.Context, stage: str = typer.Argument(...), arch: str = typer.Option("all"),
                where: Optional[str] = typer.Option(None)) -> None:
    """One case's metrics across commits, oldest first, with a trend line."""
    from harness import history

    spec = _spec()
    st = spec.stage(stage)
    raise typer.Exit(history.main(spec, st, _archs(arch), _cases_of(st, ctx.args, where)))


@app.command("show")
def show_cmd(record_or_run: str = typer.Argument(..., help="a record id (RUN.N) or a run id")) -> None:
    """A record or a run in full, error text and notes included."""
    from harness import history

    raise typer.Exit(history.show(lab_root(), record_or_run))


@app.command("note")
def note_cmd(run: str = typer.Argument(...), text: str = typer.Argument(...)) -> None:
    """Annotate a run; shown by show and history."""
    from harness import history

    raise typer.Exit(history.note(lab_root(), run, text))


@targets_app.command("list")
def targets_list() -> None:
    """The targets declared in targets.yaml (and the per-user override)."""
    from harness import targets

    raise typer.Exit(targets.list_cmd(lab_root()))


@targets_app.command("check")
def targets_check(name: str = typer.Argument(...)) -> None:
    """Connect to a target; report Python, torch, CuTeDSL, GPUs and the work folder."""
    from harness.target_check import check_cmd

    raise typer.Exit(check_cmd(lab_root(), name))


# -- check, new stage ---------------------------------------------------------------------

new_app = typer.Typer(no_args_is_help=True, help="Scaffold a new piece of the lab (a stage).")
app.add_typer(new_app, name="new")


@app.command("check")
def check_cmd(stage: Optional[str] = typer.Argument(None, help="stage name; every stage when left out")) -> None:
    """The stage contract on the CPU, without compiling: axes vs Kernel.__init__, tensors vs
    __call__, inputs and oracle shapes, tolerance keys. One line per problem, exit 2."""
    from harness import check

    spec = _spec()
    stages = [spec.stage(stage)] if stage else list(spec.stages.values())
    raise typer.Exit(check.main(spec, stages))


@new_app.command("stage")
def new_stage_cmd(
    stage_id: str = typer.Argument(..., help="the new stage's id, e.g. E2"),
    axes: list[str] = typer.Option(..., "--axes", help="a matrix axis: NAME=V1,V2 (repeat per axis)"),
    inputs: list[str] = typer.Option(..., "--in", help="an input: NAME:DIMS[:DTYPE], e.g. Q:m,hd:bfloat16 (repeat)"),
    outputs: list[str] = typer.Option(..., "--out", help="an output: NAME:DIMS[:DTYPE], e.g. S:m,n:float32 (repeat)"),
    title: Optional[str] = typer.Option(None, help="one line: what the stage computes"),
    slug: Optional[str] = typer.Option(None, help="folder suffix: stages/<ID>_<slug> (default from the title)"),
) -> None:
    """Scaffold a stage: kernels for sm90 and sm100, an oracle module, its stages.yaml block."""
    from harness import scaffold

    raise typer.Exit(scaffold.main(lab_root(), stage_id, axes, inputs, outputs, title, slug))


@app.command("bench", context_settings=FILTER_CTX)
def bench_cmd(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="stage name, e.g. stage-D1 or D1"),
    peers: bool = typer.Option(False, "--peers", help="also time the bench block's peers on the same inputs"),
    where: Optional[str] = typer.Option(None, help="filters on the bench shapes, e.g. hd=128,n=4096"),
    reps: int = typer.Option(30, help="timed repetitions (each a CUDA graph of many launches)"),
    timeout: float = typer.Option(600.0, help="seconds per bench shape (compile excluded)"),
    seed: int = typer.Option(0, help="base seed of the input generators"),
    gpu: int = typer.Option(0, help="the GPU index to time on"),
) -> None:
    """Time the kernel at the stage's bench shapes (stages.yaml bench:), beside its peers
    (--peers), as a fraction of the GPU's roofline (dsv4-lab calibrate). Exit 0 only when every
    shape passed its check and was timed."""
    from harness import bench

    spec = _spec()
    st = spec.stage(stage)
    if not (1 <= reps <= 10000):
        raise UsageError(f"--reps {reps}: give 1 to 10000")
    if not (math.isfinite(timeout) and timeout > 0):
        raise UsageError(f"--timeout {timeout:g}: must be a finite number of seconds > 0")
    pairs = _filter_pairs(ctx.args, where)
    try:
        bench.plan_cases(st, pairs)  # bad filters or no bench block: one line before anything is imported
        from harness.environment import gpu_capabilities

        if gpu_capabilities():  # the stage contract, before compiling and timing (no GPU: nothing will run)
            _precheck(spec, [st])
        code = bench.main(spec.root, st, pairs, peers=peers, reps=reps, timeout_s=timeout, seed=seed, gpu=gpu,
                          argv=["bench"] + sys.argv[2:])
    except bench.BenchError as exc:
        raise UsageError(str(exc)) from None
    raise typer.Exit(code)


@app.command("calibrate")
def calibrate_cmd(fp8: bool = typer.Option(False, "--fp8", help="also measure FP8 tensor-core throughput")) -> None:
    """Measure this GPU's peaks once (bf16 matmul, FP8 with --fp8, device copy bandwidth) and
    record them in results/calibration.jsonl for the roofline of bench and dashboard."""
    from harness import calibrate

    raise typer.Exit(calibrate.main(lab_root(), fp8=fp8))


@app.command("inspect", context_settings=FILTER_CTX)
def inspect_cmd(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="stage name, e.g. stage-B or B"),
    arch: str = typer.Option(..., help="sm_90a or sm_100a"),
    where: Optional[str] = typer.Option(None, help="filters, e.g. hd=512"),
) -> None:
    """Trace-time layouts of the first matching case (no GPU): each MMA's atom, tiler, TV
    layouts and fragments, shared-memory swizzles, TMEM columns, and the agreement checks
    (e.g. the Q·Kᵀ accumulator vs the P·V A operand). Exit 1 names a check that fails."""
    from harness import kernelinspect as inspection

    spec = _spec()
    st = spec.stage(stage)
    archs = _archs(arch) or []
    if len(archs) != 1:
        raise UsageError(f"--arch {arch}: name one arch, sm_90a or sm_100a")
    if archs[0] not in st.kernels:
        raise UsageError(f"{st.name} has no {archs[0]} kernel (it has {', '.join(st.kernels)})")
    cases = _cases_of(st, ctx.args, where)
    if not cases:
        raise UsageError("no case matches these filters")
    raise typer.Exit(inspection.main(spec.root, st, archs[0], cases))


def _click_exception_class() -> type[BaseException]:
    """The ClickException class typer raises (typer vendors click in recent releases; never
    import `click` itself: a fresh install may not have it)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


AXIS_HELP_COMMANDS = ("run", "compile", "history", "baseline")


def _axis_help() -> str:
    """The axis flags each stage takes, for the --help of the commands that filter cases."""
    try:
        spec = _spec()
    except Exception:  # a broken spec shows its own one-line error when a command runs
        return ""
    lines = ["Axis filters (each takes one value or a comma list):"]
    for st in spec.stages.values():
        flags = "  ".join(f"--{a.replace('_', '-')} {{{','.join(str(v).lower() if isinstance(v, bool) else str(v) for v in vals)}}}"
                          for a, vals in st.matrix.items())
        lines.append(f"  {st.name}: {flags}")
    return "\n\n".join(lines) if len(lines) > 1 else ""


def _add_axis_help() -> None:
    if "--help" not in sys.argv[1:] and "-h" not in sys.argv[1:]:
        return
    text = _axis_help()
    if not text:
        return
    for info in app.registered_commands + baseline_app.registered_commands:
        name = info.name or (info.callback.__name__ if info.callback else "")
        if name in ("run", "compile", "history", "inspect", "accept", "show", "drop"):
            info.epilog = text


def _check_where_once(argv: list[str]) -> None:
    """`--where hd=64 --where n=128`: click keeps the last one and silently drops the first, so
    the command would run cases nobody asked for; refused in one line with the combined form."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    values = [w.split("=", 1)[1] if w.startswith("--where=") else (words[i + 1] if i + 1 < len(words) else "")
              for i, w in enumerate(words) if w == "--where" or w.startswith("--where=")]
    if len(values) > 1:
        raise UsageError(f"--where given {len(values)} times — give it once, the filters joined by commas "
                         f"(e.g. --where {','.join(v for v in values if v) or 'hd=512,n=256'})")


def main() -> None:
    """Console entry point. Usage and config problems are one line and exit code 2; a
    failure inside the lab itself is one line and exit 1 (`--traceback` shows the trace).
    No traceback reaches a user otherwise. SIGINT, SIGTERM and SIGHUP end any command with one
    line and 128 + signal (one the lab was started with ignored, e.g. under nohup, stays
    ignored; harness/interrupts.py)."""
    from harness import interrupts

    # the imports below still run under the loading handler (one line, exit 128 + signal): a
    # signal there raised Interrupted outside the try below, a traceback and exit 1
    from harness.baselines import BaselineError
    from harness.notebooklock import LockError
    from harness.runner import RunSetupError
    from harness.safeio import Unsafe
    from harness.targets import TargetError

    show_trace = "--traceback" in sys.argv[1:]
    if show_trace:
        sys.argv = [a for a in sys.argv if a != "--traceback"]
        os.environ["DSV4_LAB_TRACEBACK"] = "1"
    click_exception = _click_exception_class()
    try:
        interrupts.raise_on_stop_signals()
        _add_axis_help()
        _check_where_once(sys.argv[1:])
        rc = app(standalone_mode=False, prog_name="dsv4-lab")  # click returns a command's exit code in this mode
        if rc == 130 and interrupts.first_signal() is not None:  # typer's bare 130 for any KeyboardInterrupt
            raise interrupts.Interrupted(interrupts.first_signal())
        sys.exit(rc if isinstance(rc, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (SpecError, FilterError, UsageError, BaselineError, TargetError, RunSetupError, LockError, Unsafe) as exc:
        print(f"dsv4-lab: {_one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (harness.interrupts.Interrupted)
        interrupts.ignore_all()  # on the way out: a second signal cuts nothing short
        print(f"dsv4-lab: {interrupts.describe(exc)}", file=sys.stderr)
        sys.exit(interrupts.exit_code_of(exc))
    except BrokenPipeError:  # `dsv4-lab … | head`
        sys.exit(1)
    except Exception as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `dsv4-lab` or a bare group: nothing was asked
            try:
                print(exc.ctx.get_help(), flush=True)
            except BrokenPipeError:  # `dsv4-lab | head`
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        if isinstance(exc, click_exception):  # typer's own usage errors
            command = getattr(getattr(exc, "ctx", None), "command_path", None) or "dsv4-lab"
            print(f"{command}: {_one_line(exc.format_message())} — see {command} --help", file=sys.stderr)
            sys.exit(2)
        if isinstance(exc, typer.Abort):
            print("dsv4-lab: aborted", file=sys.stderr)
            sys.exit(130)
        if show_trace:
            import traceback

            traceback.print_exc()
        print(f"dsv4-lab: internal error: {_one_line(exc)} — this is a bug in the lab; "
              "`--traceback` shows where", file=sys.stderr)
        sys.exit(1)


def _one_line(exc: object) -> str:
    text = str(exc) if not isinstance(exc, BaseException) else (str(exc) or type(exc).__name__)
    if isinstance(exc, BaseException) and not isinstance(exc, (SpecError, FilterError, UsageError)) \
            and type(exc).__module__ not in ("harness.baselines", "harness.targets", "harness.runner",
                                             "harness.notebooklock", "harness.safeio"):
        text = f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
    return " ".join(text.split()) or "error"


if __name__ == "__main__":
    main()
