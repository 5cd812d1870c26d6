"""`dsv4-lab run ... --target NAME` where NAME is a slurm target: the run goes through the
cluster's scheduler.

- here: plans the matrix, copies the tree (what git would commit) into a fresh run folder
  `<workdir>/<lab-id>.runs/<RUN>/` on the shared work folder (over ssh when the login host is
  not this machine), writes the job script and one channel key per array task there (0600),
  submits ONE job array, then polls squeue and the run folder until every task has ended,
  writing records as they arrive;
- each array task (task i of n runs `--shard i/n` on `gpus_per_task` GPUs) runs
  `python -m harness.remote.slurm_side`: it reads and deletes its key and runs the lab's
  `run ... --emit-jsonl`, whose records go framed (HMAC, channel.py) into `rec.<i>.<attempt>`;
  what the job prints goes to `log.<i>.<attempt>`, so nothing it prints can forge a record.

Faults: a task ending FAILED / OUT_OF_MEMORY (crash), TIMEOUT / DEADLINE (timeout) or
PREEMPTED / CANCELLED (skipped) gets a record here for each case that never arrived; the other
tasks go on. NODE_FAIL / BOOT_FAIL resubmits the task once with a fresh key (received cases
kept); a second one marks its cases crash. Ctrl-C / SIGTERM / SIGHUP: scancel every job of the
run, wait until squeue shows none, keep what arrived, mark the run interrupted, exit 128 + signal.

Plain sbatch, not submitit: the lab already has a command line, a shared folder and its own
record channel, and sbatch / squeue / scancel work the same over ssh."""

from __future__ import annotations

import base64
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.markup import escape

from harness.core import interrupts
from harness.remote.channel import Receiver, new_key
from harness.core.console import make_console, printable
from harness.notebook.recordview import case_line
from harness.spec.matrix import Case
from harness.notebook.records import (Record, RunLog, now_iso, stage_file,
                             status_counts)
from harness.remote.remote_run import LINE_LIMIT, case_key, git_token, parse_payload, planned_keys
from harness.execution.report import results_table, summary_lines
from harness.remote.slurm import (Login, Poll, SlurmError, TaskState, cancel, parse_poll, poll_script, q,
                           queued, sacct_states, submit)
from harness.spec.spec import Spec, Stage
from harness.remote.ssh import EXIT_LINK, LinkError
from harness.core.statuses import FAILING
from harness.remote.targets import SlurmTarget, Target, TargetError
from harness.remote.treecopy import lab_id, place_files, sync_tree, tree_files

POLL_ENV = "DSV4_LAB_SLURM_POLL"  # seconds between polls (default 3 here, 10 over ssh)
CANCEL_WAIT_S = 60  # after scancel: how long to wait for squeue to show nothing left
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9_.+/-]*$")
# Slurm's end state of a task -> the status of its cases that never arrived.
STATUS_OF_STATE = {
    "TIMEOUT": "timeout", "DEADLINE": "timeout",
    "FAILED": "crash", "OUT_OF_MEMORY": "crash", "NODE_FAIL": "crash", "BOOT_FAIL": "crash", "UNKNOWN": "crash",
    "SPECIAL_EXIT": "crash", "PREEMPTED": "skipped", "CANCELLED": "skipped", "REVOKED": "skipped",
}
REQUEUE_STATES = {"NODE_FAIL", "BOOT_FAIL"}
MAX_ATTEMPTS = 2  # a node failure is requeued once


# ---------------------------------------------------------------------------------------
# The job script.


