"""The record channel of a remote run: records travel from the remote `run` back here so that
nothing the kernel prints can lose a record or pass for one.

Remote side (`Sender`, opened by `open_sender` before any worker or compiler process exists):
- the key is read from stdin, never on a command line nor in the workers' environment;
- fd 1 is duplicated to a private close-on-exec descriptor for the records, and fd 1 (every
  child's stdout) is pointed at stderr: a kernel's print lands in stderr;
- stdin stays open while the run lasts: when it ends (the local side or the link is gone) the
  process sends itself SIGHUP and stops as any interruption does;
- every line is `@@dsv4-rec SEQ MAC PAYLOAD`: SEQ counts from 1, MAC = HMAC-SHA256(key,
  "SEQ PAYLOAD") in hex, PAYLOAD one JSON object.

Local side (`Receiver`): a line is accepted only with the right MAC and a SEQ above every one
accepted before; any other line (a banner, a guessed, replayed or reordered frame) is rejected
with the reason."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import signal
import sys
import threading

PREFIX = b"@@dsv4-rec "
KEY_RE = re.compile(r"^[0-9a-f]{64}$")
FRAME_OVERHEAD = 128  # bytes a frame adds to its payload, at most (prefix, seq, MAC)


class ChannelError(Exception):
    """The channel cannot be opened (one line)."""


def new_key() -> str:
    """A fresh per-run secret key (64 hex digits)."""
    return secrets.token_hex(32)


def mac(key: str, seq: int, payload: bytes) -> str:
    return hmac.new(key.encode(), b"%d " % seq + payload, hashlib.sha256).hexdigest()


def frame(key: str, seq: int, payload: str) -> bytes:
    """One framed line (newline included)."""
    data = payload.encode("utf-8")
    if b"\n" in data or b"\r" in data:
        raise ValueError("a channel payload must be one line")
    return PREFIX + b"%d %s " % (seq, mac(key, seq, data).encode()) + data + b"\n"


class Sender:
    """The remote end: writes framed lines on its private descriptor, one at a time."""

    def __init__(self, key: str, fd: int):
        self.key = key
        self.fd = fd
        self.seq = 0
        self._lock = threading.Lock()

    def send(self, payload: str) -> None:
        with self._lock:
            self.seq += 1
            data = frame(self.key, self.seq, payload)
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]


_sender: Sender | None = None


def _read_key(fd: int) -> str:
    """The key line from `fd` (the first line of stdin)."""
    if os.isatty(fd):
        raise ChannelError("run --emit-jsonl is the remote side of `run --target`: it reads its channel key "
                           "on stdin — run `dsv4-lab run STAGE --target NAME` instead")
    data = b""
    while b"\n" not in data and len(data) < 256:
        chunk = os.read(fd, 256 - len(data))
        if not chunk:
            break
        data += chunk
    key = data.split(b"\n", 1)[0].decode("ascii", "replace").strip()
    if not KEY_RE.fullmatch(key):
        raise ChannelError("run --emit-jsonl: no channel key on stdin (64 hex digits on the first line) — "
                           "it is the remote side of `run --target NAME`, which sends one")
    return key


def _watch_hangup(fd: int) -> None:
    """Thread body: wait for the end of stdin (the local side or the link is gone), then stop."""
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGHUP)


def open_sender() -> Sender:
    """Open the remote end of the channel (once per process; later calls return it): read the
    key from stdin, watch stdin for a hang-up, move the records to a private descriptor,
    point stdout at stderr."""
    global _sender
    if _sender is not None:
        return _sender
    key = _read_key(0)
    watch = os.dup(0)  # close-on-exec: only this process watches the link
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # children get /dev/null
    os.close(devnull)
    threading.Thread(target=_watch_hangup, args=(watch,), name="dsv4-hangup", daemon=True).start()
    sys.stdout.flush()
    private = os.dup(1)  # close-on-exec (PEP 446): no child process inherits it
    os.dup2(2, 1)  # fd 1 is now stderr, for this process and every child it starts
    _sender = Sender(key, private)
    return _sender


def install_sender(key: str, fd: int) -> Sender:
    """Make the channel's remote end write to `fd` (a Slurm task's record file) instead of reading its
        key from stdin; points stdout at stderr, as `open_sender` does."""
    global _sender
    if not KEY_RE.fullmatch(key):
        raise ChannelError("not a channel key (64 hex digits)")
    sys.stdout.flush()
    os.dup2(2, 1)
    _sender = Sender(key, fd)
    return _sender


class Receiver:
    """The local end: checks each line's sequence number and MAC."""

    def __init__(self, key: str):
        self.key = key
        self.seq = 0

    def open(self, raw: bytes) -> tuple[bytes | None, str | None]:
        """(payload, None) for the next authentic frame, else (None, why)."""
        if not raw.startswith(PREFIX):
            return None, "not a record frame (output outside the record channel)"
        parts = raw[len(PREFIX):].split(b" ", 2)
        if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 12:
            return None, "a malformed record frame"
        seq, tag, payload = int(parts[0]), parts[1], parts[2]
        if not hmac.compare_digest(tag, mac(self.key, seq, payload).encode()):
            return None, "a record frame without this run's key (forged or from another run)"
        if seq <= self.seq:
            return None, f"frame {seq} again or out of order (after {self.seq}): replayed or reordered"
        self.seq = seq  # a gap is a line rejected before it got here (e.g. too long): already counted
        return payload, None
