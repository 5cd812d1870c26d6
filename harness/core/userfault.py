"""A failure in the user's own code, as one line that points at it.

An exception raised in a user's module (any file under the lab root outside `harness/` and
installed libraries) is one line naming the innermost frame of *their* code:

    oracles/foo.py:12: in reference: ZeroDivisionError: division by zero

A SyntaxError names its own file and line. The full traceback is kept apart (`full_trace`) for a
record's `trace` or `--traceback`; ANSI colours are stripped from both."""

from __future__ import annotations

import inspect
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_LAB_DIRS = ("harness",)  # the lab's own code: never blamed
_LIB_MARKERS = ("site-packages", "dist-packages", ".venv", "venv", ".tox")
MAX_MESSAGE = 300


@dataclass(frozen=True)
class Frame:
    file: str  # relative to the lab root, "/"-separated
    line: int
    function: str  # "<module>" for code run at import


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _relative_user_path(filename: str | None, root: Path) -> str | None:
    """`filename` relative to `root` when it is the user's code, else None."""
    if not filename or filename.startswith("<"):
        return None
    try:
        rel = Path(filename).resolve().relative_to(root.resolve())
    except (ValueError, OSError):
        return None
    parts = rel.parts
    if not parts or parts[0] in _LAB_DIRS or parts[0] == "cli.py":
        return None
    if any(p in _LIB_MARKERS for p in parts):
        return None
    return rel.as_posix()


def _frames(tb: TracebackType | None) -> list[tuple[str, int, str]]:
    return [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(tb)]


def user_frame(exc: BaseException, root: Path) -> Frame | None:
    """The innermost frame of the user's code in `exc`'s traceback (following the chain, innermost
        first), or a SyntaxError's location in a user's file."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:  # exc, then its cause / context
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for e in reversed(chain):  # the original failure first
        if isinstance(e, SyntaxError):
            rel = _relative_user_path(e.filename, root)
            if rel:
                return Frame(rel, e.lineno or 0, "<module>")
        for filename, line, name in reversed(_frames(e.__traceback__)):
            rel = _relative_user_path(filename, root)
            if rel:
                return Frame(rel, line, name)
    return None


def _message(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        text = exc.msg or ""
    else:
        text = str(exc)
    lines = [ln.strip() for ln in strip_ansi(text).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if len(first) > MAX_MESSAGE:
        first = first[: MAX_MESSAGE - 1] + "…"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def describe(exc: BaseException, root: Path) -> str:
    """One line for a failure in the user's code: `FILE:LINE: in FUNC: Type: message`
    (`at import` for module-level code). Without a user frame: `Type: message`."""
    frame = user_frame(exc, Path(root))
    msg = _message(exc)
    if frame is None:
        return msg
    where = "at import" if frame.function == "<module>" else f"in {frame.function}"
    return f"{frame.file}:{frame.line}: {where}: {msg}"


def full_trace(exc: BaseException) -> str:
    """The whole traceback (chained exceptions included), ANSI codes stripped."""
    return strip_ansi("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def where_defined(obj: object, root: Path) -> str:
    """`FILE:LINE` of a function's or class's definition, relative to `root` when under it."""
    target = inspect.unwrap(obj) if callable(obj) else obj
    try:
        path = inspect.getsourcefile(target) or inspect.getfile(target)  # type: ignore[arg-type]
        lines, line = inspect.getsourcelines(target)  # type: ignore[arg-type]
        for offset, text in enumerate(lines):  # past the decorators, to the def itself
            if text.lstrip().startswith(("def ", "async def ", "class ")):
                line += offset
                break
    except (TypeError, OSError):
        code = getattr(target, "__code__", None)
        if code is None:
            return getattr(target, "__qualname__", repr(target))
        path, line = code.co_filename, code.co_firstlineno
    try:
        shown = Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        shown = str(path)
    return f"{shown}:{line}"