def array_size(t: SlurmTarget, gpus: str | None, total: int) -> int:
    """How many array tasks: `--gpus N` (N GPUs in all, `gpus_per_task` each) or the target's
    `tasks`, never more than the cases planned."""
    n = t.tasks
    if gpus is not None:
        text = gpus.strip()
        if not text.isdigit() or int(text) < 1:
            raise TargetError(f"--gpus {gpus}: on a slurm target --gpus is a count of GPUs (e.g. --gpus 8: that many "
                              f"array tasks of {t.gpus_per_task or 1} GPU(s) each) — the scheduler picks which")
        n = max(1, int(text) // max(t.gpus_per_task, 1))
    return max(1, min(n, total))


def _drop(argv: list[str], name: str, takes_value: bool) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = takes_value
        elif not (takes_value and a.startswith(name + "=")):
            out.append(a)
    return out


def task_args(argv: list[str]) -> list[str]:
    """The lab's `run` arguments for every task (the shard is added by the job script)."""
    args = list(argv) if argv and argv[0] == "run" else ["run", *argv]
    for name, value in (("--target", True), ("--gpus", True), ("--shard", True), ("--emit-jsonl", False),
                        ("--print-job", False), ("--traceback", False)):
        args = _drop(args, name, value)
    return args


def job_script(t: SlurmTarget, run_dir: str, tree: str, cache: str, git: str, args: list[str], n: int,
               run_id: str) -> str:
    """The sbatch script: one array of `n` tasks, task i shard i/n; its argument is the attempt (1
        when requeued after a node failure)."""
    lines = ["#!/bin/bash", f"#SBATCH --job-name=dsv4-lab-{run_id}", f"#SBATCH --partition={t.partition}"]
    if t.account:
        lines.append(f"#SBATCH --account={t.account}")
    lines += [f"#SBATCH --array=0-{n - 1}", "#SBATCH --nodes=1", "#SBATCH --ntasks=1"]
    if t.gpus_per_task:
        lines.append(f"#SBATCH --gres=gpu:{t.gpus_per_task}")
    lines += [f"#SBATCH --time={t.time}", f"#SBATCH --output={run_dir}/log.%a.0", "#SBATCH --no-requeue",
              "#SBATCH --kill-on-invalid-dep=yes"]
    lines += [f"#SBATCH --{k}={v}" for k, v in t.sbatch_options]
    run = (f"{t.python} -m harness.remote.slurm_side {q(run_dir)}/key.\"$i.$a\" {q(run_dir)}/rec.\"$i.$a\" -- "
           + " ".join(shlex.quote(a) for a in args) + f" --shard \"$i/{n}\" --emit-jsonl")
    env = [f"DSV4_LAB_GIT={shlex.quote(git)}", f"DSV4_LAB_ROOT={q(tree)}", f"PYTHONPATH={q(tree)}",
           f"DSV4_LAB_CACHE={q(cache)}", f"PYTHONPYCACHEPREFIX={q(cache)}/pycache", "PYTHONUNBUFFERED=1"]
    lines += [
        f"# dsv4-lab run {run_id}: task $SLURM_ARRAY_TASK_ID of {n} runs --shard $SLURM_ARRAY_TASK_ID/{n}",
        'i="${SLURM_ARRAY_TASK_ID:?not an array task}"',
        'a="${1:-0}"',
        'case "$a" in 0|1) ;; *) echo "dsv4-lab: bad attempt $a" >&2; exit 2 ;; esac',
        f"cd {q(tree)} || exit 2",
        f"export {' '.join(env)}",
        run,
        "rc=$?",
        f"echo \"$rc\" > {q(run_dir)}/exit.\"$i.$a\"",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# One array task, as the lab follows it.


@dataclass
class Task:
    index: int
    n: int
    plan: set[tuple[str, str, str]]
    attempt: int = 0
    job: str = ""
    key: str = field(default_factory=new_key, repr=False)
    receiver: Receiver | None = None
    offset: int = 0
    partial: bytes = b""
    state: TaskState = field(default_factory=lambda: TaskState("SUBMITTED"))
    final_polls: int = 0  # polls since a final state was first seen (records are read once more)
    absent: int = 0  # polls in a row squeue did not list it
    exit_code: int | None = None
    run_id: str | None = None
    end: dict | None = None
    seen: set[tuple[str, str, str]] = field(default_factory=set)
    records: list[Record] = field(default_factory=list)
    rejected: int = 0
    first_reject: str | None = None
    lines: int = 0
    done: bool = False
    history: list[str] = field(default_factory=list)  # final states of earlier attempts

    def __post_init__(self) -> None:
        self.receiver = Receiver(self.key)

    @property
    def name(self) -> str:
        return f"[{self.index}]"

    @property
    def rec_file(self) -> str:
        return f"rec.{self.index}.{self.attempt}"

    @property
    def exit_file(self) -> str:
        return f"exit.{self.index}.{self.attempt}"

    @property
    def slurm_id(self) -> str:
        return f"{self.job}_{self.index}"

    @property
    def missing(self) -> set[tuple[str, str, str]]:
        return self.plan - self.seen


class _Run:
    """The lab's side of one slurm run: what arrived, written as it arrives."""

    def __init__(self, spec: Spec, t: SlurmTarget, tasks: list[Task], argv: list[str]):
        self.spec, self.t, self.tasks, self.argv = spec, t, tasks, argv
        self.root = spec.root
        self.log = RunLog(self.root)  # the lab's own run: its start/end events, and the records it writes itself
        self.run_id = self.log.run_id
        self.lab_seq = 0
        self.writer = self.log.writer
        self.task_logs: dict[str, RunLog] = {}  # a task's run (the id its start event announced): its session
        self.console = make_console()
        self.written: set[str] = set()
        self.known = set(spec.stages)
        self.case_of: dict[tuple[str, str, str], tuple[str, str, dict]] = {}
        self.started = False  # the lab's own start event is written (at submission)

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)

    def write(self, rec: Record) -> None:
        self.writer.write(rec)
        self.written.add(rec.stage)

    # -- lines from a task's record file

    def feed(self, task: Task, data: bytes) -> None:
        task.offset += len(data)
        buf = task.partial + data
        *lines, task.partial = buf.split(b"\n")
        if len(task.partial) > LINE_LIMIT:
            self.reject(task, f"line longer than {LINE_LIMIT} bytes")
            task.partial = b""
        for raw in lines:
            raw = raw.rstrip(b"\r")
            if not raw.strip():
                continue
            task.lines += 1
            if len(raw) > LINE_LIMIT:
                self.reject(task, f"line longer than {LINE_LIMIT} bytes")
                continue
            assert task.receiver is not None
            payload, why = task.receiver.open(raw)
            if payload is None:
                self.reject(task, why or "rejected")
                continue
            kind, obj = parse_payload(payload, self.known)
            if kind == "reject":
                self.reject(task, obj)
            elif kind == "event":
                self.on_event(task, obj)
            else:
                self.on_record(task, obj)

    def reject(self, task: Task, why: str) -> None:
        task.rejected += 1
        if task.first_reject is None:
            task.first_reject = f"{task.rec_file} line {task.lines}: {why}"

    def on_event(self, task: Task, ev: dict) -> None:
        if ev["event"] == "start":
            if task.run_id is not None and task.attempt == 0:
                return self.reject(task, "a second start event")
            if not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z_-]{0,63}", ev["run"]):
                return self.reject(task, "start event with a malformed run id")
            task.run_id, task.end = ev["run"], None
            log = self.task_logs[task.run_id] = RunLog(self.root, run_id=task.run_id, writer=self.writer)
            log.plan(target=self.t.name, argv=self.argv, cases=len(task.plan), shard=f"{task.index}/{task.n}",
                     slurm={"job": task.slurm_id, "attempt": task.attempt, "run": self.run_id})
            log.start()
        elif task.run_id is None or ev["run"] != task.run_id:
            self.reject(task, "end event of another run")
        elif task.end is not None:
            self.reject(task, "a second end event")
        else:
            task.end = {"interrupted": ev.get("interrupted") is True,
                        "errors": [printable(str(e), 300) for e in (ev.get("errors") or [])
                                   if isinstance(e, str)][:5] if isinstance(ev.get("errors"), list) else []}
            self.end_task_run(task, task.end["interrupted"])

    def end_task_run(self, task: Task, interrupted: bool, lost: str | None = None) -> None:
        assert task.run_id is not None
        log = self.task_logs.get(task.run_id) or RunLog(self.root, run_id=task.run_id, writer=self.writer)
        log.end(interrupted, target=self.t.name, planned=len(task.plan), counts=status_counts(task.records),
                **({"rejected": task.rejected} if task.rejected else {}), **({"lost": lost} if lost else {}))

    def on_record(self, task: Task, obj: dict) -> None:
        rec = Record.from_dict(obj)
        key = case_key(rec.stage, rec.arch, rec.case)
        if task.run_id is None:
            return self.reject(task, "a record before the run's start event")
        if task.end is not None:
            return self.reject(task, "a record after the run's end event")
        if rec.run != task.run_id or not re.fullmatch(re.escape(task.run_id) + r"\.\d{1,9}", rec.id):
            return self.reject(task, f"a record of another run ({printable(rec.run, 40)!r})")
        if key not in task.plan:
            return self.reject(task, f"a record of a case not planned for task {task.index}")
        if key in task.seen:
            if task.attempt > 0:
                return  # received before the node failed: kept once
            return self.reject(task, "a second record of one case")
        rec.target = self.t.name
        rec.to_json()
        self.write(rec)
        task.seen.add(key)
        task.records.append(rec)
        self.console.print(f"[dim]{escape(self.t.name + task.name)}[/]  " + case_line(rec), highlight=False)

    # -- the end of a task

    def mark_missing(self, task: Task, state: str, why: str) -> None:
        """A record, written by the lab, for each planned case of `task` that never arrived."""
        status = STATUS_OF_STATE.get(state, "crash")
        for key in sorted(task.missing):
            stage, arch, case = self.case_of[key]
            self.lab_seq += 1
            rec = Record(id=f"{self.run_id}.{self.lab_seq}", run=self.run_id, t=now_iso(), stage=stage, arch=arch,
                         case=case, status=status, target=self.t.name, error=why)
            self.write(rec)
            task.seen.add(key)
            task.records.append(rec)
            self.console.print(f"[dim]{escape(self.t.name + task.name)}[/]  " + case_line(rec), highlight=False)

    def close(self) -> None:
        self.writer.close()


