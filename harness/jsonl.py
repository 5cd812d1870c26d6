"""Reading and appending JSON Lines files the lab's way (records, runs, notes, the inventory store): one
object per line, a line that does not parse is skipped with one `file:line` warning, non-finite
numbers and over-long lines are refused. Its own module so that the records and the inventory
store can both read without importing each other."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

MAX_LINE_BYTES = 64 * 1024


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def read_bytes(path: Path, warn: list[str] | None) -> bytes | None:
    """A file's bytes; None (and one warning when it exists) when it cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        if warn is not None:
            warn.append(f"{path}: cannot be read ({exc.strerror or exc}) — skipped")
        return None


def _parse(raw: bytes) -> Any:
    """One JSON line; ValueError (or UnicodeDecodeError, RecursionError) when it is not one."""
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(f"line longer than {MAX_LINE_BYTES} bytes")
    return json.loads(raw, parse_constant=_reject_constant)


def _numbered_lines(data: bytes, newest_first: bool) -> Iterator[tuple[int, bytes]]:
    lines = data.split(b"\n")
    order = range(len(lines), 0, -1) if newest_first else range(1, len(lines) + 1)
    for lineno in order:
        raw = lines[lineno - 1]
        if raw.strip():
            yield lineno, raw


def iter_jsonl(path: Path, warn: list[str] | None = None, newest_first: bool = False,
               data: bytes | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, object) for every line of `path` (or of `data`, read from it already)
    that parses; a bad line adds one warning to `warn` (file:line: why) and is skipped. A file
    that is missing yields nothing; one that cannot be read (a folder, no permission) adds
    one warning."""
    if data is None:
        data = read_bytes(path, warn)
    if data is None:
        return
    for lineno, raw in _numbered_lines(data, newest_first):
        try:
            obj = _parse(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            if warn is not None:
                warn.append(f"{path}:{lineno}: skipped a corrupt line ({(str(exc).splitlines() or [''])[0][:80]})")
            continue
        yield lineno, obj


def replace_file(path: Path, data: bytes) -> None:
    """Write `path` whole and atomically: a temp file beside it, fsynced, then renamed over it
    (a crash leaves the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Appender:
    """Appends JSON lines to one file, flushing each, so a crash keeps every finished line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, line: str) -> None:
        """Append `line` as one whole line. If the file does not end in a newline (a line
        cut off by a crash, or a hand edit), a newline goes first, so the fragment stays a
        lone corrupt line that readers skip and this record stays intact."""
        if "\n" in line or "\r" in line:
            raise ValueError("a record must be one line")
        data = (line + "\n").encode("utf-8")
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        os.write(self._fd, data)  # O_APPEND: one write, never interleaved with another appender's
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
