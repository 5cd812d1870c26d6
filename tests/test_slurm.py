"""Slurm targets (issue 32): targets.yaml, the sbatch script, runs on a real Slurm."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.remote.targets import SlurmTarget, TargetError, load_targets_file
from tests.slurm_fixtures import PARTITION, URGENT, SlurmCluster, slurm_cluster  # noqa: F401 (fixture)
from tests.ssh_fixtures import SshServer, add_cpu_stage, make_lab, run_cli, ssh_server  # noqa: F401 (fixture)

POLL = {"DSV4_LAB_SLURM_POLL": "0.5"}


def _targets(workdir: Path, extra: str = "", tasks: int = 3, time_limit: str = "5") -> str:
    return (f"version: 1\ntargets:\n  cl:\n    kind: slurm\n    login: local\n    partition: {PARTITION}\n"
            f"    gpus_per_task: 0\n    time: \"{time_limit}\"\n    tasks: {tasks}\n    python: {sys.executable}\n"
            f"    workdir: {workdir}\n{extra}")


# targets.yaml: slurm entries.

GOOD = """\
version: 1
targets:
  b200:
    kind: slurm
    login: login-node
    port: 2222
    ssh_options: {ConnectTimeout: 5}
    partition: b200
    account: kernels
    gpus_per_task: 1
    time: "2:00:00"
    tasks: 8
    python: source /shared/venv/bin/activate && python
    workdir: /shared/me/dsv4
    sbatch_options: {qos: high, constraint: b200, mem-per-gpu: 64G}
"""


def _load(tmp_path: Path, text: str):
    path = tmp_path / "targets.yaml"
    path.write_text(text)
    return load_targets_file(path, "targets.yaml")


def test_slurm_target_parses(tmp_path: Path) -> None:
    t = _load(tmp_path, GOOD)["b200"]
    assert isinstance(t, SlurmTarget)
    assert (t.login, t.port, t.partition, t.account, t.gpus_per_task, t.time, t.tasks) == \
        ("login-node", 2222, "b200", "kernels", 1, "2:00:00", 8)
    assert t.sbatch_options == (("qos", "high"), ("constraint", "b200"), ("mem-per-gpu", "64G"))
    assert t.login_target().ssh == "login-node" and t.login_target().ssh_options == (("ConnectTimeout", "5"),)


@pytest.mark.parametrize("change, key, words", [
    (("qos: high", "output: /tmp/x"), "targets.b200.sbatch_options.output", "not an allowed sbatch option"),
    (("qos: high", "qos: 'high; rm -rf ~'"), "targets.b200.sbatch_options.qos", "no shell fragments"),
    (("qos: high", "qos: $(id)"), "targets.b200.sbatch_options.qos", "no shell fragments"),
    (("time: \"2:00:00\"", "time: two hours"), "targets.b200.time", "not a Slurm time limit"),
    (("partition: b200\n", "partition: b 200\n"), "targets.b200.partition", "not a partition name"),
    (("    partition: b200\n", ""), "targets.b200.partition", "missing required key"),
    (("kind: slurm", "kind: pbs"), "targets.b200.kind", "write ssh or slurm"),
    (("ConnectTimeout: 5", "StrictHostKeyChecking: no"), "targets.b200.ssh_options.StrictHostKeyChecking",
     "host-key checking stays on"),
    (("account: kernels", "password: hunter2"), "targets.b200.password", "looks like a secret"),
    (("account: kernels", "account: kernels\n    gres: gpu:8"), "targets.b200.gres", "unknown key of a slurm target"),
    (("login: login-node", "login: local"), "targets.b200.port", "only for a login host reached over ssh"),
    (("gpus_per_task: 1", "gpus_per_task: -1"), "targets.b200.gpus_per_task", "GPUs per array task"),
])
def test_bad_slurm_target_is_one_line(tmp_path: Path, change: tuple[str, str], key: str, words: str) -> None:
    text = GOOD.replace(*change)
    assert text != GOOD
    with pytest.raises(TargetError) as err:
        _load(tmp_path, text)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("targets.yaml:") and key in msg and words in msg, msg
    assert " — " in msg  # the fix


def test_slurm_target_bad_input_via_cli(tmp_path: Path) -> None:
    """CLI: one line naming file, line and key, exit 2."""
    lab = make_lab(tmp_path / "lab", GOOD.replace("qos: high", "qos: '`reboot`'"))
    out = run_cli(lab, "targets", "list")
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "targets.yaml:15" in lines[0] and "sbatch_options.qos" in lines[0], out.stderr


def test_slurm_target_is_not_an_ssh_target(tmp_path: Path) -> None:
    """`--target cl,other` refuses a slurm target in one line."""
    lab = make_lab(tmp_path / "lab", GOOD + "  box:\n    ssh: box\n    workdir: w\n    python: python3\n")
    out = run_cli(lab, "run", "FAKE", "--target", "b200,box")
    assert out.returncode == 2 and "b200 is a slurm target" in out.stderr and "Traceback" not in out.stderr, out


# The sbatch script.


def test_print_job_shows_the_gpu_array(tmp_path: Path) -> None:
    targets = GOOD.replace("login: login-node\n    port: 2222\n    ssh_options: {ConnectTimeout: 5}\n", "login: local\n") \
        .replace("gpus_per_task: 1", "gpus_per_task: 2").replace("/shared/me/dsv4", str(tmp_path / "shared"))
    lab = make_lab(tmp_path / "lab", targets)
    out = run_cli(lab, "run", "FAKE", "--target", "b200", "--gpus", "4", "--print-job")
    assert out.returncode == 0, out
    script = out.stdout
    for line in ("#SBATCH --partition=b200", "#SBATCH --account=kernels", "#SBATCH --gres=gpu:2",
                 "#SBATCH --array=0-1", "#SBATCH --time=2:00:00", "#SBATCH --qos=high", "#SBATCH --constraint=b200",
                 "#SBATCH --mem-per-gpu=64G", "#SBATCH --no-requeue"):
        assert line + "\n" in script, (line, script)
    assert "-m harness.remote.slurm_side" in script and '--shard "$i/2" --emit-jsonl' in script
    assert "--target" not in script.split("harness.remote.slurm_side", 1)[1].split("\n")[0]
    assert "source /shared/venv/bin/activate && python -m harness.remote.slurm_side" in script
    assert not (tmp_path / "shared").exists()  # nothing copied, nothing submitted
    # without --gpus: `tasks`, capped by cases
    out = run_cli(lab, "run", "FAKE", "--target", "b200", "--print-job")
    assert "#SBATCH --array=0-2\n" in out.stdout, out.stdout
    out = run_cli(lab, "run", "FAKE", "--print-job")
    assert out.returncode == 2 and "not a slurm target" in out.stderr, out
    out = run_cli(lab, "run", "FAKE", "--target", "b2000", "--print-job")  # a typo: said as such, not "not slurm"
    assert out.returncode == 2 and "no target b2000 is declared (declared: b200)" in out.stderr, out


# Through a real Slurm.

MIX_KERNEL = '''\
"""One behaviour per case, one case per array task: n=1, 5 pass; n=2 passes but forges a "fail" of
its own case in its own run (read from its record file), unframed and in a guessed frame, printed and
appended to its task's record file; n=3 kills its
own run (the task FAILS); n=4 sleeps past the job's time limit (TIMEOUT)."""
import json
import os
import time