def _poll_interval(t: SlurmTarget) -> float:
    raw = os.environ.get(POLL_ENV, "")
    try:
        value = float(raw) if raw else (3.0 if t.local else 10.0)
    except ValueError:
        value = 3.0
    return min(max(value, 0.2), 120.0)


def _write_files(login: Login, run_dir: str, files: dict[str, bytes]) -> None:
    """Write small files into the run folder (0600), their contents through stdin, never on a command line."""
    payload = b"".join(name.encode() + b" " + base64.b64encode(data) + b"\n" for name, data in files.items())
    script = (f"umask 077 && cd {q(run_dir)} && while read -r name data; do "
              "printf '%s' \"$data\" | base64 -d > \"$name\" || exit 1; done")
    login.check(script, "writing the job script and keys into the run folder", stdin=payload)


def _prepare(login: Login, t: SlurmTarget, root: Path, run_id: str) -> tuple[str, str]:
    """Create the run folder on the shared work folder; (its absolute path, the cache's)."""
    base = f"{t.workdir.rstrip('/')}/{lab_id(root)}"
    out = login.check(f"umask 077 && mkdir -p {q(base + '.runs/' + run_id)} {q(base + '.cache')} && "
                      f"cd {q(base + '.runs/' + run_id)} && pwd -P", f"creating the run folder under {t.workdir}")
    run_dir = out.decode("utf-8", "replace").strip().splitlines()[-1] if out.strip() else ""
    if not _SAFE_PATH.fullmatch(run_dir):
        raise TargetError(f"{t.name}: the run folder {printable(run_dir, 200)!r} has characters a job script cannot "
                          f"hold (spaces, quotes) — pick a plain workdir at {t.declared}")
    cache = run_dir.rsplit(".runs/", 1)[0] + ".cache"
    return run_dir, cache


