"""Running on an SSH target, and `dsv4-lab targets check`.

A remote run copies the working tree (exactly what git would commit) to
`<workdir>/<lab-id>/` on the target, runs the same `cli run` there with `--emit-jsonl`, and
reads its stdout line by line: every line is bounded, parsed and validated before it is
written here (tagged with the target's name) through the same RecordWriter as a local run.

Only the system OpenSSH client is used, always as an argv list (never a local shell), with
BatchMode=yes and host-key checking left as the user's ssh has it (the lab never turns it
off). Every remote argument is quoted with shlex.quote; the one unquoted remote text is the
target's own `python` command, written by the user. Nothing is written on the remote outside
its work folder; nothing runs with sudo. `DSV4_LAB_SSH_CONFIG` names an ssh config file to
use instead of ~/.ssh/config (`ssh -F`).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

from harness.records import MAX_LINE_BYTES, Record, RecordWriter, append_event, now_iso, runs_file, status_counts, validate
from harness.targets import Target, TargetError, resolve_targets

SSH_CONFIG_ENV = "DSV4_LAB_SSH_CONFIG"
EXIT_LINK = 3  # a target could not be reached, or the link / remote run was lost
DEFAULT_CONNECT_TIMEOUT = 10
SERVER_ALIVE = ("ServerAliveInterval=15", "ServerAliveCountMax=4")  # a dead link shows in ~60 s
STDERR_TAIL_LINES = 20
MARK = "@@dsv4"  # prefix of the lines our remote probes print (login banners are ignored)


class LinkError(Exception):
    """ssh could not reach or use a target; the text is one line, already explained."""


# ---------------------------------------------------------------------------------------
# ssh plumbing.


def ssh_binary() -> str:
    path = shutil.which("ssh")
    if path is None:
        raise TargetError("ssh: the OpenSSH client is not installed here — install openssh-client")
    return path


def ssh_config_args() -> list[str]:
    """`-F FILE` when DSV4_LAB_SSH_CONFIG names an ssh config file, else nothing."""
    cfg = os.path.expanduser(os.environ.get(SSH_CONFIG_ENV, ""))
    if not cfg:
        return []
    if not Path(cfg).is_file():
        raise TargetError(f"{SSH_CONFIG_ENV}={cfg}: no such file — point it at an ssh config file or unset it")
    return ["-F", cfg]


def ssh_base_argv(t: Target) -> list[str]:
    """ssh and its options for target `t` (no destination). The target's own options come
    first: for ssh the first value of an option wins."""
    argv = [ssh_binary(), *ssh_config_args()]
    for k, v in t.ssh_options:
        argv += ["-o", f"{k}={v}"]
    argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={DEFAULT_CONNECT_TIMEOUT}"]
    for opt in SERVER_ALIVE:
        argv += ["-o", opt]
    if t.port is not None:
        argv += ["-p", str(t.port)]
    return argv


def ssh_argv(t: Target, remote_command: str) -> list[str]:
    """The full argv that runs `remote_command` (already quoted) on target `t`."""
    return [*ssh_base_argv(t), "--", t.ssh, remote_command]


def remote_path(path: str) -> str:
    """A remote path as shell text: quoted, with a leading ~ kept as "$HOME"."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


