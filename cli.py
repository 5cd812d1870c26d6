"""dsv4-lab: the command line of the lab (typer + rich).

The commands are not written here: each is one module of harness/commands/ (the registry;
its docstring says how to add one). This file builds the typer app from them — groups,
context settings, the axis filters in `--help` — and runs it: every command loads stages.yaml
first; a bad spec, a bad filter or a bad targets file is one line on stderr and exit code 2,
never a traceback.

Typer stays (a dependency already): its help pages, usage errors and `-h` are what the tests
and the README pin, and each command's typed signature is its declaration of flags.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.core.interrupts import exit_on_stop_signals

if Path(sys.argv[0]).name in ("dsv4-lab", "cli.py"):  # the command itself, not an import by a test
    exit_on_stop_signals()  # a Ctrl-C while the command line loads: one line, exit 130

import typer  # noqa: E402

from harness.commands.base import FILTER_CTX, HELP_CTX, Command, UsageError, axis_help  # noqa: E402

APP_HELP = "Staged kernel lab for DeepSeek-V4 attention: run, gate, dashboard."


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


def _main_options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version_callback,
                                               help="print the lab's version (and CuTeDSL's, torch's) and exit")) -> None:
    """Staged kernel lab for DeepSeek-V4 attention: run, gate, dashboard."""


def build_app(commands: list[Command], axis_help_text: bool = False) -> typer.Typer:
    """The typer app of the registry's commands (harness/commands/), in its order; with
    `axis_help_text`, each command that takes axis filters lists them in its --help."""
    app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, context_settings=HELP_CTX,
                      help=APP_HELP)
    app.callback()(_main_options)
    groups: dict[str, typer.Typer] = {}
    epilogs: dict[str, str] = {}
    for c in commands:
        where = app
        if c.group is not None:
            if c.group.name not in groups:
                groups[c.group.name] = typer.Typer(no_args_is_help=True, help=c.group.help)
                app.add_typer(groups[c.group.name], name=c.group.name)
            where = groups[c.group.name]
        if c.axes and axis_help_text and c.axes not in epilogs:
            epilogs[c.axes] = axis_help(c.axes)
        where.command(c.name, context_settings=FILTER_CTX if c.axes else None,
                      epilog=(epilogs.get(c.axes) or None) if c.axes else None)(c.function)
    return app


def _click_exception_class() -> type[BaseException]:
    """The ClickException class typer raises (typer vendors click in recent releases; never
    import `click` itself: a fresh install may not have it)."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _check_where_once(argv: list[str]) -> None:
    """`--where hd=64 --where n=128`: click keeps only the last, so the command would run cases nobody
        asked for; refused in one line with the combined form."""
    words = argv[:argv.index("--")] if "--" in argv else argv
    values = [w.split("=", 1)[1] if w.startswith("--where=") else (words[i + 1] if i + 1 < len(words) else "")
              for i, w in enumerate(words) if w == "--where" or w.startswith("--where=")]
    if len(values) > 1:
        raise UsageError(f"--where given {len(values)} times — give it once, the filters joined by commas "
                         f"(e.g. --where {','.join(v for v in values if v) or 'hd=512,n=256'})")


def main() -> None:
    """Console entry point.  Usage and config problems: one line, exit 2; a failure inside the lab:
        one line, exit 1 (`--traceback` shows the trace).  SIGINT, SIGTERM and SIGHUP end any
        command with one line and 128 + signal (core/interrupts.py)."""
    from harness.core import interrupts

    # the registry imports every command module, and with them the error classes they declare,
    # still under the loading handler (one line, exit 128 + signal): a signal there raised
    # Interrupted outside the try below, a traceback and exit 1
    from harness.commands.registry import one_line_errors, registry

    commands = registry()
    phrased = one_line_errors(commands)
    show_trace = "--traceback" in sys.argv[1:]
    if show_trace:
        sys.argv = [a for a in sys.argv if a != "--traceback"]
        os.environ["DSV4_LAB_TRACEBACK"] = "1"
    click_exception = _click_exception_class()
    try:
        interrupts.raise_on_stop_signals()
        wants_help = "--help" in sys.argv[1:] or "-h" in sys.argv[1:]  # the axis filters: read only for --help
        app = build_app(commands, axis_help_text=wants_help)
        _check_where_once(sys.argv[1:])
        rc = app(standalone_mode=False, prog_name="dsv4-lab")  # click returns a command's exit code in this mode
        if rc == 130 and interrupts.first_signal() is not None:  # typer's bare 130 for any KeyboardInterrupt
            raise interrupts.Interrupted(interrupts.first_signal())
        sys.exit(rc if isinstance(rc, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except phrased as exc:  # the errors the commands declare (harness/commands/): already one line
        print(f"dsv4-lab: {_one_line(exc, phrased)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGHUP (harness.core.interrupts.Interrupted)
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
        print(f"dsv4-lab: internal error: {_one_line(exc, phrased)} — this is a bug in the lab; "
              "`--traceback` shows where", file=sys.stderr)
        sys.exit(1)


def _one_line(exc: object, phrased: tuple[type[BaseException], ...] = ()) -> str:
    """The exception (or text) as one line, prefixed with its type unless the lab phrased it."""
    text = str(exc) if not isinstance(exc, BaseException) else (str(exc) or type(exc).__name__)
    if isinstance(exc, BaseException) and not isinstance(exc, phrased) \
            and type(exc).__module__ not in {c.__module__ for c in phrased}:
        text = f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
    return " ".join(text.split()) or "error"


if __name__ == "__main__":
    main()