def run_slurm(spec: Spec, t: SlurmTarget, argv: list[str], stages: list[Stage], archs: list[str] | None,
              cases: dict[str, list[Case]], *, gpus: str | None = None, shard: tuple[int, int] | None = None,
              print_job: bool = False) -> int:
    """Run the planned cases as a job array on `t` (module doc).  Returns 0 (every task completed,
        every case passed), 1 (failures, a failed / timed-out / preempted task, rejected lines,
        missing cases), 3 (the login host or scheduler unusable), 128 + signal when interrupted."""
    from harness.execution.runner import tasks_for

    if shard is not None:
        raise TargetError("--shard cannot be combined with a slurm target — the lab shards its job array itself")
    root: Path = spec.root
    total = len(tasks_for(stages, archs, lambda st: cases[st.id]))
    n = array_size(t, gpus, total)
    args = task_args(argv)
    git = git_token(root)
    if print_job:
        base = f"{t.workdir.rstrip('/')}/{lab_id(root)}"
        if t.local:
            base = os.path.expanduser(base)
        script = job_script(t, f"{base}.runs/RUN", f"{base}.runs/RUN/{lab_id(root)}", f"{base}.cache", git, args, n,
                            "RUN")
        sys.stdout.write(script)
        print(f"# submitted as: sbatch --parsable {base}.runs/RUN/job.sh 0   (RUN: a fresh run id; nothing was "
              f"copied or submitted)", flush=True)
        return 0
    files = tree_files(root)
    tasks = [Task(i, n, set(planned_keys(stages, archs, cases, (i, n)))) for i in range(n)]
    run = _Run(spec, t, tasks, list(argv))
    for st in stages:
        for c in cases[st.id]:
            for arch in (archs or list(st.kernels)):
                run.case_of[case_key(st.id, arch, c.dict)] = (st.id, arch, c.dict)
    login = Login(t)
    stop: list[int] = []
    previous = interrupts.catch(lambda signum, frame: stop.append(signum) if not stop else None)
    jobs: list[str] = []
    try:
        run.say(f"run on {t.name} ({t.where}): {total} case(s) in a job array of {n} task(s)")
        try:
            run_dir, cache = _prepare(login, t, root, run.run_id)
            tree = f"{run_dir}/{lab_id(root)}"
            if t.local:
                place_files(root, files, Path(tree), link=False)  # a copy: a later edit must not reach a queued job
                how = "copy"
            else:
                synced = sync_tree(Target(name=t.name, ssh=t.login, workdir=run_dir, python=t.python, port=t.port,
                                          ssh_options=t.ssh_options, declared=t.declared), root)
                how = synced.method
            run.say(f"{t.name}  copied {len(files)} file(s) by {how} to {tree}")
            script = job_script(t, run_dir, tree, cache, git, args, n, run.run_id)
            _write_files(login, run_dir, {"job.sh": script.encode(),
                                          **{f"key.{k.index}.0": k.key.encode() + b"\n" for k in tasks}})
            if stop:
                raise interrupts.Interrupted(stop[0])
            job = submit(login, f"{run_dir}/job.sh", script_args=["0"])
        except (LinkError, SlurmError) as exc:
            print(f"dsv4-lab: {exc} — nothing was submitted", file=sys.stderr, flush=True)
            return EXIT_LINK
        jobs.append(job)
        for k in tasks:
            k.job = job
        run.log.plan(target=t.name, argv=list(argv), cases=total, slurm={"job": job, "tasks": n, "folder": run_dir})
        run.log.start()
        run.started = True
        run.say(f"{t.name}  submitted job array {job} ({n} task(s), partition {t.partition}); "
                f"cancel with Ctrl-C here or `scancel {job}`")
        code = _follow(run, login, run_dir, jobs, stop)
    except interrupts.Interrupted as exc:  # a signal before the handlers above were in place
        stop.append(exc.signum)
        code = None
    finally:
        interrupts.restore(previous, ignore=bool(stop))
    if stop:
        code = _interrupted(run, login, jobs, stop[0], run_dir if jobs else None)
    run.close()
    return code if code is not None else 1


