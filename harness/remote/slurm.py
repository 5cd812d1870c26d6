"""The Slurm layer of a slurm target: shell commands on its login host (this machine, or over ssh)
and the scheduler's tools there — sbatch, squeue, sacct, scancel, sinfo — with their answers
parsed.

Every argument is quoted (shlex.quote, or ssh.remote_path for a path that may start with ~); the
one unquoted text is the target's own `python`. Only `@@dsv4 ...` lines of a probe are read, so
a login banner never passes for an answer.

Job states: squeue --states=all lists an array's tasks while queued, running and for MinJobAge
seconds after they end. A task that has left squeue is looked up with sacct where the cluster
keeps accounting; else its exit file (written by the job script) says COMPLETED / FAILED, and a
task with neither is UNKNOWN: its cases are marked lost, never passed."""

from __future__ import annotations

import base64
import re
import shlex
import subprocess
from dataclasses import dataclass

from harness.remote.ssh import MARK, LinkError, explain_ssh_failure, remote_path, ssh_argv
from harness.remote.targets import SlurmTarget, TargetError

# Slurm's job states that end a task (anything else is still queued or running).
FINAL_STATES = {"COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "CANCELLED", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED"}
_STATE = re.compile(r"^[A-Z_]{2,24}$")
_JOB_ID = re.compile(r"^\d{1,12}$")


class SlurmError(Exception):
    """A Slurm command failed; the text is one line, already explained."""


@dataclass
class TaskState:
    """One array task as the scheduler sees it."""

    state: str  # Slurm's state name (PENDING, RUNNING, TIMEOUT, ...) or UNKNOWN
    reason: str = ""  # squeue's %r: why it is pending (Priority, Resources, ...) or ended

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


