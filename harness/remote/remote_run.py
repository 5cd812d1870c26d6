"""`dsv4-lab run ... --target NAME[,NAME...]`: the local side of a remote run.

For each target (i of n gets `--shard i/n`): copy the working tree (treecopy.py), start `python
-m harness.remote.remote_side run ... --emit-jsonl` there over ssh with a fresh channel key on
its stdin (channel.py), and read its stdout.  A line becomes a record only when it is an
authentic frame of that run's channel, parses as a record, belongs to the announced run, names a
(stage, arch, case) planned for that target, and repeats no case; anything else is counted as
rejected and reported.  Records are written (tagged with the target) as they arrive."""

from __future__ import annotations

import json
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from rich.markup import escape

from harness.remote.channel import FRAME_OVERHEAD, Receiver, new_key
from harness.core.console import make_console, printable
from harness.notebook.recordview import case_line
from harness.spec.matrix import Case
from harness.core.jsonl import MAX_LINE_BYTES
from harness.notebook.records import Record, RecordWriter, RunLog, runs_file, stage_file, status_counts, validate
from harness.execution.report import results_table, summary_lines
from harness.spec.spec import Spec, Stage
from harness.notebook.staged import Snapshot
from harness.remote.ssh import EXIT_LINK, LinkError, explain_ssh_failure, remote_path, ssh_argv, ssh_binary, \
    ssh_config_args, ssh_own_lines
from harness.core.statuses import FAILING
from harness.remote.targets import Target, TargetError, resolve_targets
from harness.remote.treecopy import SyncResult, remote_cache, remote_folder, sync_tree, tree_files

STDERR_TAIL_LINES = 20
LINE_LIMIT = MAX_LINE_BYTES + FRAME_OVERHEAD
_RUN_ID = re.compile(r"^[0-9A-Za-z][0-9A-Za-z_-]{0,63}$")


# ---------------------------------------------------------------------------------------
# The remote command.


def _drop_option(argv: list[str], name: str, takes_value: bool) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == name:
            skip = takes_value
            continue
        if takes_value and a.startswith(name + "="):
            continue
        out.append(a)
    return out


def _has_option(argv: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in argv)


def remote_run_args(argv: list[str], t: Target, shard: tuple[int, int] | None) -> list[str]:
    """The remote `cli` arguments: this run's, minus --target, plus --emit-jsonl, the shard
    when split, and the target's GPUs unless --gpus was given."""
    args = list(argv) if argv and argv[0] == "run" else ["run", *argv]
    args = _drop_option(args, "--target", True)
    args = _drop_option(args, "--emit-jsonl", False)
    args = [a for a in args if a != "--traceback"]
    if shard is not None:
        args = _drop_option(args, "--shard", True) + ["--shard", f"{shard[0]}/{shard[1]}"]
    if t.gpus and not _has_option(args, "--gpus"):
        args += ["--gpus", ",".join(map(str, t.gpus))]
    return args + ["--emit-jsonl"]


def git_token(root: Path) -> str:
    """`<sha>:<0|1>` for DSV4_LAB_GIT: the remote copy has no .git of its own."""
    from harness.spec.identity import git_state

    state = git_state(root)
    return f"{state['commit'] or ''}:{1 if state['dirty'] else 0}"


def remote_run_command(t: Target, root: Path, args: list[str]) -> str:
    """The remote shell text of a run: `export` so the variables reach python even when `python` is
        an activation command; the channel key goes on stdin, never on a command line."""
    folder, cache = remote_path(remote_folder(t, root)), remote_path(remote_cache(t, root))
    env = [
        f"DSV4_LAB_GIT={shlex.quote(git_token(root))}", f"DSV4_LAB_ROOT={folder}", f"PYTHONPATH={folder}",
        f"DSV4_LAB_CACHE={cache}", f"PYTHONPYCACHEPREFIX={cache}/pycache", "PYTHONUNBUFFERED=1",
    ]
    run = f"{t.python} -m harness.remote.remote_side {' '.join(shlex.quote(a) for a in args)}"
    # `; exit $?` keeps the shell alive above python, so a killed run reports 128+signal, not ssh's 255.
    return f"cd {folder} && export {' '.join(env)} && {run}; exit $?"