def _follow(run: _Run, login: Login, run_dir: str, jobs: list[str], stop: list[int]) -> int | None:
    """Poll until every task has ended (None when a stop signal came first)."""
    interval = _poll_interval(run.t)
    errors = 0
    while not all(k.done for k in run.tasks):
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline and not stop:
            time.sleep(0.1)
        if stop:
            return None
        live = sorted({k.job for k in run.tasks if not k.done})
        try:
            out = login.sh(poll_script(run_dir, live, {k.rec_file: k.offset for k in run.tasks if not k.done}))
        except LinkError as exc:
            errors += 1
            if errors >= 6:
                run.say(f"{exc} — giving up following the run; the job array is cancelled")
                cancel(login, jobs)
                return _finish(run, EXIT_LINK, "login host lost")
            continue
        errors = 0
        _apply(run, login, run_dir, jobs, parse_poll(out.stdout), stop)
    return _finish(run, None, None)


def _apply(run: _Run, login: Login, run_dir: str, jobs: list[str], poll: Poll, stop: list[int]) -> None:
    for k in run.tasks:
        if k.done:
            continue
        data = poll.data.get(k.rec_file)
        if data:
            run.feed(k, data)
        if k.exit_file in poll.exits:
            k.exit_code = poll.exits[k.exit_file]
        st = poll.states.get((k.job, k.index))
        if st is None:
            k.absent += 1
            if k.absent >= 3 and not k.state.final:  # left the queue: sacct, else its exit file
                st = sacct_states(login, k.job).get(k.index) or (
                    TaskState("COMPLETED" if k.exit_code == 0 else "FAILED", "exit file")
                    if k.exit_code is not None else TaskState("UNKNOWN", "left the queue without an exit file"))
            else:
                st = k.state
        else:
            k.absent = 0
        if (st.state, st.reason) != (k.state.state, k.state.reason):
            k.state = st
            why = f" ({st.reason})" if st.reason else ""
            run.say(f"{run.t.name}{k.name}  job {k.slurm_id} {st.state}{why}")
        if k.state.final:
            k.final_polls += 1
            if k.final_polls >= 2:  # one more read of its record file after the end
                _task_ended(run, login, run_dir, jobs, k)


