"""The terminal, shared by every command: a console that stays readable when piped, and text made
safe to show (no control characters, no rich markup from data). A record's one-line view is
harness/notebook/recordview.py (it reads records, a layer up)."""

from __future__ import annotations

from rich.console import Console

from harness.core.labels import case_label, printable  # noqa: F401  (printable: named here too)


def make_console() -> Console:
    """A console that stays readable when piped to a file (wide, no colour codes)."""
    probe = Console()
    return probe if probe.is_terminal else Console(width=160, no_color=True)
