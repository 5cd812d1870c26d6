"""`gate --speed --target NAME` against a real sshd and a CPU-only lab."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.notebook.records import read_records, read_runs
from harness.remote import remote_speedgate, treecopy
from harness.spec.identity import source_hash
from harness.spec.spec import load_spec
from tests.conftest import has_gpu
from tests.ssh_fixtures import SshServer, git, make_lab, run_cli, ssh_server  # noqa: F401  (fixture)
from tests.test_targets import target_yaml

PY = sys.executable

BENCH_STAGE = """\
version: 1
stages:
  FAKE:
    title: fake add on the CPU, with bench shapes
    dir: stages/fake
    kernels:
      cpu: {module: stages.fake.cpu, entry: Kernel}
    tensors: oracles.fake:tensors
    inputs: oracles.fake:make_inputs
    oracle: oracles.fake:reference
    matrix:
      n: [4, 8]
    tolerances:
      out: {cosine_min: 0.9999}
    timeout_s: 120
    bench:
      matrix:
        n: [4096]
      row_axis: n
      check_rows: 64
"""

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def speed_lab(tmp_path, monkeypatch, ssh_server: SshServer) -> Path:
    """A git lab with one speed baseline and targets `box` and `closed`."""
    monkeypatch.setenv("DSV4_LAB_SSH_CONFIG", str(ssh_server.config))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DSV4_LAB_GIT", raising=False)
    body = "version: 1\ntargets:\n" + target_yaml("box", "labhost", tmp_path / "remote work") + \
        target_yaml("closed", "labhost-closed", tmp_path / "closed work")
    lab = make_lab(tmp_path / "lab", body)
    (lab / "stages.yaml").write_text(BENCH_STAGE)
    git(lab, "commit", "-qam", "a bench block")
    commit = git(lab, "rev-parse", "--short=12", "HEAD").strip()
    src = source_hash(lab, load_spec(root=lab).stages["FAKE"], "cpu")
    (lab / "results").mkdir(exist_ok=True)
    (lab / "results" / "speed_baselines.yaml").write_text(
        f"version: 1\nspeed:\n  FAKE:\n    cpu:\n      n=4096: {{record: r1.1, src: {src}, commit: {commit}, us: 50.0, "
        f"gpu: {{name: {H100}}}}}\n")
    git(lab, "add", "results/speed_baselines.yaml")
    git(lab, "commit", "-qm", "a speed baseline")
    return lab


def _change_kernel(lab: Path) -> None:
    kernel = lab / "stages" / "fake" / "cpu.py"
    kernel.write_text(kernel.read_text() + "\nCHANGED = 1\n")


def _remote_folder(lab: Path, tmp_path: Path, work: str = "remote work") -> Path:
    return tmp_path / work / treecopy.lab_id(lab)


@pytest.mark.ssh
def test_unchanged_source_holds_without_connecting(speed_lab, tmp_path):
    r = run_cli(speed_lab, "gate", "--speed", "--target", "closed")  # unreachable: any connection would fail
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 speed baseline(s) hold" in r.stdout and "nothing to re-time on closed" in r.stdout
    assert r.stderr == "" and not (tmp_path / "closed work").exists()


@pytest.mark.ssh
def test_a_changed_kernel_ships_its_baseline_commit_and_the_targets_no_gpu_line_comes_back(speed_lab, tmp_path):
    sha = git(speed_lab, "rev-parse", "HEAD~1").strip()  # the baseline's commit
    _change_kernel(speed_lab)
    r = run_cli(speed_lab, "gate", "--speed", "--target", "box")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no GPU on this target" in r.stdout and f"{H100} (cpu)" in r.stdout and "changed source" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    folder = _remote_folder(speed_lab, tmp_path)
    rev = folder / remote_speedgate.REV_DIR / sha
    assert (rev / "stages.yaml").read_text() == BENCH_STAGE  # the commit's tree, under the work folder
    assert "CHANGED" not in (rev / "stages" / "fake" / "cpu.py").read_text()
    assert "CHANGED" in (folder / "stages" / "fake" / "cpu.py").read_text()  # beside the working tree
    assert not list(folder.glob("results/records/*.jsonl"))  # nothing recorded on the remote
    assert not (tmp_path / "remote work" / remote_speedgate.REV_DIR).exists()  # nothing outside the work folder
    assert read_records(speed_lab, ["FAKE"]) == []
    (run,) = read_runs(speed_lab).values()  # the remote run's end event, tagged
    assert run["target"] == "box" and run["interrupted"] is False


@pytest.mark.ssh
def test_a_failing_link_is_one_line_and_never_green(speed_lab):
    _change_kernel(speed_lab)
    r = run_cli(speed_lab, "gate", "--speed", "--target", "closed")
    assert r.returncode == 3, r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "closed" in r.stderr and "Traceback" not in r.stderr


FAKE_GATE = '''\
#!{py}
"""Stands in for the far side's python: holds the channel key, sends a start event, the records
below and an end event saying every baseline holds, then exits 0."""
import json
import sys

from harness.remote.channel import frame

key = sys.stdin.readline().strip()
out = sys.stdout.buffer
seq = 0


def send(obj):
    global seq
    seq += 1
    out.write(frame(key, seq, json.dumps(obj)))
    out.flush()


def rec(i, n, verdict):
    c = {{"rev": "{commit}", "commit": "{commit}", "a_us": 50.0, "b_us": 50.1, "ratio": 1.002, "lo": 0.99,
         "hi": 1.01, "verdict": verdict, "threshold": 0.03}}
    return {{"v": 1, "id": f"G1.{{i}}", "run": "G1", "t": "2026-01-01T00:00:00Z", "stage": "FAKE", "arch": "cpu",
            "case": {{"n": n}}, "status": "pass", "note": "bench", "metrics": {{"out": {{"cosine": 1.0}}}},
            "timing": {{"us": 50.1}}, "compare": c}}


send({{"v": 1, "event": "start", "run": "G1"}})
for line in {extra}:
    out.write(line.encode() + b"\\n")
send(rec(1, 4096, "{verdict}"))
for n in {unplanned}:
    send(rec(2, n, "faster"))
send({{"v": 1, "event": "end", "run": "G1", "interrupted": False,
      "lines": ["gate --speed: 1 of 1 speed baseline(s) hold (0 unchanged), 0 slower, 0 unproven"]}})
'''


def _liar(lab: Path, tmp_path: Path, verdict: str, extra: list[str], unplanned: list[int]) -> None:
    commit = git(lab, "rev-parse", "--short=12", "HEAD~1").strip()
    script = tmp_path / "fakegate"
    script.write_text(FAKE_GATE.format(py=PY, commit=commit, verdict=verdict, extra=json.dumps(extra),
                                       unplanned=unplanned))
    script.chmod(0o755)
    tfile = lab / "targets.yaml"
    tfile.write_text(tfile.read_text() + target_yaml("liar", "labhost", tmp_path / "liar work", str(script)))


@pytest.mark.ssh
@pytest.mark.parametrize("verdict, extra, unplanned, code, rejected", [
    ("no detectable change", [], [], 0, 0),  # the records prove it: the gate passes
    ("no detectable change", ['{"v": 1, "id": "X.1", "run": "G1", "stage": "FAKE"}'], [999], 1, 2),
    ("slower", [], [], 1, 0),  # remote holds; record slower
])
def test_only_authentic_planned_records_count(speed_lab, tmp_path, verdict, extra, unplanned, code, rejected):
    _change_kernel(speed_lab)
    _liar(speed_lab, tmp_path, verdict, extra, unplanned)
    r = run_cli(speed_lab, "gate", "--speed", "--target", "liar")
    assert r.returncode == code, r.stdout + r.stderr
    assert "1 of 1 speed baseline(s) hold" in r.stdout  # the remote's lines are printed
    (rec,) = read_records(speed_lab, ["FAKE"], bench=True)  # the planned one only, tagged with the target
    assert rec.case == {"n": 4096} and rec.target == "liar" and rec.compare["verdict"] == verdict
    (run,) = read_runs(speed_lab).values()  # the run, here, counts what it rejected
    assert run["target"] == "liar" and run["run"] == "G1" and run.get("rejected", 0) == rejected
    if rejected:
        assert f"liar: rejected {rejected} line(s) from the remote, none written" in r.stderr, r.stderr
        assert "not a record frame" in r.stderr
    else:
        assert "rejected" not in r.stderr
    if verdict == "slower":
        assert "liar said every speed baseline holds, but its records do not prove 1 shape(s)" in r.stdout


@pytest.mark.ssh
@pytest.mark.parametrize("args, words", [
    (["--target", "box,closed"], "gate --speed times on one target"),
    (["--target", "box", "--gpu", "1"], "give no --gpu"),
    (["--target", "box", "--staged"], "or on --target NAME): it takes none of"),
    (["--rev-tree", "abc"], "--rev-tree goes with --emit-jsonl"),
    (["--emit-jsonl", "--rev-tree", "../../etc"], "not a full commit sha"),
])
def test_usage_errors_are_one_line(speed_lab, args, words):
    r = run_cli(speed_lab, "gate", "--speed", *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and words in r.stderr, r.stdout + r.stderr


@pytest.mark.ssh
def test_an_unknown_target_says_what_run_target_says(speed_lab):
    gate = run_cli(speed_lab, "gate", "--speed", "--target", "nosuch")
    run = run_cli(speed_lab, "run", "FAKE", "--target", "nosuch")
    assert gate.returncode == run.returncode == 2, gate.stderr + run.stderr
    assert gate.stderr == run.stderr and gate.stderr.count("\n") == 1 and "no such target" in gate.stderr


def test_the_far_side_without_a_channel_key_is_one_line(tmp_path):
    lab = make_lab(tmp_path / "lab")
    r = subprocess.run([PY, "-m", "cli", "gate", "--speed", "--emit-jsonl"], cwd=lab, capture_output=True, text=True,
                       input="", env={"PATH": "/usr/bin:/bin", "DSV4_LAB_ROOT": str(lab), "PYTHONPATH": str(lab)},
                       timeout=120)
    assert r.returncode == 2 and "no channel key on stdin" in r.stderr and r.stdout == "", r.stdout + r.stderr


@pytest.mark.skipif(has_gpu(), reason="the no-GPU answer")
def test_compare_takes_a_shipped_tree_where_there_is_no_git(fake_lab, tmp_path, capsys):
    """No .git there: `bench --compare` takes the sent tree and its sha; unsent: one line."""
    from harness.execution import abbench
    from harness.execution.bench import BenchError
    from tests.test_bench import LAB

    (fake_lab / "stages.yaml").write_text(LAB)
    rev = tmp_path / "rev"
    shutil.copytree(fake_lab, rev, ignore=shutil.ignore_patterns(".git"))
    shutil.rmtree(fake_lab / ".git")
    st = load_spec(root=fake_lab).stages["OK"]
    sha = "ab" * 20
    assert abbench.main(fake_lab, st, [], sha[:12], rev_tree=(sha, rev)) == 1
    out = capsys.readouterr().out
    assert f"{sha[:12]} ({sha[:12]}): its stages.yaml, stages/ and oracles/ as sent, in {rev}" in out
    assert "no GPU here: nothing was timed" in out
    with pytest.raises(BenchError, match="its tree was not sent"):
        abbench.main(fake_lab, st, [], sha[:12], rev_tree=(sha, tmp_path / "nothing"))


@pytest.mark.parametrize("name", remote_speedgate.SPEED_FILES)
def test_a_speed_file_git_ignores_still_travels(tmp_path, name):
    lab = tmp_path / "lab"
    (lab / "results").mkdir(parents=True)
    (lab / ".gitignore").write_text("results/speed_baselines.yaml*\n")
    (lab / name).write_bytes(b"the speed baselines")
    subprocess.run(["git", "init", "-q"], cwd=lab, check=True)
    snap = remote_speedgate._tree(lab, {}, tmp_path / "out")
    assert name in snap.files and (tmp_path / "out" / name).read_bytes() == b"the speed baselines"
