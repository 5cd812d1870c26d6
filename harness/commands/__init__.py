"""The command registry: one module per `dsv4-lab` command (the layout of asv's `commands/`).

Each module of this package declares `COMMANDS`: a list of `harness.commands.base.Command`
(fields: its docstring). Everything else is derived from the modules found here:

  cli.py                  builds the typer app from `registry.registry()` (groups, context
                          settings, the axis-filter epilog of `--help`) and catches
                          `registry.one_line_errors()`
  harness/core/optionnames.py  lists the flag names `base.option()` accepts; the stages.yaml loader
                          refuses them as axis names (tests/test_commands.py checks both ways)

Adding a command is one file here (docs/ARCHITECTURE.md, "Where a new thing goes"). A module is
named after its command, except where the name is a standard library module's (`inspect` lives
in kernel_inspect.py). A module without COMMANDS is a helper (base.py, registry.py).
This file holds no code: the package's attributes are its modules (`list`, `compile`), which
would shadow the builtins of any code here.

Layer: the top. A command module may import any harness module (lazily inside its function
for the heavy ones: the command line loads every command module); nothing below imports
harness.commands.
"""