class Login:
    """Shell commands on a slurm target's login host."""

    def __init__(self, t: SlurmTarget):
        self.t = t

    def sh(self, script: str, timeout: float = 120, stdin: bytes | None = None) -> subprocess.CompletedProcess:
        """Run shell text there; raises LinkError when ssh itself fails or the command hangs."""
        argv = ["/bin/sh", "-c", script] if self.t.local else ssh_argv(self.t.login_target(), script)
        try:
            out = subprocess.run(argv, input=stdin if stdin is not None else b"", capture_output=True,
                                 timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            raise LinkError(f"{self.t.name}: no answer from the login host within {timeout:.0f} s") from None
        except OSError as exc:
            raise LinkError(f"{self.t.name}: cannot start {argv[0]} ({exc.strerror or exc})") from None
        if out.returncode == 255 and not self.t.local:
            raise LinkError(explain_ssh_failure(self.t.login_target(), out.stderr.decode("utf-8", "replace")))
        return out

    def check(self, script: str, what: str, timeout: float = 120, stdin: bytes | None = None) -> bytes:
        """Run shell text there; its stdout, or SlurmError (one line) naming `what` failed."""
        out = self.sh(script, timeout, stdin)
        if out.returncode != 0:
            raise SlurmError(f"{self.t.name}: {what} failed ({last_line(out.stderr) or f'exit code {out.returncode}'})")
        return out.stdout


def last_line(data: bytes) -> str:
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    return "".join(c if c.isprintable() else "?" for c in text)[:300]


def q(path: str) -> str:
    """A path on the login host as shell text (a leading ~ kept as "$HOME")."""
    return remote_path(path)


# ---------------------------------------------------------------------------------------
# sbatch, squeue, sacct, scancel.


def parse_job_id(stdout: bytes) -> str:
    """The job id `sbatch --parsable` printed (`123` or `123;cluster`)."""
    for line in stdout.decode("utf-8", "replace").splitlines():
        head = line.strip().split(";")[0]
        if _JOB_ID.fullmatch(head):
            return head
    raise SlurmError(f"sbatch printed no job id ({last_line(stdout) or 'nothing'})")


def submit(login: Login, script_path: str, extra: list[str] | None = None, script_args: list[str] | None = None) -> str:
    """sbatch --parsable [extra] SCRIPT [args]; the job id."""
    argv = ["sbatch", "--parsable", *(extra or []), script_path, *(script_args or [])]
    text = " ".join(q(a) if a is script_path else shlex.quote(a) for a in argv)
    out = login.sh(text, timeout=120)
    if out.returncode != 0:
        raise SlurmError(f"{login.t.name}: sbatch refused the job: {last_line(out.stderr) or f'exit code {out.returncode}'}"
                         f" — check partition, account and sbatch_options at {login.t.declared}")
    return parse_job_id(out.stdout)


SQUEUE_FORMAT = "%F|%K|%T|%r"  # array job id | task index | state | reason


def squeue_script(jobs: list[str]) -> str:
    return (f"squeue --noheader --array --states=all --jobs={','.join(jobs)} --format={shlex.quote(SQUEUE_FORMAT)} "
            f"2>/dev/null | sed 's/^/{MARK} sq /'")


def parse_squeue(lines: list[str]) -> dict[tuple[str, int], TaskState]:
    """{(array job id, task index): state} from squeue lines in SQUEUE_FORMAT."""
    out: dict[tuple[str, int], TaskState] = {}
    for line in lines:
        parts = line.strip().split("|")
        if len(parts) != 4 or not _JOB_ID.fullmatch(parts[0]) or not parts[1].isdigit():
            continue
        state = parts[2].strip().upper()
        if not _STATE.fullmatch(state):
            continue
        reason = "" if parts[3] in ("None", "(null)") else "".join(c for c in parts[3] if c.isprintable())[:80]
        out[(parts[0], int(parts[1]))] = TaskState(state, reason)
    return out


def sacct_states(login: Login, job: str) -> dict[int, TaskState]:
    """{task index: final state} from sacct, or {} where the cluster keeps no accounting."""
    out = login.sh(f"sacct --noheader --parsable2 --allocations --jobs={shlex.quote(job)} --format=JobID,State",
                   timeout=60)
    states: dict[int, TaskState] = {}
    if out.returncode != 0:
        return states
    for line in out.stdout.decode("utf-8", "replace").splitlines():
        jid, _, state = line.partition("|")
        m = re.fullmatch(re.escape(job) + r"_(\d+)", jid.strip())
        word = state.split()[0].upper() if state.split() else ""
        if m and _STATE.fullmatch(word):
            states[int(m.group(1))] = TaskState(word)
    return states


def cancel(login: Login, jobs: list[str], timeout: float = 60) -> str | None:
    """scancel the jobs (whole arrays); None when done, else why not (one line)."""
    if not jobs:
        return None
    try:
        out = login.sh("scancel " + " ".join(shlex.quote(j) for j in jobs), timeout=timeout)
    except LinkError as exc:
        return str(exc)
    return None if out.returncode == 0 else f"scancel failed: {last_line(out.stderr) or out.returncode}"


def queued(login: Login, jobs: list[str]) -> list[str]:
    """The tasks of `jobs` still pending or running (`123_4`), from squeue."""
    out = login.sh(f"squeue --noheader --array --jobs={','.join(jobs)} --format=%i 2>/dev/null", timeout=60)
    return [ln.strip() for ln in out.stdout.decode("utf-8", "replace").splitlines() if ln.strip()]


# ---------------------------------------------------------------------------------------
# The run folder on the shared filesystem, read in one probe per poll.


def poll_script(run_dir: str, jobs: list[str], offsets: dict[str, int], limit: int = 4 << 20) -> str:
    """One shell text printing the tasks' states, the exit files and each record file's new bytes
        (base64): `@@dsv4 sq ...`, `@@dsv4 exit NAME CODE`, `@@dsv4 rec NAME B64`."""
    parts = [squeue_script(jobs) if jobs else ":", f"cd {q(run_dir)} 2>/dev/null || exit 0",
             f"for f in exit.*; do [ -f \"$f\" ] && echo \"{MARK} exit $f $(head -c 16 \"$f\" | tr -d '\\n')\"; done"]
    for name, offset in sorted(offsets.items()):
        parts.append(f"if [ -f {shlex.quote(name)} ]; then printf '{MARK} rec %s ' {shlex.quote(name)}; "
                     f"tail -c +{offset + 1} {shlex.quote(name)} | head -c {limit} | base64 | tr -d '\\n'; echo; fi")
    return "\n".join(parts)


@dataclass
class Poll:
    states: dict[tuple[str, int], TaskState]
    exits: dict[str, int]  # exit file name -> exit code
    data: dict[str, bytes]  # record file name -> new bytes


def parse_poll(stdout: bytes) -> Poll:
    sq, exits, data = [], {}, {}
    for line in stdout.decode("utf-8", "replace").splitlines():
        if not line.startswith(MARK + " "):
            continue
        key, _, rest = line[len(MARK) + 1:].partition(" ")
        if key == "sq":
            sq.append(rest)
        elif key == "exit":
            name, _, code = rest.partition(" ")
            if code.strip().lstrip("-").isdigit():
                exits[name] = int(code.strip())
        elif key == "rec":
            name, _, b64 = rest.partition(" ")
            try:
                data[name] = base64.b64decode(b64.strip(), validate=True)
            except ValueError:
                pass
    return Poll(parse_squeue(sq), exits, data)


# ---------------------------------------------------------------------------------------
# `targets check` of a slurm target: the partition (sinfo), the limits, the shared folder.


def sinfo_script(t: SlurmTarget) -> str:
    p = shlex.quote(t.partition)
    return "; ".join([
        f"echo \"{MARK} host $(uname -n)\"",
        f"for c in sbatch squeue scancel sinfo sacct; do command -v $c >/dev/null 2>&1 && echo \"{MARK} tool $c\"; done",
        f"sinfo --noheader --partition={p} --format='%P|%a|%l|%D|%c|%G|%t' 2>&1 | sed 's/^/{MARK} part /'",
        f"scontrol show partition {p} 2>/dev/null | tr ' ' '\\n' | "
        f"grep -E '^(MaxTime|MaxNodes|MaxCPUsPerNode|DefaultTime|AllowAccounts|AllowQos|State)=' "
        f"| sed 's/^/{MARK} limit /'",
        f"scontrol show config 2>/dev/null | grep -E '^(AccountingStorageType|MinJobAge|ClusterName) ' "
        f"| tr -s ' ' | sed 's/^/{MARK} config /'",
    ])


@dataclass
class PartitionInfo:
    host: str = "?"
    tools: list[str] | None = None
    rows: list[dict[str, str]] | None = None  # one per node-state group
    errors: list[str] | None = None
    limits: dict[str, str] | None = None
    config: dict[str, str] | None = None


def parse_sinfo(stdout: bytes) -> PartitionInfo:
    info = PartitionInfo(tools=[], rows=[], errors=[], limits={}, config={})
    for line in stdout.decode("utf-8", "replace").splitlines():
        if not line.startswith(MARK + " "):
            continue
        key, _, rest = line[len(MARK) + 1:].partition(" ")
        rest = "".join(c for c in rest if c.isprintable())[:300]
        if key == "host":
            info.host = rest
        elif key == "tool":
            info.tools.append(rest)
        elif key == "part":
            cols = rest.split("|")
            if len(cols) == 7:
                info.rows.append(dict(zip(("partition", "avail", "timelimit", "nodes", "cpus", "gres", "state"), cols)))
            elif rest:
                info.errors.append(rest)
        elif key == "limit":
            name, _, value = rest.partition("=")
            info.limits[name] = value
        elif key == "config":
            name, _, value = rest.partition(" = ")
            info.config[name.strip()] = value.strip()
    return info


def gpus_of(gres: str) -> str:
    """`gpu:b200:8(S:0-1)` -> `8 × b200`; `(null)` -> `none`."""
    found = re.findall(r"gpu(?::([A-Za-z0-9_.-]+))?:(\d+)", gres)
    if not found:
        return "none"
    return ", ".join(f"{n} × {kind}" if kind else f"{n}" for kind, n in found) + " per node"


def require_tools(info: PartitionInfo, t: SlurmTarget) -> None:
    missing = [c for c in ("sbatch", "squeue", "scancel") if c not in (info.tools or [])]
    if missing:
        raise TargetError(f"{t.name}: {', '.join(missing)} not found on the login host — is it a Slurm login node? "
                          f"(login at {t.declared})")