def lab_id(root: Path) -> str:
    """A stable id of this checkout (user, host and path): the remote folder's name."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    who = f"{user}@{socket.gethostname()}:{Path(root).resolve()}"
    return "dsv4-lab-" + hashlib.sha256(who.encode()).hexdigest()[:12]


def remote_folder(t: Target, root: Path) -> str:
    """`<workdir>/<lab-id>`: where the working tree is copied and the run happens."""
    return f"{t.workdir.rstrip('/')}/{lab_id(root)}"


def remote_cache(t: Target, root: Path) -> str:
    """`<workdir>/<lab-id>.cache`: the remote compile and bytecode cache (kept across syncs)."""
    return remote_folder(t, root) + ".cache"


def explain_ssh_failure(t: Target, stderr: str) -> str:
    """ssh's stderr as one line that says what to do."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("@")]
    last = lines[-1] if lines else "no message from ssh"
    where = t.where
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in stderr or "has changed and you have requested strict" in stderr:
        return (f"{t.name}: host key mismatch for {where}: the server's key is not the one in your known_hosts. "
                "Check known_hosts: if the server was really reinstalled, verify its new fingerprint with its "
                "admin, remove the old entry (ssh-keygen -R HOST) and connect once with ssh. "
                "Never disable host-key checking.")
    if re.search(r"No \S+ host key is known for", stderr) or "Host key verification failed" in stderr:
        return (f"{t.name}: host key of {where} is not in your known_hosts (host key verification failed). "
                "Check known_hosts: connect once with ssh, verify the fingerprint, and accept it. "
                "Never disable host-key checking.")
    if "Permission denied" in stderr or "Too many authentication failures" in stderr:
        return (f"{t.name}: authentication failed for {where} ({last}). The lab uses your ssh keys and "
                "ssh-agent, never passwords: ssh-add your key, or install it with ssh-copy-id.")
    unreachable = ("Connection refused", "timed out", "Could not resolve hostname", "No route to host",
                   "Network is unreachable", "Connection closed", "Connection reset", "kex_exchange_identification",
                   "Name or service not known")
    if any(u in stderr for u in unreachable):
        return f"{t.name}: cannot reach {where}: {last}"
    return f"{t.name}: ssh to {where} failed: {last}"


_SSH_OWN = re.compile(
    r"^(ssh: |client_loop: |Connection to \S+ closed|Timeout, server \S+ not responding|packet_write_wait|"
    r"Read from remote host|Write failed|kex_exchange_identification|Host key verification failed|"
    r"\S+: Permission denied \()"
)


def ssh_own_lines(lines: list[str]) -> list[str]:
    """The lines of a session's stderr that ssh itself wrote (not the remote command)."""
    return [ln for ln in lines if _SSH_OWN.match(ln.strip())]