# ---------------------------------------------------------------------------------------
# Reading and checking what arrives.


def read_lines(stream: IO[bytes], limit: int) -> Iterator[tuple[bytes | None, str | None]]:
    """(line, None) per line of at most `limit` bytes, or (None, why) for a longer one (skipped unheld)
        or one cut off by the stream's end."""
    while True:
        chunk = stream.readline(limit + 1)
        if not chunk:
            return
        if chunk.endswith(b"\n"):
            yield chunk.rstrip(b"\r\n"), None
        elif len(chunk) > limit:
            while chunk and not chunk.endswith(b"\n"):
                chunk = stream.readline(1 << 16)
            yield None, f"line longer than {limit} bytes"
        else:
            yield None, "incomplete last line (the stream ended mid-line)"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def parse_payload(raw: bytes, stages: set[str]) -> tuple[str, Any]:
    """("record", dict) | ("event", dict) | ("reject", why) for one authentic payload."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "reject", "not UTF-8"
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        return "reject", f"not JSON ({printable((str(exc).splitlines() or [''])[0], 80)})"
    if isinstance(obj, dict) and "event" in obj:
        if obj.get("event") in ("start", "end") and isinstance(obj.get("run"), str):
            return "event", obj
        return "reject", f"unknown control event {printable(str(obj.get('event')), 40)!r}"
    why = validate(obj, strict=True)  # the remote channel's strictness: records.validate
    if why:
        return "reject", printable(why, 120)
    if obj["stage"] not in stages:
        return "reject", f"unknown stage {printable(obj['stage'], 40)!r}"
    return "record", obj


def case_key(stage: str, arch: str, case: dict[str, Any]) -> tuple[str, str, str]:
    """What identifies one planned case: the same on both sides whatever the key order."""
    return stage, arch, json.dumps(case, sort_keys=True)


def planned_keys(stages: list[Stage], archs: list[str] | None, cases: dict[str, list[Case]],
                 shard: tuple[int, int] | None) -> list[tuple[str, str, str]]:
    """The cases a target runs: the remote's own task list (runner.tasks_for), cut to its shard."""
    from harness.execution.runner import tasks_for

    tasks = tasks_for(stages, archs, lambda st: cases[st.id])
    if shard is not None:
        tasks = tasks[shard[0]::shard[1]]
    return [case_key(t.stage.id, t.arch, t.case.dict) for t in tasks]


@dataclass
class TargetRun:
    """What one target's run has produced so far."""

    target: Target
    shard: tuple[int, int] | None
    plan: set[tuple[str, str, str]] = field(default_factory=set)
    key: str = field(default_factory=new_key, repr=False)
    run_id: str | None = None
    cases: int | None = None  # what the remote announced
    end: dict | None = None
    records: list[Record] = field(default_factory=list)
    seen: set[tuple[str, str, str]] = field(default_factory=set)
    rejected: int = 0
    first_reject: str | None = None
    lines: int = 0
    rc: int | None = None
    link_error: str | None = None  # could not connect or copy: the run never started
    lost: str | None = None  # the run started but did not finish
    stderr_tail: list[str] = field(default_factory=list)
    synced: SyncResult | None = None
    end_written: bool = False

    def counts(self) -> dict[str, int]:
        return status_counts(self.records)

    @property
    def missing(self) -> int:
        return len(self.plan - self.seen)

    @property
    def exit_code(self) -> int:
        """3: never connected, link lost or run interrupted; else the remote's own code, at
        least 1 when lines were rejected or planned cases never arrived."""
        if self.link_error or self.end is None or self.end.get("interrupted"):
            return EXIT_LINK
        rc = self.rc or 0
        if rc not in (0, 1):  # e.g. the link closed just after the end event: judge by the records
            rc = 1 if any(r.status in FAILING for r in self.records) else 0
        return max(rc, 1) if (self.rejected or self.missing) else rc