def _task_ended(run: _Run, login: Login, run_dir: str, jobs: list[str], k: Task) -> None:
    state = k.state.state
    ended_well = state == "COMPLETED" and k.end is not None and not k.end.get("interrupted")
    if k.run_id is not None and k.end is None:
        run.end_task_run(k, True, f"slurm {state}")
    if ended_well or not k.missing:
        k.done = True
        return
    if state in REQUEUE_STATES and k.attempt + 1 < MAX_ATTEMPTS:
        k.history.append(f"{k.slurm_id} {state}")
        k.attempt += 1
        k.key = new_key()
        k.receiver = Receiver(k.key)
        k.offset, k.partial, k.final_polls, k.absent = 0, b"", 0, 0
        k.exit_code = None
        k.state = TaskState("SUBMITTED")
        try:
            _write_files(login, run_dir, {f"key.{k.index}.{k.attempt}": k.key.encode() + b"\n"})
            k.job = submit(login, f"{run_dir}/job.sh", [f"--array={k.index}", f"--output={run_dir}/log.%a.{k.attempt}"],
                           [str(k.attempt)])
        except (LinkError, SlurmError) as exc:
            run.say(f"{run.t.name}{k.name}  could not requeue after {state}: {exc}")
            run.mark_missing(k, state, f"slurm task {k.history[-1]}; requeue failed")
            k.done = True
            return
        jobs.append(k.job)
        run.say(f"{run.t.name}{k.name}  {k.history[-1]}: requeued once as job {k.slurm_id}")
        return
    _log_tail(run, login, run_dir, k)
    limit = f" (time limit {run.t.time})" if state in ("TIMEOUT", "DEADLINE") else ""
    tail = f", exit code {k.exit_code}" if k.exit_code not in (None, 0) else ""
    earlier = f"; before: {', '.join(k.history)}" if k.history else ""
    run.mark_missing(k, state, f"slurm task {k.slurm_id} ended {state}{limit}{tail} before this case finished"
                               f"{earlier} — its log: {run_dir}/log.{k.index}.{k.attempt}")
    k.done = True