def _run_ssh(t: Target, remote_command: str, timeout: float) -> subprocess.CompletedProcess:
    """Run one short remote command; raises LinkError when ssh itself fails (exit 255)."""
    try:
        out = subprocess.run(ssh_argv(t, remote_command), stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        raise LinkError(f"{t.name}: no answer from {t.where} within {timeout:.0f} s")
    if out.returncode == 255:
        raise LinkError(explain_ssh_failure(t, out.stderr.decode("utf-8", "replace")))
    return out


def _marked(stdout: bytes) -> list[tuple[str, str]]:
    """(key, rest) of every `@@dsv4 key rest` line."""
    out = []
    for line in stdout.decode("utf-8", "replace").splitlines():
        if line.startswith(MARK + " "):
            key, _, rest = line[len(MARK) + 1:].partition(" ")
            out.append((key, rest.strip()))
    return out


# ---------------------------------------------------------------------------------------
# Copying the working tree.


def tree_files(root: Path) -> list[str]:
    """Exactly what git would commit: tracked plus untracked-not-ignored files that exist."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TargetError(f"{root}: git ls-files failed ({exc}) — a remote run copies what git would commit")
    if out.returncode != 0:
        why = out.stderr.decode("utf-8", "replace").strip().splitlines()
        raise TargetError(f"{root}: not a git working tree ({why[0] if why else 'git failed'}) — "
                          "a remote run copies exactly what git would commit; run git init")
    names = sorted({n for n in out.stdout.decode("utf-8", "surrogateescape").split("\0") if n})
    return [n for n in names if (root / n).is_symlink() or (root / n).is_file()]


def _stage_tree(root: Path, files: list[str], dest: Path) -> None:
    """Hard-link (or copy) `files` into `dest`, so rsync --delete can mirror that folder."""
    for rel in files:
        src, dst = root / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
            continue
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)


@dataclass
class SyncResult:
    method: str
    files: int
    folder: str


def probe_remote(t: Target, root: Path) -> bool:
    """Create the work folder (and its cache) on the remote; True when it has rsync."""
    folder, cache = remote_path(remote_folder(t, root)), remote_path(remote_cache(t, root))
    cmd = (f"mkdir -p {folder} {cache} && test -w {folder} && "
           f"{{ if command -v rsync >/dev/null 2>&1; then echo '{MARK} rsync yes'; "
           f"else echo '{MARK} rsync no'; fi; }}")
    out = _run_ssh(t, cmd, timeout=DEFAULT_CONNECT_TIMEOUT + 60)
    if out.returncode != 0:
        err = out.stderr.decode("utf-8", "replace").strip().splitlines()
        raise LinkError(f"{t.name}: cannot create or write the work folder {remote_folder(t, root)} "
                        f"({err[-1] if err else f'exit code {out.returncode}'}) — fix workdir in {t.declared}")
    return ("rsync", "yes") in _marked(out.stdout)


class _RsyncFailed(LinkError):
    """rsync itself failed (not the ssh link): worth trying tar instead."""


def _sync_rsync(t: Target, root: Path, files: list[str]) -> None:
    """Stage `files` in a temporary folder and mirror it with `rsync --delete` over ssh; the
    remote side cds into the (quoted) work folder first, so no path goes through rsync's own
    argument splitting."""
    with tempfile.TemporaryDirectory(prefix="dsv4-lab-sync-") as tmp:
        stage = Path(tmp) / "tree"
        stage.mkdir()
        _stage_tree(root, files, stage)
        shell = " ".join(shlex.quote(a) for a in ssh_base_argv(t))
        argv = ["rsync", "-rlpt", "--delete", "-e", shell,
                "--rsync-path", f"cd {remote_path(remote_folder(t, root))} && rsync",
                f"{stage}/", f"{t.ssh}:."]
        try:
            out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=1800)
        except subprocess.TimeoutExpired:
            raise LinkError(f"{t.name}: copying the working tree took over 30 minutes — check the link")
    if out.returncode != 0:
        err = out.stderr.decode("utf-8", "replace")
        if out.returncode == 255 or ("ssh" in err.lower() and "connection" in err.lower()):
            raise LinkError(explain_ssh_failure(t, err))
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        raise _RsyncFailed(f"{t.name}: rsync failed (exit {out.returncode}): {lines[0] if lines else 'no message'}")


def _sync_tar(t: Target, root: Path, files: list[str]) -> None:
    """Stream a tar of `files` into a fresh folder, then swap it in place of the old one."""
    folder = remote_folder(t, root)
    new, cur = remote_path(folder + ".incoming"), remote_path(folder)
    cmd = f"rm -rf {new} && mkdir -p {new} && tar -xf - -C {new} && rm -rf {cur} && mv {new} {cur}"

    def anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(ssh_argv(t, cmd), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
        assert proc.stdin is not None
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                for rel in files:
                    tf.add(root / rel, arcname=rel, recursive=False, filter=anonymous)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass
        rc = proc.wait()
        err.seek(0)
        text = err.read().decode("utf-8", "replace")
    if rc == 255:
        raise LinkError(explain_ssh_failure(t, text))
    if rc != 0:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        raise LinkError(f"{t.name}: copying with tar failed (exit {rc}): {lines[-1] if lines else 'no message'}")


def sync_tree(t: Target, root: Path, method: str | None = None) -> SyncResult:
    """Mirror the working tree into `<workdir>/<lab-id>/` on `t` (stale files there removed).
    rsync over ssh when both sides have it, else tar over ssh. Raises LinkError."""
    files = tree_files(root)
    has_rsync = probe_remote(t, root)
    if method is not None:
        (_sync_rsync if method == "rsync" else _sync_tar)(t, root, files)
        return SyncResult(method, len(files), remote_folder(t, root))
    if has_rsync and shutil.which("rsync"):
        try:
            _sync_rsync(t, root, files)
            return SyncResult("rsync", len(files), remote_folder(t, root))
        except _RsyncFailed:
            pass  # e.g. a login shell that prints to stdout breaks rsync's protocol: tar says why, if it fails too
    _sync_tar(t, root, files)
    return SyncResult("tar", len(files), remote_folder(t, root))


# ---------------------------------------------------------------------------------------
# The remote run.


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
    if shard is not None:
        args = _drop_option(args, "--shard", True) + ["--shard", f"{shard[0]}/{shard[1]}"]
    if t.gpus and not _has_option(args, "--gpus"):
        args += ["--gpus", ",".join(map(str, t.gpus))]
    return args + ["--emit-jsonl"]


def git_token(root: Path) -> str:
    """`<sha>:<0|1>` for DSV4_LAB_GIT: the remote copy has no .git of its own."""
    from harness.identity import git_state

    state = git_state(root)
    return f"{state['commit'] or ''}:{1 if state['dirty'] else 0}"


def remote_run_command(t: Target, root: Path, args: list[str]) -> str:
    """The remote shell text of a run. `export` (not `VAR=x cmd`) so the variables reach
    python even when `python` is an activation command such as `source venv && python`."""
    folder, cache = remote_path(remote_folder(t, root)), remote_path(remote_cache(t, root))
    env = [
        f"DSV4_LAB_GIT={shlex.quote(git_token(root))}", f"DSV4_LAB_ROOT={folder}", f"PYTHONPATH={folder}",
        f"DSV4_LAB_CACHE={cache}", f"PYTHONPYCACHEPREFIX={cache}/pycache", "PYTHONUNBUFFERED=1",
    ]
    run = f"{t.python} -m cli {' '.join(shlex.quote(a) for a in args)}"
    # `; exit $?` keeps the shell alive above python, so a killed run reports 128+signal, not ssh's 255.
    return f"cd {folder} && export {' '.join(env)} && {run}; exit $?"


def read_lines(stream: IO[bytes], limit: int) -> Iterator[tuple[bytes | None, str | None]]:
    """(line, None) per line of at most `limit` bytes, or (None, why) for one that is
    longer (skipped without being held in memory) or cut off by the end of the stream."""
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


_RECORD_SHAPE = {"metrics": dict, "timing": dict, "compile": dict, "env": dict, "code": dict,
                 "error": str, "note": str, "id": str, "run": str, "t": str, "stage": str, "arch": str}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def parse_line(raw: bytes, stages: set[str]) -> tuple[str, Any]:
    """("record", dict) | ("event", dict) | ("reject", why) | ("skip", None) for one line."""

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "reject", "not UTF-8"
    if not text.strip():
        return "skip", None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        return "reject", f"not JSON ({str(exc).splitlines()[0][:80]})"
    if isinstance(obj, dict) and "event" in obj:
        if obj.get("event") in ("start", "end") and isinstance(obj.get("run"), str):
            return "event", obj
        return "reject", f"unknown control event {str(obj.get('event'))[:40]!r}"
    why = validate(obj)
    if why:
        return "reject", why
    for key, typ in _RECORD_SHAPE.items():
        if obj.get(key) is not None and not isinstance(obj[key], typ):
            return "reject", f"{key} is not a {typ.__name__}"
    if any(not isinstance(m, dict) for m in obj.get("metrics", {}).values()):
        return "reject", "metrics must map each output to an object"
    if obj.get("timing") and not isinstance(obj["timing"].get("us"), (int, float)):
        return "reject", "timing without a number in 'us'"
    if obj["stage"] not in stages:
        return "reject", f"unknown stage {obj['stage'][:40]!r}"
    return "record", obj


@dataclass
class TargetRun:
    """What one target's run has produced so far."""

    target: Target
    shard: tuple[int, int] | None
    run_id: str | None = None
    cases: int | None = None
    end: dict | None = None
    records: list[Record] = field(default_factory=list)
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
    def exit_code(self) -> int:
        """3: never connected, link lost or run interrupted; else the remote's own code (at
        least 1 when lines were rejected)."""
        from harness.runner import FAILING

        if self.link_error or self.end is None or self.end.get("interrupted"):
            return EXIT_LINK
        rc = self.rc or 0
        if rc not in (0, 1):  # e.g. the link closed just after the end event: judge by the records
            rc = 1 if any(r.status in FAILING for r in self.records) else 0
        return max(rc, 1) if self.rejected else rc


def _drain(stream: IO[bytes], tail: deque) -> None:
    """Keep the last lines of a stream (each cut at 8 KiB) so a failure can show them."""
    for line in iter(lambda: stream.readline(8192), b""):
        tail.append(line.decode("utf-8", "replace").rstrip())


def _drive(t: Target, root: Path, args: list[str], stages: set[str], out: queue.Queue,
           procs: list, sync_method: str | None) -> None:
    """One target: sync, run, and put what arrives on `out` (thread body)."""

    try:
        synced = sync_tree(t, root, sync_method)
        out.put(("synced", t.name, synced))
        proc = subprocess.Popen(ssh_argv(t, remote_run_command(t, root, args)), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(proc)
        tail: deque = deque(maxlen=200)
        drain = threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True)
        drain.start()
        assert proc.stdout is not None
        for raw, why in read_lines(proc.stdout, MAX_LINE_BYTES):
            out.put(("line", t.name, parse_line(raw, stages) if raw is not None else ("reject", why)))
        rc = proc.wait()
        drain.join(10)
        out.put(("done", t.name, (rc, list(tail))))
    except (LinkError, TargetError) as exc:
        out.put(("failed", t.name, str(exc)))
    except Exception as exc:  # never let a thread die silently
        out.put(("failed", t.name, f"{t.name}: {type(exc).__name__}: {exc}"))


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


class _Session:
    """The local side of a (possibly split) remote run: writes what arrives, says what happened."""

    def __init__(self, spec, runs: list[TargetRun], argv: list[str]):
        from harness.report import make_console

        self.spec = spec
        self.root: Path = spec.root
        self.runs = {r.target.name: r for r in runs}
        self.argv = argv
        self.writer = RecordWriter(self.root)
        self.console = make_console()

    def _event(self, obj: dict) -> None:

        append_event(runs_file(self.root), obj)

    def _start(self, tr: TargetRun, run_id: str, cases: Any) -> None:

        tr.run_id = run_id
        tr.cases = cases if isinstance(cases, int) else None
        ev = {"run": run_id, "t": now_iso(), "event": "start", "target": tr.target.name, "argv": self.argv,
              "cases": tr.cases}
        if tr.shard:
            ev["shard"] = f"{tr.shard[0]}/{tr.shard[1]}"
        self._event(ev)

    def finish(self, tr: TargetRun, interrupted: bool, lost: str | None = None) -> None:

        if tr.run_id is None or tr.end_written:
            return
        ev = {"run": tr.run_id, "t": now_iso(), "event": "end", "target": tr.target.name,
              "interrupted": interrupted, "counts": tr.counts()}
        if tr.rejected:
            ev["rejected"] = tr.rejected
        if lost:
            ev["lost"] = lost
        self._event(ev)
        tr.end_written = True

    def reject(self, tr: TargetRun, why: str) -> None:
        tr.rejected += 1
        if tr.first_reject is None:
            tr.first_reject = f"line {tr.lines}: {why}"

    def on_line(self, tr: TargetRun, kind: str, payload: Any) -> None:
        from harness.report import case_line

        tr.lines += 1
        if kind == "skip":
            return
        if kind == "reject":
            self.reject(tr, payload)
            return
        if kind == "event":
            if payload["event"] == "start" and tr.run_id is None:
                self._start(tr, payload["run"], payload.get("cases"))
            elif payload["event"] == "end":
                tr.end = payload
                self.finish(tr, bool(payload.get("interrupted")))
            return
        rec = Record.from_dict(payload)
        rec.target = tr.target.name
        try:
            rec.to_json()
        except (TypeError, ValueError) as exc:
            self.reject(tr, f"cannot be written ({exc})")
            return
        if tr.run_id is None:
            self._start(tr, rec.run, None)
        self.writer.write(rec)
        tr.records.append(rec)
        self.console.print(f"[dim]{tr.target.name}[/]  " + case_line(rec), highlight=False)

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

    def report(self, interrupted: bool) -> None:
        from harness.report import results_table, summary_lines

        records = [r for tr in self.runs.values() for r in tr.records]
        if records:
            self.console.print(results_table(records))
            cut = any(tr.run_id and (tr.end is None or tr.end.get("interrupted")) for tr in self.runs.values())
            for line in summary_lines(records, cut, {}):
                self.console.print(line, highlight=False)
        for tr in self.runs.values():
            name = tr.target.name
            if tr.rejected:
                _say(f"{name}: rejected {tr.rejected} line(s) from the remote, none written "
                     f"(first: {tr.first_reject})")
            if tr.link_error:
                _say(tr.link_error)
            elif tr.end is None and tr.run_id is None:
                _say(f"{tr.lost or name + ': interrupted here'} before the run started — nothing was recorded; "
                     f"check `python` at {tr.target.declared} (dsv4-lab targets check {name} tells more)")
            elif tr.end is None:
                lost = tr.lost or f"{name}: interrupted here"
                _say(f"{lost} — {len(tr.records)} record(s) received are kept; the run is marked interrupted")
            if tr.exit_code != 0 and tr.stderr_tail:
                _say(f"{name}: remote stderr (last {len(tr.stderr_tail)} lines):")
                for ln in tr.stderr_tail:
                    _say(f"  {ln}")
            run = f"run {tr.run_id}" if tr.run_id else "no run"
            self.console.print(f"{name}: {run}, {len(tr.records)} record(s), exit {tr.exit_code}", highlight=False)
        if interrupted:
            _say("interrupted here: every record received is kept")
        self.console.print("records: results/records/<stage>.jsonl", highlight=False)

    def close(self) -> None:
        self.writer.close()


def run_remote_and_report(spec, target: str, argv: list[str], cases: dict[str, list], *,
                          sync_method: str | None = None) -> int:
    """`dsv4-lab run ... --target NAME[,NAME...]`: copy the tree to each target, run there
    (target i of n gets --shard i/n), stream and write the records here. Returns 0 (all
    passed), 1 (failures, or lines rejected), 3 (a target unreachable, or a run lost or
    interrupted), 130 (Ctrl-C here)."""
    root: Path = spec.root
    targets = resolve_targets(root, target)
    n = len(targets)
    if n > 1 and _has_option(argv, "--shard"):
        raise TargetError("--shard cannot be combined with --target a,b — the lab shards split runs itself")
    ssh_binary()
    ssh_config_args()
    tree_files(root)  # not a git tree: say so before connecting anywhere
    runs = [TargetRun(t, (i, n) if n > 1 else None) for i, t in enumerate(targets)]
    session = _Session(spec, runs, list(argv))
    total = sum(len(c) for c in cases.values())
    where = ", ".join(t.name + (f" (shard {i}/{n})" if n > 1 else "") for i, t in enumerate(targets))
    session.console.print(f"[bold]run on {where}[/]: {total} case(s) per arch — "
                          + ", ".join(f"stage-{sid} ({len(c)})" for sid, c in cases.items()), highlight=False)

    events: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    stages = set(spec.stages)
    for tr in runs:
        args = remote_run_args(argv, tr.target, tr.shard)
        threading.Thread(target=_drive, args=(tr.target, root, args, stages, events, procs, sync_method),
                         daemon=True).start()
    pending, interrupted = n, False
    try:
        while pending:
            try:
                kind, name, payload = events.get(timeout=0.5)
            except queue.Empty:
                continue
            tr = session.runs[name]
            if kind == "line":
                session.on_line(tr, *payload)
            elif kind == "synced":
                tr.synced = payload
                session.console.print(f"[dim]{name}[/]  copied {payload.files} file(s) by {payload.method} "
                                      f"to {payload.folder}", highlight=False)
            elif kind == "done":
                session.on_done(tr, *payload)
                pending -= 1
            elif kind == "failed":
                tr.link_error = payload
                session.finish(tr, True, payload)
                pending -= 1
    except KeyboardInterrupt:
        interrupted = True
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for tr in runs:
            session.finish(tr, True, "interrupted here (Ctrl-C)")
    finally:
        session.close()
    session.report(interrupted)
    if interrupted:
        return 130
    codes = [tr.exit_code for tr in runs]
    return EXIT_LINK if EXIT_LINK in codes else max(codes)


PROBE_PY = (
    "import sys\n"
    f"print('{MARK} python', sys.version.split()[0])\n"
    "try:\n"
    "    from importlib import metadata\n"
    "except ImportError:\n"
    "    metadata = None\n"
    "for key, dists in (('torch', ('torch',)), ('cute', ('nvidia-cutlass-dsl', 'nvidia_cutlass_dsl'))):\n"
    "    found = 'missing'\n"
    "    for d in dists:\n"
    "        try:\n"
    "            found = metadata.version(d)\n"
    "            break\n"
    "        except Exception:\n"
    "            pass\n"
    f"    print('{MARK}', key, found)\n"
)


def check_script(t: Target) -> str:
    """The remote shell text of `targets check`: every fact on a `@@dsv4 key value` line."""
    wd = remote_path(t.workdir)
    return "; ".join([
        f"echo \"{MARK} host $(uname -n)\"",
        f"{{ {t.python} -c {shlex.quote(PROBE_PY)} ; }} 2>&1",
        f"echo \"{MARK} python-rc $?\"",
        f"if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu=index,name,compute_cap "
        f"--format=csv,noheader 2>&1 | sed 's/^/{MARK} gpu /'; else echo '{MARK} nosmi'; fi",
        f"if mkdir -p {wd} 2>/dev/null && test -w {wd}; then echo '{MARK} writable yes'; "
        f"else echo '{MARK} writable no'; fi",
        f"if command -v rsync >/dev/null 2>&1; then echo '{MARK} rsync yes'; else echo '{MARK} rsync no'; fi",
    ])


@dataclass
class CheckResult:
    host: str = "?"
    python: str | None = None
    python_error: str | None = None
    torch: str = "missing"
    cute: str = "missing"
    gpus: list[str] = field(default_factory=list)
    gpu_note: str | None = None
    writable: bool = False
    rsync: bool = False

    @property
    def ready(self) -> bool:
        return bool(self.python) and self.torch != "missing" and self.cute != "missing" and self.writable


def parse_check(stdout: bytes) -> CheckResult:
    """The facts of a check script's output."""
    res = CheckResult()
    text = stdout.decode("utf-8", "replace").splitlines()
    py_out = [ln for ln in text if not ln.startswith(MARK)]
    for key, rest in _marked(stdout):
        if key == "host":
            res.host = rest
        elif key == "python":
            res.python = rest
        elif key in ("torch", "cute"):
            setattr(res, key, rest)
        elif key == "python-rc" and rest != "0":
            res.python = None
            res.python_error = (py_out[-1] if py_out else f"exit code {rest}")[:200]
        elif key == "gpu":
            parts = [p.strip() for p in rest.split(",")]
            if len(parts) == 3 and parts[0].isdigit():
                res.gpus.append(f"{parts[0]}: {parts[1]} (compute capability {parts[2]})")
            else:
                res.gpu_note = rest[:200]
        elif key == "nosmi":
            res.gpu_note = "no nvidia-smi"
        elif key == "writable":
            res.writable = rest == "yes"
        elif key == "rsync":
            res.rsync = rest == "yes"
    return res


def check_cmd(root: Path, name: str) -> int:
    """Connect to `name`; report Python, torch, CuTeDSL, GPUs and the work folder. Returns 0
    when ready, 1 when reachable but not ready, 3 when it cannot connect."""
    from harness.report import make_console

    if "," in name:
        raise TargetError(f"targets check {name}: check one target at a time")
    t = resolve_targets(root, name, "targets check")[0]
    console = make_console()
    console.print(f"[bold]{t.name}[/]: ssh {t.where} (declared at {t.declared})", highlight=False)
    t0 = time.monotonic()
    try:
        out = _run_ssh(t, check_script(t), timeout=DEFAULT_CONNECT_TIMEOUT + 90)
    except LinkError as exc:
        _say(str(exc))
        return EXIT_LINK
    res = parse_check(out.stdout)
    rows = [
        ("connect", f"ok in {time.monotonic() - t0:.1f} s (host {res.host})"),
        ("python", f"{res.python} ({t.python})" if res.python else f"FAILED: {res.python_error or 'no answer'} ({t.python})"),
        ("torch", res.torch),
        ("CuTeDSL", res.cute),
        ("GPUs", "; ".join(res.gpus) if res.gpus else f"none ({res.gpu_note})" if res.gpu_note else "none"),
        ("work folder", f"{t.workdir} — {'writable' if res.writable else 'NOT writable'}"),
        ("copy by", "rsync" if res.rsync else "tar (no rsync on the remote)"),
    ]
    for key, value in rows:
        console.print(f"  {key:<12} {value}", highlight=False, markup=False)
    console.print("ready" if res.ready else "not ready: see above", highlight=False)
    return 0 if res.ready else 1