def _drain(stream: IO[bytes], tail: deque) -> None:
    """Keep the last lines of a stream (each cut at 8 KiB) so a failure can show them."""
    for line in iter(lambda: stream.readline(8192), b""):
        tail.append(printable(line.decode("utf-8", "replace").rstrip(), 500))


def _drive(tr: TargetRun, root: Path, args: list[str], stages: set[str], out: queue.Queue,
           procs: list, sync_method: str | None, snapshot: Snapshot | None = None) -> None:
    """One target: sync, run, and put what arrives on `out` (thread body)."""
    t = tr.target
    try:
        tree = (snapshot.folder, list(snapshot.files)) if snapshot is not None else None
        synced = sync_tree(t, root, sync_method, tree)
        out.put(("synced", t.name, synced))
        # Its own session: a Ctrl-C in the terminal reaches the lab, not ssh (which would drop the link
        # and exit 255); the lab stops the remote run itself by ending ssh (_stop).
        proc = subprocess.Popen(ssh_argv(t, remote_run_command(t, root, args)), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        procs.append(proc)
        assert proc.stdin is not None and proc.stdout is not None
        try:  # the key, then stdin stays open: its end tells the remote side to stop (channel.py)
            proc.stdin.write(tr.key.encode() + b"\n")
            proc.stdin.flush()
        except OSError:  # ssh already gone: its exit code says why
            pass
        tail: deque = deque(maxlen=200)
        drain = threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True)
        drain.start()
        receiver = Receiver(tr.key)
        for raw, why in read_lines(proc.stdout, LINE_LIMIT):
            if raw is None:
                out.put(("line", t.name, ("reject", why)))
            elif not raw.strip():
                continue
            else:
                payload, why = receiver.open(raw)
                out.put(("line", t.name, parse_payload(payload, stages) if payload is not None else ("reject", why)))
        rc = proc.wait()
        try:
            proc.stdin.close()
        except OSError:
            pass
        drain.join(10)
        out.put(("done", t.name, (rc, list(tail))))
    except (LinkError, TargetError) as exc:
        out.put(("failed", t.name, str(exc)))
    except Exception as exc:  # never let a thread die silently
        out.put(("failed", t.name, f"{t.name}: {type(exc).__name__}: {printable(str(exc), 300)}"))


def _say(text: str) -> None:
    """One problem line on stderr, never wrapped (after what stdout holds so far)."""
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)


def _signal_text(rc: int) -> str:
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    try:
        return f", {signal.Signals(sig).name}" if sig else ""
    except ValueError:
        return ""


class LocalWriteError(Exception):
    """This side cannot write what arrived (records or runs.jsonl)."""