def _log_tail(run: _Run, login: Login, run_dir: str, k: Task, lines: int = 8) -> None:
    """The last lines of a task's Slurm log (what its job printed), on stderr, when it did not complete."""
    try:
        out = login.sh(f"tail -n {lines} {q(run_dir)}/log.{k.index}.{k.attempt} 2>/dev/null", timeout=60)
    except LinkError:
        return
    tail = [printable(ln, 300) for ln in out.stdout.decode("utf-8", "replace").splitlines() if ln.strip()]
    if tail:
        print(f"dsv4-lab: {run.t.name}{k.name}: job {k.slurm_id} ended {k.state.state}; the end of its log:",
              file=sys.stderr, flush=True)
        for ln in tail:
            print(f"  {ln}", file=sys.stderr, flush=True)


def _interrupted(run: _Run, login: Login, jobs: list[str], signum: int, run_dir: str | None) -> int:
    """Cancel the run's jobs, wait until nothing of them is queued, keep what arrived."""
    why = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    left: list[str] = []
    if jobs:
        run.say(f"{run.t.name}  interrupted here ({why}): cancelling job(s) {', '.join(sorted(set(jobs)))} (scancel)")
        problem = cancel(login, sorted(set(jobs)))
        deadline = time.monotonic() + CANCEL_WAIT_S
        while True:
            try:
                left = queued(login, sorted(set(jobs)))
            except LinkError as exc:
                problem, left = str(exc), ["?"]
                break
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if run_dir is not None:  # what the tasks sent before they stopped
            try:
                out = login.sh(poll_script(run_dir, [], {k.rec_file: k.offset for k in run.tasks if not k.done}))
                poll = parse_poll(out.stdout)
                for k in run.tasks:
                    if not k.done and poll.data.get(k.rec_file):
                        run.feed(k, poll.data[k.rec_file])
            except LinkError:
                pass
        if left:
            run.say(f"{run.t.name}  still queued after scancel: {', '.join(left[:8])}"
                    + (f" ({problem})" if problem else "") + f" — cancel them with `scancel {' '.join(sorted(set(jobs)))}`")
        else:
            run.say(f"{run.t.name}  nothing of this run is left queued")
    for k in run.tasks:
        if k.run_id is not None and k.end is None:
            run.end_task_run(k, True, f"interrupted here ({why})")
    _finish(run, None, f"interrupted here ({why})")
    print(f"dsv4-lab: interrupted here ({why}): the job array was cancelled; every record received is kept",
          file=sys.stderr, flush=True)
    return interrupts.exit_code_for(signum)


def _finish(run: _Run, code: int | None, lost: str | None) -> int:
    records = [r for k in run.tasks for r in k.records]
    if run.started:
        run.log.end(lost is not None, target=run.t.name, planned=sum(len(k.plan) for k in run.tasks),
                    counts=status_counts(records), **({"lost": lost} if lost else {}))
    if records:
        run.console.print(results_table(records))
        for line in summary_lines(records, lost is not None, {}):
            run.say(line)
    worst = 0
    for k in run.tasks:
        end = "never started" if k.run_id is None else "run " + k.run_id
        run.say(f"{run.t.name}{k.name}: job {k.slurm_id or '-'} {k.state.state}, {end}, {len(k.records)} record(s)")
        if k.rejected:
            print(f"dsv4-lab: {run.t.name}{k.name}: rejected {k.rejected} line(s) of its record file, none written "
                  f"(first: {k.first_reject})", file=sys.stderr, flush=True)
            worst = max(worst, 1)
        for err in (k.end or {}).get("errors", []):
            print(f"dsv4-lab: {run.t.name}{k.name}: the task's run failed: {err}", file=sys.stderr, flush=True)
        if k.missing and lost is None:
            print(f"dsv4-lab: {run.t.name}{k.name}: {len(k.missing)} planned case(s) never arrived — nothing is "
                  "proven about them", file=sys.stderr, flush=True)
            worst = max(worst, 1)
        if k.state.state != "COMPLETED":  # a requeued task that then completed proved its cases
            worst = max(worst, 1)
    if any(r.status in FAILING or r.status == "skipped" and r.run == run.run_id for r in records):
        worst = max(worst, 1)
    files = [str(stage_file(run.root, s).relative_to(run.root)) for s in sorted(run.written)]
    run.say(f"records: {', '.join(files) if files else 'none written'}")
    return code if code is not None else worst

