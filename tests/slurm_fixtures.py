"""A real Slurm on 127.0.0.1 (`slurm_cluster`): node `dsv4node`, partitions `cpu`, `urgent` (preempts `cpu`)."""

import os
import shutil
import socket
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.ssh_fixtures import free_port

MUNGED = "/usr/sbin/munged"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
NODE = "dsv4node"
PARTITION = "cpu"
URGENT = "urgent"  # preempts (cancels) PARTITION's jobs


@dataclass
class SlurmCluster:
    dir: Path
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def cmd(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=timeout)

    def squeue(self) -> list[str]:
        """Every job still pending or running (`ID STATE`)."""
        out = self.cmd("squeue", "--noheader", "--array", "--format=%i %T")
        return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-1500:] for p in sorted(self.dir.glob("*.log")))


def _slurm_conf(d: Path, ctld_port: int, slurmd_port: int) -> str:
    return textwrap.dedent(f"""\
        ClusterName=dsv4test
        SlurmctldHost=localhost(127.0.0.1)
        SlurmctldPort={ctld_port}
        SlurmdPort={slurmd_port}
        SlurmUser=root
        SlurmdUser=root
        AuthType=auth/munge
        AuthInfo=socket={d}/munge.sock
        CredType=cred/munge
        StateSaveLocation={d}/state
        SlurmdSpoolDir={d}/spool
        SlurmctldPidFile={d}/slurmctld.pid
        SlurmdPidFile={d}/slurmd.pid
        SlurmctldLogFile={d}/slurmctld.log
        SlurmdLogFile={d}/slurmd.log
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SchedulerType=sched/builtin
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        SlurmdParameters=config_overrides
        ReturnToService=2
        MpiDefault=none
        JobCompType=jobcomp/none
        AccountingStorageType=accounting_storage/none
        JobAcctGatherType=jobacct_gather/none
        KillWait=2
        MinJobAge=600
        InactiveLimit=0
        SlurmctldTimeout=10
        SlurmdTimeout=30
        MessageTimeout=10
        NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} CPUs=8 RealMemory=2000 State=UNKNOWN
        PreemptType=preempt/partition_prio
        PreemptMode=CANCEL
        PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=60 State=UP PriorityTier=1
        PartitionName={URGENT} Nodes={NODE} MaxTime=60 State=UP PriorityTier=10
        """)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A real slurmctld + slurmd (+ munged) on 127.0.0.1 (skipped if they cannot start)."""
    for path in (MUNGED, SLURMCTLD, SLURMD):
        if not os.access(path, os.X_OK):
            pytest.skip(f"{path} is not installed: apt-get install slurm-wlm munge")
    for tool in ("sbatch", "squeue", "scancel", "sinfo", "scontrol"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: apt-get install slurm-wlm")
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root to start jobs (this test session is not root)")
    d = tmp_path_factory.mktemp("slurm")
    os.chmod(d, 0o755)  # munged wants its socket folder reachable
    (d / "state").mkdir()
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, free_port(), free_port()))
    cluster = SlurmCluster(d, conf)
    env = {**os.environ, **cluster.env}
    procs: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        with open(d / f"{name}.out.log", "wb") as fh:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh, env=env,
                                 start_new_session=True)
        procs.append(p)
        return p

    try:
        munged = start("munged", [MUNGED, "-F", "-f", f"--socket={d}/munge.sock", f"--key-file={key}",
                                  f"--pid-file={d}/munged.pid", f"--seed-file={d}/munge.seed",
                                  f"--log-file={d}/munged.log"])
        deadline = time.monotonic() + 10
        while not (d / "munge.sock").exists():
            if munged.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"munged could not start: {cluster.logs()[-300:]}")
            time.sleep(0.1)
        ctld = start("slurmctld", [SLURMCTLD, "-D", "-i", "-f", str(conf)])
        slurmd = start("slurmd", [SLURMD, "-D", "-N", NODE, "-f", str(conf)])
        deadline = time.monotonic() + 30
        while True:
            for p, name in ((ctld, "slurmctld"), (slurmd, "slurmd")):
                if p.poll() is not None:
                    pytest.skip(f"{name} could not start (exit {p.returncode}): {cluster.logs()[-400:]}")
            out = cluster.cmd("sinfo", "--noheader", f"--partition={PARTITION}", "--format=%t", timeout=10)
            if out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc"):
                break
            if time.monotonic() > deadline:
                pytest.skip(f"slurm did not come up within 30 s (sinfo: {(out.stdout + out.stderr).strip()[-200:]}): "
                            f"{cluster.logs()[-300:]}")
            time.sleep(0.3)
        yield cluster
    finally:
        if procs:
            subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=30)
        _stop(procs)
