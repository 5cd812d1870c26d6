"""The notebook's lock: results/.lock (fcntl.flock; not committed).

* An appender (core/jsonl.py's Appender) holds it SHARED for each write, after checking that its
  open file is still the one the path names (reopening it when compaction replaced it):
  appenders never wait for each other and never write into a replaced file.
* Compaction holds it EXCLUSIVE from the first read to the last rename: no line is lost.

Baselines keep their own lock (results/.baselines.lock)."""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_NAME = ".lock"


class LockError(OSError):
    """The lock file cannot be used (one line naming it and the fix)."""

    def __init__(self, path: Path, why: str):
        super().__init__(errno.EINVAL, why, str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def lock_path(results: Path) -> Path:
    return results / LOCK_NAME


def open_lock(path: Path) -> int:
    """A descriptor of lock file `path` (created with its folder); LockError (one line) when it cannot
        be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except IsADirectoryError:
        raise LockError(path, "is a folder — it is the lab's lock file: remove the folder") from None
    except (FileExistsError, NotADirectoryError):
        raise LockError(path, f"{path.parent} is not a folder — the lab's notebook folder: move the file away "
                              "(git checkout results)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LockError(path, "is a symbolic link — it is the lab's lock file: remove it") from None
        raise LockError(path, f"cannot be opened ({exc.strerror or exc}) — make results/ writable") from None


@contextmanager
def exclusive(results: Path) -> Iterator[None]:
    """Hold the notebook's lock alone (compaction): every appender waits until it is released."""
    fd = open_lock(lock_path(results))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextmanager
def shared(fd: int) -> Iterator[None]:
    """Hold the lock open at `fd` shared for one write (appenders)."""
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
