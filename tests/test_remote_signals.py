"""Ctrl-C on a remote run (exit 130) and a relative workdir, real sshd."""

import dataclasses
import os
import signal
import subprocess
from pathlib import Path

import pytest

from harness.remote import remote_run, treecopy
from harness.notebook.records import read_records, read_runs
from harness.remote.targets import load_targets
from tests.ssh_fixtures import make_lab, ssh_server  # noqa: F401  (fixture)
from tests.test_targets import (PY, assert_gone, descendants, kill_all, remote_lab, remote_sides,  # noqa: F401
                                target_yaml)


def _start_remote_run(lab: Path, ssh_server, tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "DSV4_LAB_ROOT": str(lab), "PYTHONPATH": str(lab),
           "DSV4_LAB_SSH_CONFIG": str(ssh_server.config), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    env.pop("DSV4_LAB_GIT", None)
    return subprocess.Popen([PY, "-m", "cli", "run", *args], cwd=lab, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.ssh
def test_ctrl_c_on_a_remote_run_is_130_and_interrupted_not_a_lost_link(remote_lab, ssh_server, tmp_path):
    proc = _start_remote_run(remote_lab, ssh_server, tmp_path, "SLOW", "--target", "box")
    remote: list[int] = []
    try:
        remote = remote_sides(proc, 120, b"harness.remote.remote_side\0run\0SLOW")  # with its worker up
        assert remote, "the remote run never started"
        workers = set().union(*(descendants(pid) for pid in remote))
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C signals the foreground group
        out, err = proc.communicate(timeout=60)
        text = out.decode() + err.decode()
        assert proc.returncode == 130, text
        assert "link dropped" not in text and "ssh exit 255" not in text and "Traceback" not in text
        (run,) = read_runs(remote_lab).values()
        assert run["event"] == "end" and run["interrupted"] is True and "interrupted here (Ctrl-C)" in run["lost"]
        assert_gone([*remote, *workers])
    finally:
        kill_all(proc, remote)


@pytest.mark.ssh
def test_ctrl_c_before_the_remote_run_starts_does_not_blame_python(remote_lab, ssh_server, tmp_path):
    """Ctrl-C while the target's `python` starts slowly is an interruption (130)."""
    (remote_lab / "targets.yaml").write_text("version: 1\ntargets:\n" + target_yaml(
        "slowstart", "labhost", tmp_path / "remote work", python=f"sleep 60; {PY}"))
    proc = _start_remote_run(remote_lab, ssh_server, tmp_path, "FAKE", "--target", "slowstart")
    shell: list[int] = []
    try:
        # the remote `sleep 60` is running
        shell = remote_sides(proc, 60, b"harness.remote.remote_side", str(tmp_path).encode())
        assert shell, "the remote command never started"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        text = out.decode() + err.decode()
        assert proc.returncode == 130, text
        assert "check `python`" not in text and "link dropped" not in text, text
        assert "interrupted here before the run started" in text
        assert read_records(remote_lab, ["FAKE"]) == []
    finally:
        kill_all(proc, [*shell, *(p for pid in shell for p in descendants(pid))])  # the remote `sleep 60`, here


def test_a_relative_workdir_is_in_the_remote_home(tmp_path, monkeypatch):
    """`workdir: work` means ~/work: the remote cds into it and names it the root."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    lab = make_lab(tmp_path / "lab", "version: 1\ntargets:\n" + target_yaml("rel", "labhost", "work"))
    t = load_targets(lab)["rel"]
    assert t.workdir == "~/work"
    home = tmp_path / "home"
    folder = home / "work" / treecopy.lab_id(lab)
    folder.mkdir(parents=True)
    t = dataclasses.replace(t, python="sh -c 'echo \"$PWD|$DSV4_LAB_ROOT\"' where")
    cmd = remote_run.remote_run_command(t, lab, ["run", "FAKE", "--emit-jsonl"])
    r = subprocess.run(["sh", "-c", cmd], cwd=home, env={"HOME": str(home), "PATH": os.environ["PATH"]},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    pwd, root = r.stdout.strip().split("|")
    assert Path(pwd).resolve() == folder.resolve()
    assert os.path.isabs(root) and Path(root).resolve() == folder.resolve(), root
