"""What every command module declares with, and the arguments the commands share (asv's
`commands/__init__.py` + `common_args.py`, in one place).

A command is a typer-annotated function (its docstring is its help, its parameters its
arguments and flags) and a `Command` naming it: the group it sits in, whether it takes
stage-axis filters (`--hd 64`: `axes`), and the errors it turns into one-line messages.
Flags are declared with `option()`, by the names of harness/core/optionnames.py only — the same
list the stages.yaml loader refuses as axis names.

Imports: core modules (paths, optionnames), spec and matrix for the shared arguments, and the
notebook's lock and file-safety errors; never a command module (harness/commands/__init__.py
finds those).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import typer

from harness.spec.matrix import FilterError, check_run_size, count, expand, parse_axis_flags, parse_filters, parse_where
from harness.core.notebooklock import LockError
from harness.core.optionnames import COMMAND_OPTIONS, flag
from harness.core.paths import lab_root
from harness.core.safeio import Unsafe
from harness.spec.spec import ARCHS, ARCH_KEYS, Spec, SpecError, Stage, load_spec


class UsageError(Exception):
    """Bad command-line usage, phrased as one line."""


# Errors any command may meet, each already one line naming what to fix: the spec, the
# filters, the command line, the notebook's lock and its files (exit 2).
COMMON_ERRORS: tuple[type[BaseException], ...] = (SpecError, FilterError, UsageError, LockError, Unsafe)

HELP_CTX = {"help_option_names": ["-h", "--help"]}  # `-h`, what people type first, is --help too
# A command that takes axis filters: the words it does not declare reach it as ctx.args.
FILTER_CTX = {"allow_extra_args": True, "ignore_unknown_options": True, **HELP_CTX}

Axes = Literal["matrix", "bench"]


@dataclass(frozen=True)
class Group:
    """A word that groups commands (`dsv4-lab baseline accept`)."""

    name: str
    help: str


@dataclass(frozen=True)
class Command:
    """One `dsv4-lab` command.

    name      the word typed (inside `group` when it has one)
    function  typer-annotated; its docstring is the help, its parameters the arguments and
              flags (declared with `option()`); it ends with `raise typer.Exit(code)`
    axes      "matrix": takes a stage's axis flags (`--hd 64`) as filters of its test matrix;
              "bench": of its bench shapes; None: takes none (an unknown --word is an error)
    errors    exception classes it raises already phrased as one line (exit 2, no traceback),
              besides COMMON_ERRORS; the command line turns them into one line wherever they
              surface (a notebook error can reach any command that reads the notebook)
    """

    name: str
    function: Callable[..., Any]
    group: Group | None = None
    axes: Axes | None = None
    errors: tuple[type[BaseException], ...] = ()

    @property
    def path(self) -> str:
        """`baseline accept`, `run`."""
        return f"{self.group.name} {self.name}" if self.group else self.name


def option(name: str, default: Any = None, *, help: str | None = None) -> Any:
    """A command's flag `--name` (harness/core/optionnames.py must list the name: the stages.yaml
    loader refuses it as an axis, so a filter can never be taken for it)."""
    if name not in COMMAND_OPTIONS:
        raise LookupError(f"{flag(name)}: not an option name of the lab — add '{name}' to COMMAND_OPTIONS in "
                          "harness/core/optionnames.py (stages.yaml may then no longer name an axis so)")
    return typer.Option(default, flag(name), help=help)


# ---------------------------------------------------------------------------------------
# The arguments the commands share: the spec, --arch, stage names, axis filters and --where.

_loaded_specs: list[Spec] = []  # the spec this command loaded (for the names of every stage's axes)


def spec_here() -> Spec:
    """The lab's spec (stages.yaml of the lab root), with the lab root importable."""
    root = lab_root()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = load_spec(root=root)
    _loaded_specs[:] = [spec]
    return spec


def archs_of(arch: str) -> list[str] | None:
    """`--arch`: the compiler targets it names (None: all)."""
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


def cases_of(stage: Stage, extra: list[str], where: str | None):
    """The stage's cases that pass the axis flags and --where."""
    check_option_names(extra, [stage])
    filters = parse_filters(stage, filter_pairs(extra, where))
    return expand(stage, filters)


