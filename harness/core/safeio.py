"""Reading the notebook's files safely: git stores symbolic links, so a clone can put anything
where a records file, a store or an archive belongs.  Every reader under results/ opens here:

* only a regular file is read (opened O_NOFOLLOW | O_NONBLOCK, then fstat): a symbolic link or
  a FIFO, device or socket is refused with one line naming the path, never followed or waited on;
* an xz file is decompressed incrementally, at most MAX_XZ_BYTES of output (DSV4_LAB_MAX_XZ_MIB):
  a decompression bomb costs bounded memory and one line.

`Unsafe` (an OSError) carries the reason; readers skip the file with a warning, writers fail in
one line."""

from __future__ import annotations

import errno
import lzma
import os
import stat
from pathlib import Path

MAX_XZ_MIB_ENV = "DSV4_LAB_MAX_XZ_MIB"
DEFAULT_MAX_XZ_MIB = 256
_CHUNK = 1 << 14  # compressed bytes fed to a decompressor at a time


class Unsafe(OSError):
    """A file under results/ the lab will not read or write: `filename` names it, `strerror` says
    why and what to do; str() is the one line "PATH: why — fix"."""

    def __init__(self, path: Path | str, why: str):
        super().__init__(errno.EINVAL, why, str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def max_xz_bytes() -> int:
    """The most bytes one xz file of the notebook may decompress to."""
    raw = os.environ.get(MAX_XZ_MIB_ENV, "")
    try:
        mib = float(raw) if raw else DEFAULT_MAX_XZ_MIB
    except ValueError:
        mib = DEFAULT_MAX_XZ_MIB
    return max(1, int(mib * 1024 * 1024)) if mib > 0 else DEFAULT_MAX_XZ_MIB * 1024 * 1024


def _what(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


LINK = "is a symbolic link — the lab reads only regular files under results/; replace it with the real file"


def refusal(path: Path) -> str | None:
    """Why `path` is not a file the lab reads (None when it is a regular file, or missing, or
    cannot be looked at: opening it then says why)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return LINK
    if not stat.S_ISREG(st.st_mode):
        return f"is {_what(st.st_mode)}, not a regular file — move it away"
    return None


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A file descriptor of `path` opened with `flags` (blocking restored), only for a regular file,
        not a symbolic link; Unsafe otherwise, FileNotFoundError when missing without O_CREAT."""
    why = refusal(path)
    if why:
        raise Unsafe(path, why)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symbolic link put there since the check
            raise Unsafe(path, LINK) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unsafe(path, f"is {_what(st.st_mode)}, not a regular file — move it away")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file (Unsafe for anything else; FileNotFoundError when missing)."""
    fd = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


def xz_streams(data: bytes, cap: int | None = None):
    """(offset, decoded bytes, "") for every whole xz stream of `data`, and (offset, None, why) for
        one that cannot be decoded (reading goes on at the next xz header); padding skipped.  All
        streams decode to at most `cap` bytes (max_xz_bytes()): past it, one (offset, None, why)."""
    total = budget = max_xz_bytes() if cap is None else cap
    pos, end = 0, len(data)
    while pos < end:
        if data[pos] == 0:
            pos += 1
            continue
        start = pos
        dec = lzma.LZMADecompressor(lzma.FORMAT_XZ)
        out: list[bytes] = []
        size = 0
        why = ""
        try:
            while not dec.eof:
                if dec.needs_input:
                    if pos >= end:
                        why = "cut off (a write that did not finish?)"
                        break
                    chunk = data[pos:pos + _CHUNK]
                    pos += len(chunk)
                else:
                    chunk = b""
                piece = dec.decompress(chunk, max_length=budget - size + 1)
                size += len(piece)
                if size > budget:
                    limit = f"{total / (1024 * 1024):g} MiB" if total >= 1024 * 1024 else f"{total} bytes"
                    yield start, None, (f"decompresses to more than {limit} — not the lab's (a decompression "
                                        f"bomb?); the cap is ${MAX_XZ_MIB_ENV} MiB")
                    return
                out.append(piece)
        except lzma.LZMAError as exc:
            why = f"corrupt ({exc})"
        if not why:
            pos -= len(dec.unused_data)
            budget -= size
            yield start, b"".join(out), ""
            continue
        yield start, None, why
        nxt = data.find(XZ_MAGIC, start + 1)
        pos = end if nxt < 0 else nxt


XZ_MAGIC = b"\xfd7zXZ\x00"


def xz_decompress(data: bytes, cap: int | None = None) -> bytes:
    """Every xz stream of `data` decoded, at most `cap` bytes in all; ValueError (one phrase) for a
        corrupt or cut-off stream or a whole past the cap."""
    parts: list[bytes] = []
    for offset, text, why in xz_streams(data, cap):
        if text is None:
            raise ValueError(f"byte {offset}: {why}")
        parts.append(text)
    if not parts:
        raise ValueError("no xz stream in it")
    return b"".join(parts)