def _rec_file():
    pid = os.getppid()
    for _ in range(6):
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        for a in args:
            if b"/rec." in a:
                return a.decode()
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    return None


class Kernel:
    def __init__(self, n):
        self.n = n

    def __call__(self, a, b, out):
        if self.n == 2:  # a forged "fail" of its own case, in its own run: only the MAC tells it apart
            path = _rec_file()
            run = next(json.loads(ln.split(" ", 3)[3])["run"] for ln in open(path) if '"event": "start"' in ln
                       or '"event":"start"' in ln)
            forged = {"v": 1, "id": run + ".1", "run": run, "t": "2026-01-01T00:00:00Z", "stage": "MIX",
                      "arch": "cpu", "case": {"n": 2}, "status": "fail", "metrics": {"out": {"cosine": 0.0}}}
            line = json.dumps(forged)
            print(line, flush=True)
            with open(path, "a") as fh:
                fh.write(line + "\\n")
                fh.write("@@dsv4-rec 2 " + "0" * 64 + " " + line + "\\n")
        elif self.n == 3:
            os.kill(os.getppid(), 9)
        elif self.n == 4:
            time.sleep(600)
        out.copy_(a + b)
'''


def _records(lab: Path, stage: str) -> list[dict]:
    path = lab / "results" / "records" / f"{stage}.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def _events(lab: Path) -> list[dict]:
    path = lab / "results" / "runs.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def test_round_trip(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    lab = make_lab(tmp_path / "lab", _targets(tmp_path / "shared"))
    out = run_cli(lab, "run", "FAKE", "--target", "cl", env={**slurm_cluster.env, **POLL}, timeout=240)
    assert out.returncode == 0, (out.stdout, out.stderr, slurm_cluster.logs())
    recs = _records(lab, "FAKE")
    assert sorted(r["case"]["n"] for r in recs) == [4, 8, 16] and {r["status"] for r in recs} == {"pass"}
    assert {r["target"] for r in recs} == {"cl"}
    assert "submitted job array" in out.stdout and "RUNNING" in out.stdout or "COMPLETED" in out.stdout
    starts = [e for e in _events(lab) if e["event"] == "start"]
    assert sorted(e.get("shard") for e in starts if "shard" in e) == ["0/3", "1/3", "2/3"]
    assert slurm_cluster.squeue() == []
    # keys deleted; records from files
    run_dirs = list((tmp_path / "shared").glob("*.runs/*"))
    assert len(run_dirs) == 1 and not list(run_dirs[0].glob("key.*")) and len(list(run_dirs[0].glob("rec.*"))) == 3


def test_array_with_failing_timed_out_and_forging_tasks(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    """5 tasks: 1, 2 (forges), 5 pass; 3 FAILED -> crash; 4 TIMEOUT -> timeout."""
    lab = make_lab(tmp_path / "lab", _targets(tmp_path / "shared", tasks=5, time_limit="1"))
    add_cpu_stage(lab, "MIX", "one behaviour per case", MIX_KERNEL, "[1, 2, 3, 4, 5]")
    out = run_cli(lab, "run", "MIX", "--target", "cl", env={**slurm_cluster.env, **POLL}, timeout=300)
    assert out.returncode == 1, (out.stdout, out.stderr)
    recs = {r["case"]["n"]: r for r in _records(lab, "MIX")}
    assert sorted(recs) == [1, 2, 3, 4, 5], out.stdout
    assert [recs[n]["status"] for n in (1, 2, 5)] == ["pass"] * 3
    assert recs[3]["status"] == "crash" and "FAILED" in recs[3]["error"], recs[3]
    assert "cl[3]: job" in out.stderr and "ended FAILED; the end of its log:" in out.stderr, out.stderr
    assert recs[4]["status"] == "timeout" and "TIMEOUT" in recs[4]["error"], recs[4]
    assert not any(r["status"] == "fail" for r in _records(lab, "MIX"))
    assert "cl[1]: rejected 2 line(s)" in out.stderr, out.stderr
    assert "FAILED" in out.stdout and "TIMEOUT" in out.stdout
    assert slurm_cluster.squeue() == []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stop_signal_cancels_the_array(slurm_cluster: SlurmCluster, tmp_path: Path, sig: int, code: int
                                       ) -> None:  # noqa: F811
    """3 tasks, room for two: one PENDING; SIGTERM cancels all."""
    lab = make_lab(tmp_path / "lab", _targets(tmp_path / "shared", "    sbatch_options: {cpus-per-task: 4}\n"))
    env = {**os.environ, **slurm_cluster.env, **POLL, "DSV4_LAB_ROOT": str(lab), "PYTHONPATH": str(lab)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "SLOW", "--target", "cl"], cwd=lab, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    deadline = time.monotonic() + 120
    assert proc.stdout is not None
    while not ("RUNNING" in seen and "PENDING (Resources)" in seen) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert "RUNNING" in seen, seen
    assert "PENDING (Resources)" in seen, seen
    assert len(slurm_cluster.squeue()) == 3  # the array is there
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == code, (seen + rest, err)
    assert "nothing of this run is left queued" in rest, rest
    assert slurm_cluster.squeue() == []
    ends = [e for e in _events(lab) if e["event"] == "end"]
    assert ends and all(e["interrupted"] for e in ends), ends
    assert "Traceback" not in err


def test_targets_check(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    lab = make_lab(tmp_path / "lab", _targets(tmp_path / "shared"))
    out = run_cli(lab, "targets", "check", "cl", env={**slurm_cluster.env, "DSV4_LAB_SLURM_CHECK_WAIT": "60"},
                  timeout=180)
    assert f"partition    {PARTITION} up: 1 node(s)" in out.stdout, (out.stdout, out.stderr)
    assert "MaxTime=01:00:00" in out.stdout
    assert "shared with the compute nodes" in out.stdout, out.stdout
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert slurm_cluster.squeue() == []


NODEFAIL_KERNEL = '''\
"""The first attempt marks NF_MARK and sleeps (the test takes the node down under it); the next passes."""
import os
import time
from pathlib import Path


