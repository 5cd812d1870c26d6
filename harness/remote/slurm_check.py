"""`dsv4-lab targets check NAME` for a slurm target: the login host, the Slurm tools, the partition
(sinfo) and its limits (scontrol), accounting (sacct), and — by a one-minute probe job — whether
the work folder is shared and which python, torch and CuTeDSL the nodes see.  A probe pending
past DSV4_LAB_SLURM_CHECK_WAIT seconds (default 120) is cancelled, the folder reported unchecked."""

from __future__ import annotations

import os
import secrets
import shlex
import sys
import time
from pathlib import Path

from harness.core.console import make_console, printable
from harness.remote.slurm import (Login, SlurmError, cancel, gpus_of, parse_sinfo, q, queued, require_tools, sinfo_script,
                           submit)
from harness.remote.ssh import EXIT_LINK, MARK, LinkError, marked
from harness.remote.target_check import PROBE_PY
from harness.remote.targets import SlurmTarget, TargetError, load_targets
from harness.remote.treecopy import lab_id

WAIT_ENV = "DSV4_LAB_SLURM_CHECK_WAIT"


def probe_script(t: SlurmTarget, workdir: str, token: str) -> str:
    lines = ["#!/bin/bash", "#SBATCH --job-name=dsv4-lab-check", f"#SBATCH --partition={t.partition}"]
    if t.account:
        lines.append(f"#SBATCH --account={t.account}")
    if t.gpus_per_task:
        lines.append(f"#SBATCH --gres=gpu:{t.gpus_per_task}")
    lines += ["#SBATCH --time=1", "#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --no-requeue",
              f"#SBATCH --output={workdir}/.check-{token}.out"]
    lines += [f"#SBATCH --{k}={v}" for k, v in t.sbatch_options]
    lines += [
        f"echo \"{MARK} node $(uname -n)\"",
        f"if [ \"$(cat {q(workdir)}/.check-{token} 2>/dev/null)\" = {token} ]; then echo '{MARK} sees yes'; "
        f"else echo '{MARK} sees no'; fi",
        f"{{ {t.python} -c {shlex.quote(PROBE_PY)} ; }} 2>&1",
        f"echo \"{MARK} python-rc $?\"",
        f"if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu=index,name,compute_cap "
        f"--format=csv,noheader 2>&1 | sed 's/^/{MARK} gpu /'; else echo '{MARK} nosmi'; fi",
    ]
    return "\n".join(lines) + "\n"


def check_slurm(root: Path, name: str) -> int:
    """0: ready (partition up, work folder shared, python with torch and CuTeDSL on a node); 1:
        reachable, not ready (or not fully checked); 3: the login host unusable."""
    t = load_targets(root)[name]
    assert isinstance(t, SlurmTarget)
    console = make_console()

    def say(key: str, value: str) -> None:
        console.print(f"  {key:<12} {value}", highlight=False, markup=False)

    console.print(f"{t.name}: {t.where} (declared at {t.declared})", highlight=False, markup=False)
    login = Login(t)
    try:
        info = parse_sinfo(login.sh(sinfo_script(t), timeout=60).stdout)
    except LinkError as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return EXIT_LINK
    say("login", f"{info.host} ({'this machine' if t.local else 'ssh ' + t.login})")
    try:
        require_tools(info, t)
    except TargetError as exc:
        say("slurm", f"NOT FOUND: {exc}")
        return 1
    ready = True
    if not info.rows:
        say("partition", f"{t.partition}: NOT FOUND ({'; '.join(info.errors or []) or 'sinfo lists nothing'})")
        return 1
    for row in info.rows:
        say("partition", f"{row['partition'].rstrip('*')} {row['avail']}: {row['nodes']} node(s) {row['state']}, "
                         f"{row['cpus']} CPUs, GPUs {gpus_of(row['gres'])}, time limit {row['timelimit']}")
        ready &= row["avail"] == "up"
    limits = ", ".join(f"{k}={v}" for k, v in sorted((info.limits or {}).items()))
    say("limits", limits or "(scontrol shows none)")
    acct = (info.config or {}).get("AccountingStorageType", "?")
    say("accounting", f"{acct} — " + ("sacct answers for ended tasks" if acct not in ("accounting_storage/none", "?")
                                      else "none: ended tasks are read from squeue (MinJobAge "
                                           f"{(info.config or {}).get('MinJobAge', '?')}) and exit files"))
    say("job", f"{t.gpus_per_task} GPU(s) per task, time limit {t.time}, default {t.tasks} task(s)"
               + (f", {' '.join(f'--{k}={v}' for k, v in t.sbatch_options)}" if t.sbatch_options else ""))
    # the shared work folder: written here, read by a probe job on a compute node, and its output read back here
    workdir = f"{t.workdir.rstrip('/')}/{lab_id(root)}.runs"
    token = secrets.token_hex(8)
    try:
        out = login.check(f"umask 077 && mkdir -p {q(workdir)} && cd {q(workdir)} && echo {token} > .check-{token} "
                          "&& pwd -P", f"writing into {t.workdir}")
        absdir = out.decode().strip().splitlines()[-1]
        login.check(f"cat > {q(absdir)}/.check-{token}.sh", "writing the probe job",
                    stdin=probe_script(t, absdir, token).encode())
        job = submit(login, f"{absdir}/.check-{token}.sh")
    except (LinkError, SlurmError) as exc:
        say("work folder", f"NOT CHECKED: {printable(str(exc), 300)}")
        return 1
    wait = float(os.environ.get(WAIT_ENV, "") or 120)
    deadline = time.monotonic() + wait
    while queued(login, [job]) and time.monotonic() < deadline:
        time.sleep(1)
    left = queued(login, [job])
    if left:
        cancel(login, [job])
        say("work folder", f"NOT CHECKED: the probe job {job} was still queued after {wait:.0f} s (cancelled) — "
                           "try again when the partition has room")
        return 1
    res = login.sh(f"cat {q(absdir)}/.check-{token}.out 2>/dev/null; rm -f {q(absdir)}/.check-{token}*", timeout=60)
    facts = marked(res.stdout)
    keys = dict(facts)
    if "node" not in keys:
        say("work folder", f"{t.workdir} — NOT SHARED: the probe job {job} ran but its output never appeared here "
                           "(the compute nodes write somewhere else) — point workdir at a shared filesystem")
        return 1
    shared = keys.get("sees") == "yes"
    say("work folder", f"{t.workdir} — " + ("shared with the compute nodes (probe job on " + keys["node"] + ")"
                                           if shared else "NOT SHARED: the node did not see the file written here"))
    py_ok = keys.get("python-rc") == "0"
    say("python", f"{keys.get('python', '?')} on {keys['node']} ({t.python})" if py_ok else f"FAILED on {keys['node']} "
        f"({t.python})")
    say("torch", keys.get("torch", "missing"))
    say("CuTeDSL", keys.get("cute", "missing"))
    gpus = [printable(v, 200) for k, v in facts if k == "gpu"]
    say("GPUs", "; ".join(gpus) if gpus else "none seen by the probe job")
    ready &= shared and py_ok and keys.get("torch", "missing") != "missing" and keys.get("cute", "missing") != "missing"
    console.print("ready" if ready else "not ready: see above", highlight=False, markup=False)
    return 0 if ready else 1
