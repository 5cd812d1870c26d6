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


app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Staged kernel lab for DeepSeek-V4 attention: run, gate, dashboard.")
baseline_app = typer.Typer(no_args_is_help=True, help="Baselines: the metric values a case must keep.")
targets_app = typer.Typer(no_args_is_help=True, help="Remote targets (SSH).")
app.add_typer(baseline_app, name="baseline")
app.add_typer(targets_app, name="targets")

FILTER_CTX = {"allow_extra_args": True, "ignore_unknown_options": True}


def _spec() -> Spec:
    root = lab_root()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return load_spec(root=root)


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
    pairs = parse_axis_flags(extra) + (parse_where(where) if where else [])
    filters = parse_filters(stage, pairs)
    return expand(stage, filters)


def _run_size(stages: list[Stage], archs: list[str] | None, extra: list[str], where: str | None) -> None:
    """The whole command's case count, counted before anything is built: over MAX_RUN_CASES is
    one line and exit 2 (harness.matrix.check_run_size)."""
    pairs = parse_axis_flags(extra) + (parse_where(where) if where else [])
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
) -> None:
    """Run a stage's matrix (filtered by axis flags like --hd 512); live progress, a table, records."""
    from harness.report import run_local_and_report

    spec = _spec()
    stages = _stages(spec, stage, all_)
    archs = _archs(arch)
    gpu_list = _gpu_list(gpus)
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
            timeout=timeout, seed=seed, argv=argv, shard=shard_t,
        )
    raise typer.Exit(code)


@app.command("compile", context_settings=FILTER_CTX)
def compile_cmd(
    ctx: typer.Context,
    stage: str = typer.Argument(..., help="stage name"),
    arch: str = typer.Option("all", help="sm_90a, sm_100a or all"),
    where: Optional[str] = typer.Option(None, help="filters, e.g. hd=512"),
    keep: Optional[Path] = typer.Option(None, help="copy PTX and cubin (and SASS when the CUDA binary tools are here) to this folder"),
    diff: Optional[str] = typer.Option(None, "--diff", help="show what changed in inventory and resources against a commit (e.g. HEAD~1)"),
) -> None:
    """Compile only (no GPU needed): instruction inventory, registers / shared memory / spills; records written."""
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
    raise typer.Exit(compile_and_report(spec, st, archs, cases, keep, argv=["compile"] + sys.argv[2:]))


@app.command("gate")
def gate_cmd(
    install_hook: bool = typer.Option(False, "--install-hook", help="install the git pre-commit hook"),
    force: bool = typer.Option(False, "--force", help="with --install-hook: replace a hook the lab did not write"),
    no_run: bool = typer.Option(False, "--no-run", help="never run stale cases; report them"),
) -> None:
    """Regression gate: every baselined case must still hold on the current tree."""
    from harness import gate

    root = lab_root()
    if install_hook:
        raise typer.Exit(gate.install_hook(root, force=force))
    raise typer.Exit(gate.main(root, allow_run=not no_run))


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
    pairs = parse_axis_flags(ctx.args) + (parse_where(where) if where else [])
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
    from harness import inspect as inspection

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


def main() -> None:
    """Console entry point. Usage and config problems are one line and exit code 2; a
    failure inside the lab itself is one line and exit 1 (`--traceback` shows the trace).
    No traceback reaches a user otherwise. SIGINT, SIGTERM and SIGHUP end any command with one
    line and 128 + signal (one the lab was started with ignored, e.g. under nohup, stays
    ignored; harness/interrupts.py)."""
    from harness import interrupts

    interrupts.raise_on_stop_signals()
    from harness.baselines import BaselineError
    from harness.runner import RunSetupError
    from harness.targets import TargetError

    show_trace = "--traceback" in sys.argv[1:]
    if show_trace:
        sys.argv = [a for a in sys.argv if a != "--traceback"]
        os.environ["DSV4_LAB_TRACEBACK"] = "1"
    click_exception = _click_exception_class()
    try:
        _add_axis_help()
        rc = app(standalone_mode=False)  # click returns a command's exit code in this mode
        if rc == 130 and interrupts.first_signal() is not None:  # typer's bare 130 for any KeyboardInterrupt
            raise interrupts.Interrupted(interrupts.first_signal())
        sys.exit(rc if isinstance(rc, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (SpecError, FilterError, UsageError, BaselineError, TargetError, RunSetupError) as exc:
        print(f"dsv4-lab: {_one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (harness.interrupts.Interrupted)
        interrupts.ignore_all()  # on the way out: a second signal cuts nothing short
        print(f"dsv4-lab: {interrupts.describe(exc)}", file=sys.stderr)
        sys.exit(interrupts.exit_code_of(exc))
    except BrokenPipeError:  # `dsv4-lab … | head`
        sys.exit(1)
    except Exception as exc:
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
            and type(exc).__module__ not in ("harness.baselines", "harness.targets", "harness.runner"):
        text = f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
    return " ".join(text.split()) or "error"


if __name__ == "__main__":
    main()
