"""A `--debug-hangs` run: every mbarrier wait bounded (stages/common/hang_guard.py); an expired one
prints one line through the device printf and traps.  The lab's side: ENV (the variable a compile
worker traces with), DeviceOutput (captures fd 1, where a kernel's printf goes, around a
launch), hang_line (the first hang line in it), KernelHang (recorded as `hang` with the line).
Without the flag the worker does not touch its stdout."""

from __future__ import annotations

import ctypes
import os
import tempfile

ENV = "DSV4_DEBUG_HANGS"  # the same name stages/common/hang_guard.py reads
TAG = "DSV4-HANG"
DEBUG_LABEL = "hangs"  # the compile summary's "debug" value, the cache key's


class KernelHang(Exception):
    """A bounded wait expired: the one line names the role, pipeline, slot, phase and CTA."""


def describe(line: str, others: int, cause: BaseException | None) -> str:
    """The record's error: the hang line, that this was a debug build, the CUDA error."""
    more = f" (+{others} more waiting warp(s))" if others else ""
    why = f"; then {type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}" \
        if cause is not None else ""
    return f"hang in a --debug-hangs build: {line.strip()}{more}{why}"


def hang_lines(text: str) -> list[str]:
    """The hang lines of a kernel's printed output, in order."""
    return [ln[ln.index(TAG):].strip() for ln in text.splitlines() if TAG in ln]


def hang_line(text: str) -> str | None:
    lines = hang_lines(text)
    return lines[0] if lines else None


def _flush_c_stdio() -> None:
    """The driver writes printf through C's stdout, buffered when it is not a terminal."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


class DeviceOutput:
    """`with DeviceOutput() as out: …` — fd 1 goes to a temporary file meanwhile; afterwards
        `out.text` holds it, and it is passed on to the real stdout."""

    def __init__(self) -> None:
        self.text = ""
        self._saved: int | None = None
        self._file = None

    def __enter__(self) -> "DeviceOutput":
        _flush_c_stdio()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(1)
        os.dup2(self._file.fileno(), 1)
        return self

    def __exit__(self, *exc) -> None:
        _flush_c_stdio()
        assert self._saved is not None and self._file is not None
        os.dup2(self._saved, 1)
        os.close(self._saved)
        self._file.seek(0)
        data = self._file.read()
        self._file.close()
        self.text = data.decode(errors="replace")
        if data:
            try:
                os.write(1, data)
            except OSError:
                pass
