"""Stop signals: SIGINT (Ctrl-C), SIGTERM and SIGHUP end a command the same way, exit code 128 +
signal, one line, never a traceback.

* A signal the lab was started with ignored (`nohup`, a background job) stays ignored.
* `Interrupted` is a KeyboardInterrupt carrying the signal, so `except KeyboardInterrupt` code
  stops the same way on SIGTERM and SIGHUP.
* `StopGuard`: the first stop signal raises `Interrupted`; the clean-up is never cut short by a
  second one.
* `block_hangup_while`: start a helper process (multiprocessing's resource tracker) with SIGHUP
  blocked, so a terminal hang-up does not kill it under the lab."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

# The signals that stop a command, and the exit code each gives (128 + signal).
STOP_SIGNALS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


_FIRED: list[int] = []  # the stop signal of each Interrupted made in this process, in order


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in the main thread; `signum` says which."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        _FIRED.append(signum)

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.signum)


def first_signal() -> int | None:
    """The first stop signal raised as `Interrupted` here (None: none yet); the entry point reads it
        (typer turns a KeyboardInterrupt into a bare 130)."""
    return _FIRED[0] if _FIRED else None


def exit_code_for(signum: int) -> int:
    return STOP_SIGNALS.get(signal.Signals(signum), 128 + int(signum))


def exit_code_of(exc: BaseException) -> int:
    """128 + the signal of an interruption (a plain KeyboardInterrupt is Ctrl-C: 130)."""
    return exc.exit_code if isinstance(exc, Interrupted) else STOP_SIGNALS[signal.SIGINT]


def signal_of(exc: BaseException) -> int:
    return exc.signum if isinstance(exc, Interrupted) else signal.SIGINT


def describe(exc: BaseException) -> str:
    """"interrupted" (Ctrl-C), or "interrupted by SIGTERM" / "by SIGHUP"."""
    signum = signal_of(exc)
    return "interrupted" if signum == signal.SIGINT else f"interrupted by {signal.Signals(signum).name}"


def ignored(sig: int) -> bool:
    """Whether `sig` is ignored in this process (inherited from whoever started it, e.g. nohup)."""
    return signal.getsignal(sig) is signal.SIG_IGN


def catch(handler: Callable[[int, Any], Any]) -> dict[int, Any]:
    """Install `handler` for every stop signal that is not ignored (main thread only); returns
    the handlers it replaced, for `restore`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS if not ignored(sig)}


def restore(previous: dict[int, Any], ignore: bool = False) -> None:
    """Put the replaced handlers back; `ignore` (on the way out after an interruption): ignore further
        stop signals so nothing cuts the exit short."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_IGN if ignore else handler)


def ignore_all() -> None:
    """Ignore every stop signal from now on (the process is exiting after an interruption)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _raise_once() -> Callable[[int, Any], None]:
    fired: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    return handler


def raise_on_stop_signals() -> None:
    """From now on the first stop signal raises `Interrupted` in the main thread (the
    command's entry point turns it into one line and 128 + signal)."""
    catch(_raise_once())


def exit_on_stop_signals(prog: str = "dsv4-lab") -> None:
    """While the command line loads, a stop signal ends the process at once with one line (nothing
        has been written yet)."""

    def handler(signum: int, frame: Any) -> None:
        os.write(2, f"{prog}: interrupted\n".encode())
        os._exit(exit_code_for(signum))

    catch(handler)


class StopGuard:
    """A stop signal during a piece of work: the first raises `Interrupted` (while `armed`), each is
        noted in `signum`; `quiet()` before the clean-up; `release()` restores the handlers."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = True
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopGuard":
        self._previous = catch(self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if self.armed:
            self.armed = False
            raise Interrupted(signum)

    def quiet(self) -> None:
        self.armed = False

    def release(self) -> None:
        restore(self._previous, ignore=self.signum is not None)
        self._previous = {}


@contextmanager
def block_hangup_while() -> Iterator[None]:
    """SIGHUP blocked in this thread while the body runs (a process started meanwhile inherits the
        block; a SIGHUP that arrives is delivered when the body ends)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker deaf to SIGHUP, so it outlives a process-group hang-up
        long enough for the lab to stop its pools."""
    from multiprocessing import resource_tracker

    with block_hangup_while():
        resource_tracker.ensure_running()
