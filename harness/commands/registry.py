"""Finding the commands: every module of harness/commands/ that declares COMMANDS, in help
order, and the errors they turn into one line (see the package docstring)."""

from __future__ import annotations

import importlib
import pkgutil

from harness.commands.base import COMMON_ERRORS, Command

# The order `dsv4-lab --help` lists commands in (asv's command_order: the workflow's order);
# groups after the plain commands. A command not named here comes last, by name.
ORDER = ("list", "run", "compile", "gate", "dashboard", "history", "show", "note", "check", "bench", "calibrate",
         "profile", "inspect", "baseline", "targets", "new")


def _place(command: Command) -> tuple[int, int, str]:
    word = command.group.name if command.group else command.name
    rank = ORDER.index(word) if word in ORDER else len(ORDER)
    return (command.group is not None, rank, word if rank == len(ORDER) else "")


def registry() -> list[Command]:
    """Every command of every module of this package, in help order (a group's commands in
    the order their module declares them)."""
    found: list[Command] = []
    package = importlib.import_module("harness.commands")
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"harness.commands.{info.name}")
        found.extend(getattr(module, "COMMANDS", ()))
    seen: dict[str, Command] = {}
    for c in found:
        if c.path in seen:
            raise LookupError(f"two commands named '{c.path}' in harness/commands ({c.function.__module__} and "
                              f"{seen[c.path].function.__module__})")
        seen[c.path] = c
    return sorted(found, key=_place)


def one_line_errors(commands: list[Command]) -> tuple[type[BaseException], ...]:
    """The exception classes the command line prints as one line, exit 2: the common ones and
    every command's own."""
    out = list(COMMON_ERRORS)
    for c in commands:
        out += [e for e in c.errors if e not in out]
    return tuple(out)