class _Session:
    """The local side of a (possibly split) remote run: writes what arrives, says what happened."""

    def __init__(self, spec: Spec, runs: list[TargetRun], argv: list[str]):
        self.spec = spec
        self.root: Path = spec.root
        self.runs = {r.target.name: r for r in runs}
        self.argv = argv
        self.writer = RecordWriter(self.root)  # one for every target's run (RunLog: each run's events)
        self.logs: dict[str, RunLog] = {}
        self.console = make_console()
        self.written: set[str] = set()

    def _event(self, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as exc:
            raise LocalWriteError(f"cannot write {runs_file(self.root)}: {exc.strerror or exc}") from None

    def _start(self, tr: TargetRun, run_id: str, cases: Any) -> None:
        tr.run_id = run_id
        tr.cases = cases if isinstance(cases, int) and not isinstance(cases, bool) else None
        log = self.logs[tr.target.name] = RunLog(self.root, run_id, self.writer)  # the remote's run id, here
        log.plan(target=tr.target.name, argv=self.argv, cases=len(tr.plan),
                 **({"shard": f"{tr.shard[0]}/{tr.shard[1]}"} if tr.shard else {}))
        self._event(log.start)

    def finish(self, tr: TargetRun, interrupted: bool, lost: str | None = None) -> None:
        log = self.logs.get(tr.target.name)
        if tr.run_id is None or tr.end_written or log is None:
            return
        tr.end_written = True
        self._event(lambda: log.end(interrupted, target=tr.target.name, planned=len(tr.plan), counts=tr.counts(),
                                    **({"rejected": tr.rejected} if tr.rejected else {}),
                                    **({"lost": lost} if lost else {})))

    def reject(self, tr: TargetRun, why: str) -> None:
        tr.rejected += 1
        if tr.first_reject is None:
            tr.first_reject = f"line {tr.lines}: {why}"

    def on_line(self, tr: TargetRun, kind: str, payload: Any) -> None:
        tr.lines += 1
        if kind == "reject":
            self.reject(tr, payload)
        elif kind == "event":
            self._on_event(tr, payload)
        else:
            self._on_record(tr, payload)

    def _on_event(self, tr: TargetRun, ev: dict) -> None:
        run = ev["run"]
        if ev["event"] == "start":
            if tr.run_id is not None:
                self.reject(tr, "a second start event")
            elif not _RUN_ID.fullmatch(run):
                self.reject(tr, f"start event with a malformed run id {printable(run, 40)!r}")
            else:
                self._start(tr, run, ev.get("cases"))
            return
        if tr.run_id is None or run != tr.run_id:
            self.reject(tr, f"end event of another run ({printable(run, 40)!r})")
        elif tr.end is not None:
            self.reject(tr, "a second end event")
        else:
            tr.end = {"interrupted": ev.get("interrupted") is True,
                      "errors": [printable(str(e), 300) for e in ev.get("errors") or [] if isinstance(e, str)][:5]
                      if isinstance(ev.get("errors"), list) else [],
                      # what the remote command said last (the speed gate's verdict lines), each line cut
                      "lines": [printable(str(e), 500) for e in ev.get("lines") or [] if isinstance(e, str)][:200]
                      if isinstance(ev.get("lines"), list) else []}
            self.finish(tr, tr.end["interrupted"])

    def _on_record(self, tr: TargetRun, obj: dict) -> None:
        rec = Record.from_dict(obj)
        key = case_key(rec.stage, rec.arch, rec.case)
        if tr.run_id is None:
            return self.reject(tr, "a record before the run's start event")
        if tr.end is not None:
            return self.reject(tr, "a record after the run's end event")
        if rec.run != tr.run_id:
            return self.reject(tr, f"a record of another run ({printable(rec.run, 40)!r})")
        if not re.fullmatch(re.escape(tr.run_id) + r"\.\d{1,9}", rec.id):
            return self.reject(tr, f"a record id that is not RUN.N ({printable(rec.id, 60)!r})")
        if key not in tr.plan:
            return self.reject(tr, f"a record of a case not planned for {tr.target.name} "
                                   f"({printable(rec.stage, 40)} {printable(rec.arch, 20)} "
                                   f"{printable(json.dumps(rec.case), 80)})")
        if key in tr.seen:
            return self.reject(tr, f"a second record of {printable(rec.stage, 40)} {printable(rec.arch, 20)} "
                                   f"{printable(json.dumps(rec.case), 80)}")
        rec.target = tr.target.name
        try:
            rec.to_json()
        except (TypeError, ValueError) as exc:
            return self.reject(tr, f"cannot be written ({printable(str(exc), 80)})")
        try:
            self.writer.write(rec)
        except OSError as exc:
            raise LocalWriteError(f"cannot write {stage_file(self.root, rec.stage)}: {exc.strerror or exc}") from None
        self.written.add(rec.stage)
        tr.seen.add(key)
        tr.records.append(rec)
        self.console.print(f"[dim]{escape(tr.target.name)}[/]  " + case_line(rec), highlight=False)

    def on_done(self, tr: TargetRun, rc: int, tail: list[str]) -> None:
        tr.rc = rc
        tr.stderr_tail = tail[-STDERR_TAIL_LINES:]
        if tr.end is not None:
            return
        own = ssh_own_lines(tail)
        if rc == 255 and own:
            lost = explain_ssh_failure(tr.target, "\n".join(own))
        elif rc == 255:
            lost = f"{tr.target.name}: the link dropped or the remote run was killed (ssh exit 255)"
        else:
            lost = f"{tr.target.name}: the remote run ended without finishing (exit code {rc}{_signal_text(rc)})"
        tr.lost = lost
        self.finish(tr, True, lost)

    def report(self, interrupted: bool, local_error: str | None) -> None:
        records = [r for tr in self.runs.values() for r in tr.records]
        if records:
            self.console.print(results_table(records))
            cut = any(tr.run_id and (tr.end is None or tr.end.get("interrupted")) for tr in self.runs.values())
            for line in summary_lines(records, cut, {}):
                self.console.print(line, highlight=False, markup=False)
        for tr in self.runs.values():
            name = tr.target.name
            if tr.rejected:
                _say(f"{name}: rejected {tr.rejected} line(s) from the remote, none written "
                     f"(first: {tr.first_reject})")
            if tr.link_error:
                _say(tr.link_error)
            elif tr.end is None and tr.run_id is None and interrupted:  # stopped here: not python's fault
                _say(f"{name}: interrupted here before the run started — nothing was recorded")
            elif tr.end is None and tr.run_id is None:
                _say(f"{tr.lost or name + ': interrupted here'} before the run started — nothing was recorded; "
                     f"check `python` at {tr.target.declared} (dsv4-lab targets check {name} tells more)")
            elif tr.end is None:
                lost = tr.lost or f"{name}: interrupted here"
                _say(f"{lost} — {len(tr.records)} record(s) received are kept; the run is marked interrupted")
            elif not tr.end.get("interrupted") and tr.missing:
                _say(f"{name}: {tr.missing} of {len(tr.plan)} planned case(s) never arrived — nothing is proven "
                     "about them")
            for err in (tr.end or {}).get("errors", []):
                _say(f"{name}: the remote run failed: {err}")
            if tr.exit_code != 0 and tr.stderr_tail:
                _say(f"{name}: remote stderr (last {len(tr.stderr_tail)} lines):")
                for ln in tr.stderr_tail:
                    _say(f"  {ln}")
            run = f"run {tr.run_id}" if tr.run_id else "no run"
            self.console.print(f"{name}: {run}, {len(tr.records)} record(s), exit {tr.exit_code}", highlight=False,
                               markup=False)
        if local_error:
            _say(f"{local_error} — the remote runs were stopped; records written so far are kept")
        if interrupted:
            _say("interrupted here: every record received is kept")
        files = [str(stage_file(self.root, s).relative_to(self.root)) for s in sorted(self.written)]
        self.console.print(f"records: {', '.join(files) if files else 'none written'}", highlight=False,
                           markup=False)

    def close(self) -> None:
        self.writer.close()


def run_remote(spec: Spec, target: str, argv: list[str], stages: list[Stage], archs: list[str] | None,
               cases: dict[str, list[Case]], *, shard: tuple[int, int] | None = None,
               sync_method: str | None = None, snapshot: Snapshot | None = None) -> int:
    """Copy the tree to each target, run there (one target keeps the user's `shard`), stream and
        write the records here.  Returns 0 (all passed), 1 (failures, rejected lines, missing
        cases, unwritable records), 3 (a target unreachable, a run lost or interrupted), 130 / 143 /
        129 (a stop signal here: the remote runs stopped, what arrived kept, runs marked
        interrupted).  Bad targets or options: TargetError.  `snapshot` (the gate's index export):
        its files travel instead of the working tree."""
    root: Path = snapshot.lab if snapshot is not None else spec.root
    targets = resolve_targets(root, target)
    n = len(targets)
    if n > 1 and (shard is not None or _has_option(argv, "--shard")):
        raise TargetError("--shard cannot be combined with --target a,b — the lab shards split runs itself")
    ssh_binary()
    ssh_config_args()
    if snapshot is None:
        tree_files(root)  # not a git tree: say so before connecting anywhere
    runs = []
    for i, t in enumerate(targets):
        own = (i, n) if n > 1 else None
        runs.append(TargetRun(t, own, set(planned_keys(stages, archs, cases, own or shard))))
    session = _Session(spec, runs, list(argv))
    total = sum(len(c) for c in cases.values())
    where = ", ".join(t.name + (f" (shard {i}/{n})" if n > 1 else "") for i, t in enumerate(targets))
    session.console.print(f"[bold]run on {escape(where)}[/]: {total} case(s) per arch — "
                          + escape(", ".join(f"{st.name} ({len(cases[st.id])})" for st in stages)), highlight=False)

    interrupted, signum, local_error = stream_runs(
        session, {tr.target.name: remote_run_args(argv, tr.target, tr.shard) for tr in runs}, sync_method, snapshot)
    session.report(interrupted, local_error)
    if interrupted:
        return 128 + signum
    if local_error:
        return 1
    codes = [tr.exit_code for tr in runs]
    return EXIT_LINK if EXIT_LINK in codes else max(codes)


def stream_runs(session: _Session, args: dict[str, list[str]], sync_method: str | None = None,
                snapshot: Snapshot | None = None) -> tuple[bool, int, str | None]:
    """Copy the tree to each target, start `remote_side ARGS[name]` there, write what arrives until
        every run ended; a stop signal here stops the remote runs (marked interrupted).  Returns
        (interrupted, the signal, a local write error or None)."""
    runs = list(session.runs.values())
    root = snapshot.lab if snapshot is not None else session.root
    events: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    known = set(session.spec.stages)
    for tr in runs:
        threading.Thread(target=_drive, args=(tr, root, args[tr.target.name], known, events, procs, sync_method,
                                              snapshot), daemon=True).start()
    pending, interrupted, local_error, signum = len(runs), False, None, signal.SIGINT
    stop: list[int] = []
    previous = _catch_stop_signals(stop)
    try:
        while pending:
            if stop:  # checked between lines, so a signal never cuts a record's write short
                raise _Stopped(stop[0])
            try:
                kind, name, payload = events.get(timeout=0.5)
            except queue.Empty:
                continue
            if stop and kind in ("done", "failed"):  # a link that ended after the stop signal: the signal's doing
                raise _Stopped(stop[0])
            tr = session.runs[name]
            if kind == "line":
                session.on_line(tr, *payload)
            elif kind == "synced":
                tr.synced = payload
                how = payload.method + (f" ({payload.why})" if payload.why else "")
                session.console.print(f"[dim]{escape(name)}[/]  copied {payload.files} file(s) by "
                                      f"{escape(how)} to {escape(printable(payload.folder))}", highlight=False)
            elif kind == "done":
                session.on_done(tr, *payload)
                pending -= 1
            elif kind == "failed":
                tr.link_error = payload
                session.finish(tr, True, payload)
                pending -= 1
        if stop:  # a signal after the last event: the run was still interrupted
            raise _Stopped(stop[0])
    except (KeyboardInterrupt, _Stopped) as exc:  # KeyboardInterrupt: when not in the main thread
        interrupted = True
        signum = exc.signum if isinstance(exc, _Stopped) else signal.SIGINT
        _stop(procs)
        why = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        for tr in runs:
            _finish_quietly(session, tr, f"interrupted here ({why})")
    except LocalWriteError as exc:
        local_error = str(exc)
        _stop(procs)
        for tr in runs:
            _finish_quietly(session, tr, local_error)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        session.close()
    return interrupted, signum, local_error


class _Stopped(Exception):
    """Ctrl-C, SIGTERM or SIGHUP here: stop the remote runs, keep what arrived."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _catch_stop_signals(stop: list[int]) -> dict:
    """While a remote run lasts, the first stop signal is noted in `stop` for the main loop.  Returns
        the handlers to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def note(signum: int, frame: Any) -> None:
        if not stop:
            stop.append(signum)

    # a signal the lab was started with ignored (nohup: SIGHUP) stays ignored
    return {sig: signal.signal(sig, note) for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()


def _finish_quietly(session: _Session, tr: TargetRun, why: str) -> None:
    try:
        session.finish(tr, True, why)
    except LocalWriteError:
        pass