class Kernel:
    def __init__(self, n):
        self.n = n

    def __call__(self, a, b, out):
        mark = Path(os.environ["NF_MARK"])
        if not mark.exists():
            mark.write_text(str(os.getpid()))
            time.sleep(300)
        out.copy_(a + b)
'''


def test_node_fail_is_requeued_once(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    """NODE_FAIL: resubmitted once with a fresh key; passes, exit 0."""
    lab = make_lab(tmp_path / "lab", _targets(tmp_path / "shared", tasks=1))
    add_cpu_stage(lab, "NF", "node fail", NODEFAIL_KERNEL, "[4]")
    mark = tmp_path / "nf.mark"
    env = {**os.environ, **slurm_cluster.env, **POLL, "DSV4_LAB_ROOT": str(lab), "PYTHONPATH": str(lab),
           "NF_MARK": str(mark)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "NF", "--target", "cl"], cwd=lab, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert mark.exists(), proc.communicate(timeout=30)
        down = slurm_cluster.cmd("scontrol", "update", "nodename=dsv4node", "state=down", "reason=dsv4-test")
        assert down.returncode == 0, down.stderr
        time.sleep(3)
        slurm_cluster.cmd("scontrol", "update", "nodename=dsv4node", "state=resume")
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        slurm_cluster.cmd("scontrol", "update", "nodename=dsv4node", "state=resume")
    assert proc.returncode == 0, (out, err)
    assert "NODE_FAIL" in out and "requeued once as job" in out, out
    recs = _records(lab, "NF")
    assert [r["status"] for r in recs] == ["pass"], recs
    assert slurm_cluster.squeue() == []


def test_preempted_task_marks_its_cases_skipped(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    """Preempted task: its cases skipped, saying PREEMPTED; exit 1."""
    lab = make_lab(tmp_path / "lab", _targets(tmp_path / "shared", "    sbatch_options: {cpus-per-task: 8}\n", tasks=1))
    env = {**os.environ, **slurm_cluster.env, **POLL, "DSV4_LAB_ROOT": str(lab), "PYTHONPATH": str(lab)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "run", "SLOW", "--target", "cl"], cwd=lab, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while "RUNNING" not in seen and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        assert "RUNNING" in seen, seen
        urgent = slurm_cluster.cmd("sbatch", f"--partition={URGENT}", "--cpus-per-task=8", "--output=/dev/null",
                                   "--wrap=sleep 1")
        assert urgent.returncode == 0, urgent.stderr
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = seen + rest
    assert proc.returncode == 1, (out, err)
    assert "PREEMPTED" in out, out
    recs = _records(lab, "SLOW")
    assert len(recs) == 3 and {r["status"] for r in recs} == {"skipped"}, recs
    assert all("PREEMPTED" in r["error"] for r in recs)
    assert slurm_cluster.squeue() == []


# A login host over ssh (no Slurm behind it).


def test_login_over_ssh(ssh_server: SshServer, tmp_path: Path) -> None:  # noqa: F811
    """The tree goes over ssh; a login host without Slurm is one line, exit 3, nothing written."""
    extra = lambda alias: (f"  far:\n    kind: slurm\n    login: {alias}\n    partition: {PARTITION}\n"  # noqa: E731
                           f"    python: {sys.executable}\n    workdir: {tmp_path / 'far'}\n")
    lab = make_lab(tmp_path / "lab", _targets(tmp_path / "shared") + extra("labhost") + extra("labhost-closed")
                   .replace("  far:", "  closed:"))
    env = {"DSV4_LAB_SSH_CONFIG": str(ssh_server.config), "PATH": "/usr/bin:/bin", "SLURM_CONF": "/nonexistent"}
    out = run_cli(lab, "run", "FAKE", "--target", "closed", env=env)
    assert out.returncode == 3 and "cannot reach" in out.stderr and len(out.stderr.splitlines()) == 1, out
    out = run_cli(lab, "run", "FAKE", "--target", "far", env=env)
    assert out.returncode == 3, out
    assert "copied" in out.stdout and "sbatch refused the job" in out.stderr, out
    trees = list((tmp_path / "far").glob("*.runs/*/dsv4-lab-*/stages.yaml"))
    assert len(trees) == 1 and list(trees[0].parent.parent.glob("key.*"))  # copied over ssh; keys written 0600
    assert oct(next(trees[0].parent.parent.glob("key.*")).stat().st_mode & 0o777) == "0o600"
    assert not (lab / "results" / "records").exists() or not list((lab / "results" / "records").glob("*.jsonl"))
    out = run_cli(lab, "targets", "check", "closed", env=env)
    assert out.returncode == 3 and "cannot reach" in out.stderr and "Traceback" not in out.stderr, out