def filter_pairs(extra: list[str], where: str | None) -> list[tuple[str, str]]:
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
        flag_values = ",".join(v for x, v in flags if x == a)
        wh = ",".join(v for x, v in wheres if x == a)
        raise UsageError(f"--{a.replace('_', '-')} {flag_values} and --where {a}={wh.replace(',', '|')} both filter "
                         f"{a} — give {a} once (e.g. --{a.replace('_', '-')} {flag_values},{wh})")
    return flags + wheres


def current_context():
    """The running command's click context (typer vendors click in recent releases: never
    import `click` itself when typer has its own)."""
    import importlib

    for name in ("typer._click.globals", "click.globals"):
        try:
            return importlib.import_module(name).get_current_context(silent=True)
        except ImportError:
            continue
    return None


def check_option_names(extra: list[str], stages: list[Stage]) -> None:
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
        ctx = current_context()
        options = sorted({o for p in (ctx.command.params if ctx else []) for o in getattr(p, "opts", [])
                          if o.startswith("--")} | {"--help"})
        axis_flags = sorted(f"--{a.replace('_', '-')}" for a in axes)
        close = difflib.get_close_matches(f"--{name}", options + axis_flags, n=1, cutoff=0.6)
        command = ctx.command_path if ctx else "dsv4-lab"
        hint = (f"did you mean {close[0]}?" if close else
                f"{command} takes {', '.join(o for o in options if o != '--help')}"
                + (f"; axis filters here: {', '.join(axis_flags)}" if axis_flags else ""))
        raise UsageError(f"no such option '--{name}' — {hint} (see {command} --help)")


def check_run_size_of(stages: list[Stage], archs: list[str] | None, extra: list[str], where: str | None) -> None:
    """The whole command's case count, counted before anything is built: over MAX_RUN_CASES is
    one line and exit 2 (harness.spec.matrix.check_run_size)."""
    check_option_names(extra, stages)  # a misspelt option is named as such before any value is read
    pairs = filter_pairs(extra, where)
    check_run_size([(st.name, count(st, parse_filters(st, pairs))
                     * sum(1 for a in st.kernels if not archs or a in archs)) for st in stages])


def stages_of(spec: Spec, name: str | None, all_: bool) -> list[Stage]:
    """The stages a STAGE argument or --all names (exactly one of the two)."""
    if name is not None and name.startswith("--"):  # `run --dry-run`: an option where the stage goes
        check_option_names([name], list(spec.stages.values()) if all_ else [])
        raise UsageError(f"{name} is an axis filter — name a stage first (e.g. dsv4-lab run stage-A {name} …) "
                         "or pass --all")
    if all_ and name is not None:  # `run stage-A --all`: neither is what both words say
        raise UsageError(f"{name} and --all: give a stage or --all, not both")
    if all_ or name is None:
        if not all_ and name is None:
            raise UsageError("name a stage (e.g. dsv4-lab run stage-A) or pass --all")
        # the ladder's stages: a suite stage (a peer's case list, docs/SUITES.md) runs when named
        # or by `dsv4-lab suite NAME`, never as part of --all
        return [st for st in spec.stages.values() if st.suite is None]
    return [spec.stage(name)]


def precheck(spec: Spec, stages: list[Stage]) -> None:
    """The stage contract (`dsv4-lab check`) before anything compiles or runs: a broken stage
    is one line per problem and exit 2. A stage whose sources and check code are unchanged
    since it last passed is not checked again (the mark lives in the compile cache folder)."""
    import hashlib

    from harness.spec import check
    from harness.spec.identity import file_digest, source_hash
    from harness.core.paths import cache_dir

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


def axis_help(axes: Axes) -> str:
    """The axis flags each stage takes, for the --help of a command that filters cases:
    its test matrix ("matrix") or its bench shapes ("bench"). Empty where the spec cannot be
    read (a broken spec shows its own one-line error when a command runs)."""
    try:
        spec = spec_here()
    except Exception:
        return ""
    head = ("Axis filters (each takes one value or a comma list):" if axes == "matrix" else
            "Axis filters on the bench shapes (each takes one value or a comma list):")
    lines = [head]
    for st in spec.stages.values():
        matrix = st.matrix if axes == "matrix" else (st.bench_plan.matrix if st.bench_plan is not None else None)
        if not matrix:
            continue
        flags = "  ".join(f"--{a.replace('_', '-')} {{{','.join(str(v).lower() if isinstance(v, bool) else str(v) for v in vals)}}}"
                          for a, vals in matrix.items())
        lines.append(f"  {st.name}: {flags}")
    return "\n\n".join(lines) if len(lines) > 1 else ""
