"""Reading and appending JSON Lines files the lab's way (records, runs, notes, the inventory store): one
object per line, a line that does not parse is skipped with one `file:line` warning, non-finite
numbers and over-long lines are refused. Its own module so that the records and the inventory
store can both read without importing each other."""

from __future__ import annotations

import json
import os
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator

from harness.core.notebooklock import open_lock, shared
from harness.core.safeio import Unsafe, open_regular, read_regular

MAX_LINE_BYTES = 64 * 1024


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def read_bytes(path: Path, warn: list[str] | None) -> bytes | None:
    """A file's bytes; None (one warning when it exists) when it cannot be read or is no regular file
        (never followed or waited on: core/safeio.py)."""
    try:
        return read_regular(path)
    except FileNotFoundError:
        return None
    except Unsafe as exc:
        if warn is not None:
            warn.append(f"{exc.filename}: cannot be read ({exc.strerror}) — skipped")
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
    """(line number, object) for every line of `path` (or `data`) that parses; a bad line adds one
        warning (file:line: why) to `warn`.  A missing file yields nothing; an unreadable one warns."""
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
    """Appends JSON lines to one file, flushing each, so a crash keeps every finished line.  With
        `lock` each write holds results/.lock shared and first checks that the open file is still
        the one `path` names (compaction may have replaced it), reopening it if not.  Only a regular
        file is written (core/safeio.py)."""

    def __init__(self, path: Path, lock: Path | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock_fd = open_lock(lock) if lock is not None else -1
        try:
            self._fd = self._open()
        except BaseException:
            self._close_lock()
            raise

    def _open(self) -> int:
        return open_regular(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)

    def _follow(self) -> None:
        """Reopen the file when `path` names another one now (replaced by compaction, or removed)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        own = os.fstat(self._fd)
        if st is None or (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
            fd = self._open()
            os.close(self._fd)
            self._fd = fd

    def write(self, line: str) -> None:
        """Append `line` as one whole line; after a file not ending in a newline (a crash's cut line) a
                newline goes first, so the fragment stays a lone corrupt line readers skip."""
        if "\n" in line or "\r" in line:
            raise ValueError("a record must be one line")
        with self._locked():
            self._append((line + "\n").encode("utf-8"), fresh_line=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock held shared (when there is one), and the file the path names open."""
        if self._lock_fd < 0:
            self._follow()
            yield
            return
        with shared(self._lock_fd):
            self._follow()
            yield

    def _append(self, data: bytes, fresh_line: bool) -> None:
        if fresh_line:
            size = os.fstat(self._fd).st_size
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                data = b"\n" + data
        done = os.write(self._fd, data)  # O_APPEND: one write, never interleaved with another appender's
        while done < len(data):  # a short write (disk full…): finish it, or fail
            done += os.write(self._fd, data[done:])
        os.fsync(self._fd)

    def _close_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def close(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1
        self._close_lock()
