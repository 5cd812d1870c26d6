"""SSH targets: targets.yaml validation, ssh argv and quoting, remote runs on a real sshd."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib import metadata
from io import BytesIO
from pathlib import Path

import pytest

from harness.remote import remote_run, target_check, targets, treecopy
from harness.spec.matrix import expand
from harness.core.jsonl import MAX_LINE_BYTES
from harness.notebook.records import read_records, read_runs
from harness.remote.channel import Receiver, new_key
from harness.spec.spec import load_spec
from harness.remote.remote_run import parse_payload, read_lines, remote_run_args
from harness.remote.ssh import explain_ssh_failure, remote_path, ssh_argv
from harness.remote.targets import Target, TargetError, load_targets, load_targets_file
from tests.ssh_fixtures import SshServer, make_lab, run_cli, ssh_server  # noqa: F401  (fixture)

PY = sys.executable


# targets.yaml: validation (no ssh needed).


def write_targets(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def lab_dir(tmp_path, monkeypatch) -> Path:
    """An empty lab folder; the user targets file under tmp."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DSV4_LAB_SSH_CONFIG", raising=False)
    lab = tmp_path / "lab"
    lab.mkdir()
    return lab


GOOD = """\
version: 1
targets:
  b200:
    ssh: me@b200.example.org
    port: 2222
    workdir: ~/dsv4 work
    python: source ~/venv/bin/activate && python
    gpus: [0, 1]
    ssh_options:
      ConnectTimeout: 7
      ServerAliveInterval: 20
      Compression: true
"""


def test_good_file_loads(lab_dir):
    write_targets(lab_dir / "targets.yaml", GOOD)
    t = load_targets(lab_dir)["b200"]
    assert (t.ssh, t.port, t.workdir, t.gpus) == ("me@b200.example.org", 2222, "~/dsv4 work", (0, 1))
    assert t.python == "source ~/venv/bin/activate && python"
    assert t.ssh_options == (("ConnectTimeout", "7"), ("ServerAliveInterval", "20"), ("Compression", "yes"))
    assert t.declared == "targets.yaml:3"


def test_the_shipped_example_is_valid_and_declares_nothing():
    root = Path(__file__).resolve().parents[1]
    assert load_targets_file(root / "targets.yaml", "targets.yaml") == {}


def test_user_file_overrides_lab_entry_by_name(lab_dir, tmp_path):
    write_targets(lab_dir / "targets.yaml", GOOD)
    write_targets(tmp_path / "xdg" / "dsv4-lab" / "targets.yaml", """\
        targets:
          b200:
            ssh: b200-alias
            workdir: /scratch/me
            python: /opt/venv/bin/python
          mine:
            ssh: h100
            workdir: w
            python: python3
        """)
    ts = load_targets(lab_dir)
    assert ts["b200"].ssh == "b200-alias" and ts["b200"].port is None
    assert ts["b200"].overrides == "targets.yaml:3"
    assert ts["b200"].declared.endswith("dsv4-lab/targets.yaml:2")
    assert set(ts) == {"b200", "mine"}


@pytest.mark.parametrize("body, key, words", [
    ("    password: hunter2\n", "password:", ["ssh key", "ssh-agent"]),
    ("    ssh_options: {PasswordAuthentication: 'yes'}\n", "ssh_options.PasswordAuthentication:", ["ssh key", "ssh-agent"]),
    ("    ssh_options: {StrictHostKeyChecking: 'no'}\n", "ssh_options.StrictHostKeyChecking:", ["known_hosts"]),
    ("    ssh_options: {UserKnownHostsFile: /dev/null}\n", "ssh_options.UserKnownHostsFile:", ["known_hosts"]),
    ("    ssh_options: {ProxyCommand: nc}\n", "ssh_options.ProxyCommand:", ["ssh/config"]),
    ("    ssh_options: {ForwardAgent: 'yes'}\n", "ssh_options.ForwardAgent:", ["allowed"]),
    ("    colour: red\n", "colour:", ["unknown key", "allowed"]),
    ("    gpus: [0, 0]\n", "gpus:", ["repeated"]),
    ("    port: 70000\n", "port:", ["port"]),
    ("    api_token: abc\n", "api_token:", ["secret"]),
])
def test_bad_entries_are_one_line_with_file_line_key(lab_dir, body, key, words):
    write_targets(lab_dir / "targets.yaml", """\
        version: 1
        targets:
          b200:
            ssh: b200
            workdir: /w
            python: python
        # the key under test is the next line (8)
        """ + body)
    with pytest.raises(TargetError) as exc:
        load_targets(lab_dir)
    msg = str(exc.value)
    assert msg.startswith(f"targets.yaml:8: targets.b200.{key}"), msg
    assert "\n" not in msg and " — " in msg
    for w in words:
        assert w in msg, msg
    assert "hunter2" not in msg


@pytest.mark.parametrize("key, value, words", [
    ("python", "sshpass -p hunter2 python", ["secret", "ssh-agent"]),
    ("python", "HF_TOKEN=abcdef python", ["secret"]),
    ("ssh", "me:hunter2@host", ["secret"]),
    ("ssh", "-oProxyCommand=x", ["alias"]),
    ("ssh", "host:22", ["port"]),
    ("workdir", "~other/w", ["~user"]),
    ("workdir", "../up", [".."]),
])
def test_bad_values(lab_dir, key, value, words):
    fields = {"ssh": "b200", "workdir": "/w", "python": "python", key: value}
    body = "".join(f"    {k}: {json.dumps(v)}\n" for k, v in fields.items())
    write_targets(lab_dir / "targets.yaml", "targets:\n  b200:\n" + body)
    with pytest.raises(TargetError) as exc:
        load_targets(lab_dir)
    msg = str(exc.value)
    line = 3 + list(fields).index(key)
    assert msg.startswith(f"targets.yaml:{line}: targets.b200.{key}:"), msg
    assert "hunter2" not in msg and "abcdef" not in msg
    for w in words:
        assert w in msg, msg


def test_missing_key_and_bad_yaml(lab_dir):
    write_targets(lab_dir / "targets.yaml", "targets:\n  b200:\n    ssh: b200\n    python: python\n")
    with pytest.raises(TargetError, match=r"^targets.yaml:3: targets.b200.workdir: missing required key"):
        load_targets(lab_dir)
    write_targets(lab_dir / "targets.yaml", "targets:\n  b200: [\n")
    with pytest.raises(TargetError, match=r"^targets.yaml:\d+: not valid YAML"):
        load_targets(lab_dir)
    write_targets(lab_dir / "targets.yaml", "targets:\n  local:\n    ssh: x\n    workdir: w\n    python: p\n")
    with pytest.raises(TargetError, match=r"^targets.yaml:2: targets.local:"):
        load_targets(lab_dir)


def test_cli_prints_one_line_and_exits_2(tmp_path):
    lab = make_lab(tmp_path / "lab", "targets:\n  b200:\n    ssh: b200\n    password: x\n")
    out = run_cli(lab, "targets", "list", env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith("dsv4-lab: targets.yaml:4: targets.b200.password:")
    assert len(out.stderr.strip().splitlines()) == 1
    out = run_cli(lab, "run", "FAKE", "--target", "nowhere", env={"XDG_CONFIG_HOME": str(tmp_path / "xdg")})
    assert out.returncode == 2 and "targets.yaml:4" in out.stderr


def yaml_bomb(levels: int = 9, width: int = 9) -> str:
    """A billion-laughs document."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", ["lab top", "lab in a target", "user file"])
def test_yaml_bomb_in_targets_is_refused_fast(lab_dir, tmp_path, where):
    bomb = yaml_bomb()
    if where == "lab top":
        path, text = lab_dir / "targets.yaml", bomb + "targets:\n"
    elif where == "lab in a target":
        path, text = lab_dir / "targets.yaml", bomb + "targets:\n  box: {ssh: b, workdir: w, python: p, gpus: *l8}\n"
    else:
        path, text = tmp_path / "xdg" / "dsv4-lab" / "targets.yaml", bomb
    write_targets(path, text)
    t0 = time.monotonic()
    with pytest.raises(TargetError) as exc:
        load_targets(lab_dir)
    assert time.monotonic() - t0 < 1.0
    msg = str(exc.value)
    assert "\n" not in msg and "alias" in msg and ".yaml:" in msg, msg


def test_yaml_bomb_in_targets_is_one_line_for_every_command(tmp_path):
    lab = make_lab(tmp_path / "lab", yaml_bomb() + "targets:\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    for args in (("targets", "list"), ("targets", "check", "box"), ("run", "FAKE", "--target", "box")):
        t0 = time.monotonic()
        out = run_cli(lab, *args, env=env, timeout=60)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert out.stderr.startswith("dsv4-lab: targets.yaml:") and len(out.stderr.strip().splitlines()) == 1
        assert time.monotonic() - t0 < 30, args  # (the interpreter's own start-up included)


def test_unknown_target_is_a_target_error(lab_dir):
    write_targets(lab_dir / "targets.yaml", GOOD)
    with pytest.raises(TargetError, match="--target h100: no such target"):
        targets.resolve_targets(lab_dir, "b200,h100")
    with pytest.raises(TargetError, match="local"):
        targets.resolve_targets(lab_dir, "b200,local")


# ssh argv and remote command.


def _target(**kw) -> Target:
    base = dict(name="box", ssh="me@host", workdir="/w", python="python")
    return Target(**{**base, **kw})


def test_ssh_argv_is_safe(monkeypatch):
    monkeypatch.delenv("DSV4_LAB_SSH_CONFIG", raising=False)
    argv = ssh_argv(_target(port=2222, ssh_options=(("ConnectTimeout", "3"),)), "true")
    joined = " ".join(argv)
    assert "BatchMode=yes" in joined and "-p 2222" in joined
    assert argv.index("ConnectTimeout=3") < argv.index("ConnectTimeout=10")  # ssh: first value wins
    assert "StrictHostKeyChecking" not in joined and "/dev/null" not in joined
    assert argv[-3:] == ["--", "me@host", "true"]


def test_ssh_config_env(monkeypatch, tmp_path):
    cfg = tmp_path / "my ssh config"
    cfg.write_text("")
    monkeypatch.setenv("DSV4_LAB_SSH_CONFIG", str(cfg))
    argv = ssh_argv(_target(), "true")
    assert argv[1:3] == ["-F", str(cfg)]
    monkeypatch.setenv("DSV4_LAB_SSH_CONFIG", str(tmp_path / "missing"))
    with pytest.raises(TargetError, match="DSV4_LAB_SSH_CONFIG"):
        ssh_argv(_target(), "true")


@pytest.mark.parametrize("path", ["/a b/c;d$(touch x)`y`'z\"", "~/w d;$(x)", "rel dir/x", "~"])
def test_remote_path_quoting_survives_a_shell(path, tmp_path):
    out = subprocess.run(["sh", "-c", f"printf %s {remote_path(path)}"], capture_output=True, text=True,
                         env={"HOME": "/home/me", "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    expected = "/home/me" + path[1:] if path.startswith("~") else path
    assert out.stdout == expected
    assert not (tmp_path / "x").exists()


def test_remote_run_args():
    t = _target(gpus=(0, 1))
    args = remote_run_args(["run", "FAKE", "--target", "a,b", "--hd", "512", "--target=x"], t, (1, 2))
    assert args == ["run", "FAKE", "--hd", "512", "--shard", "1/2", "--gpus", "0,1", "--emit-jsonl"]
    args = remote_run_args(["run", "--all", "--gpus", "3", "--target", "box"], t, None)
    assert args == ["run", "--all", "--gpus", "3", "--emit-jsonl"]


def test_remote_run_command_quotes_every_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_LAB_GIT", "abc123:1")  # git_state reads it first
    t = _target(workdir="/w d;$(x)")
    cmd = remote_run.remote_run_command(t, tmp_path, ["run", "FAKE", "--where", "n=4; rm -rf /"])
    assert "'n=4; rm -rf /'" in cmd
    assert cmd.startswith("cd '/w d;$(x)/dsv4-lab-")
    assert "DSV4_LAB_GIT=abc123:1" in cmd
    assert cmd.endswith("; exit $?")
    words = shlex.split(cmd.split(" && ")[-1].removesuffix("; exit $?"))
    assert words[:3] == ["python", "-m", "harness.remote.remote_side"] and words[-1] == "n=4; rm -rf /"


def test_read_lines_bounds_every_line():
    big = b"x" * (MAX_LINE_BYTES + 10)
    stream = BytesIO(b"ok\n" + big + b"\nafter\npartial")
    got = list(read_lines(stream, MAX_LINE_BYTES))
    assert got[0] == (b"ok", None)
    assert got[1][0] is None and "longer than" in got[1][1]
    assert got[2] == (b"after", None)
    assert got[3][0] is None and "incomplete" in got[3][1]


def test_parse_payload_rejects_bad_records():
    good = {"v": 1, "id": "R.1", "run": "R", "t": "2026-01-01T00:00:00Z", "stage": "FAKE", "arch": "cpu",
            "case": {"n": 4}, "status": "pass",
            "compile": {"key": "abc", "s": 0.5, "cached": True, "regs": 40, "inv": {"mma": 4}},
            "env": {"gpu": "NVIDIA H200", "cc": "9.0", "cpus": 16, "host": "b200-1"},
            "code": {"commit": "0123456789ab", "dirty": False, "src": "f" * 16}}
    assert parse_payload(json.dumps(good).encode(), {"FAKE"})[0] == "record"
    for bad, why in [
        (b"{nope", "not JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[" * 100000, "not JSON"),
        (json.dumps({**good, "stage": "../../etc"}).encode(), "unknown stage"),
        (json.dumps({**good, "status": "great"}).encode(), "unknown status"),
        (json.dumps({**good, "metrics": [1]}).encode(), "metrics"),
        (json.dumps({**good, "timing": {"us": 1.0, "peer_us": "fast"}}).encode(), "timing.peer_us"),
        (b'{"v": 1, "cosine": NaN}', "non-finite"),
        (json.dumps({"event": "boom", "run": "R"}).encode(), "control event"),
        (json.dumps({**good, "status": "\x1b[2J"}).encode(), "\\x1b"),
        (json.dumps({**good, "t": "[/red]"}).encode(), "UTC time"),
        (json.dumps({**good, "t": "2026-01-01T00:00:00Z\n"}).encode(), "UTC time"),
        (json.dumps({**good, "compile": {"regs": "[/x]"}}).encode(), "compile.regs is not a number"),
        (json.dumps({**good, "compile": {"inv": {"mma": "4"}}}).encode(), "compile.inv"),
        (json.dumps({**good, "compile": {"note": "a\x1b[2Jb"}}).encode(), "compile.note"),
        (json.dumps({**good, "code": {"commit": "[/x]"}}).encode(), "code.commit"),
        (json.dumps({**good, "code": {"commit": "abc123", "dirty": "yes"}}).encode(), "code.dirty"),
        (json.dumps({**good, "env": {"gpu": "H100\x1b]0;x\x07"}}).encode(), "env.gpu"),
        (json.dumps({**good, "env": {"gpu": {"deep": {"er": 1}}}}).encode(), "env.gpu"),
        (b'{"v": 1, "id": "R.1", "run": "R", "t": "2026-01-01T00:00:00Z", "stage": "FAKE", "arch": "cpu", '
         b'"case": {"n": 4}, "status": "pass", "compile": {"s": 1e999}}', "compile.s"),
    ]:
        kind, reason = parse_payload(bad, {"FAKE"})
        assert kind == "reject" and why in reason, (bad[:40], reason)
        assert "\x1b" not in reason


def test_explain_ssh_failure():
    t = _target(ssh="gpu", port=None)
    changed = "@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\nHost key verification failed.\n"
    msg = explain_ssh_failure(t, changed)
    assert "host key mismatch" in msg and "known_hosts" in msg and "Never disable" in msg
    assert "StrictHostKeyChecking=no" not in msg
    assert "authentication failed" in explain_ssh_failure(t, "me@gpu: Permission denied (publickey).")
    assert "cannot reach gpu" in explain_ssh_failure(t, "ssh: connect to host gpu port 22: Connection refused")


# rsync if both sides have it, else tar.


@pytest.fixture
def fake_sync(monkeypatch):
    """treecopy with probe and copiers recorded."""
    calls: list[str] = []
    state = {"remote": True, "local": "/usr/bin/rsync", "rsync_fails": False}

    def rsync(t, root, files, source=None):
        calls.append("rsync")
        if state["rsync_fails"]:
            raise treecopy.RsyncFailed(f"{t.name}: rsync failed (exit 12): protocol version mismatch")

    monkeypatch.setattr(treecopy, "tree_files", lambda root: ["a.py"])
    monkeypatch.setattr(treecopy, "probe_remote", lambda t, root: state["remote"])
    monkeypatch.setattr(treecopy, "local_rsync", lambda: state["local"])
    monkeypatch.setattr(treecopy, "sync_rsync", rsync)
    monkeypatch.setattr(treecopy, "sync_tar", lambda t, root, files, source=None: calls.append("tar"))
    return state, calls


@pytest.mark.parametrize("remote, local, fails, method, why", [
    (True, "/usr/bin/rsync", False, "rsync", ""),
    (True, None, False, "tar", "no rsync here"),
    (False, "/usr/bin/rsync", False, "tar", "no rsync on box"),
    (False, None, False, "tar", "no rsync on box"),
    (True, "/usr/bin/rsync", True, "tar", "rsync failed (exit 12)"),
])
def test_sync_falls_back_to_tar(fake_sync, tmp_path, remote, local, fails, method, why):
    state, calls = fake_sync
    state.update(remote=remote, local=local, rsync_fails=fails)
    res = treecopy.sync_tree(_target(), tmp_path)
    assert res.method == method and why in res.why
    assert calls == (["rsync", "tar"] if fails else [method])


def test_rsync_missing_here_is_a_link_error_not_a_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(treecopy, "local_rsync", lambda: None)
    with pytest.raises(treecopy.RsyncFailed, match="rsync is not installed here"):
        treecopy.sync_rsync(_target(), tmp_path, ["a.py"])


# Against a real sshd on 127.0.0.1.


def target_yaml(name: str, host: str, workdir: Path | str, python: str = PY, extra: str = "") -> str:
    return (f"  {name}:\n    ssh: {host}\n    workdir: {json.dumps(str(workdir))}\n"
            f"    python: {json.dumps(python)}\n{extra}")


@pytest.fixture
def remote_lab(tmp_path, monkeypatch, ssh_server: SshServer):
    """A git lab whose targets.yaml declares targets on the test sshd."""
    monkeypatch.setenv("DSV4_LAB_SSH_CONFIG", str(ssh_server.config))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DSV4_LAB_GIT", raising=False)
    work = tmp_path / "remote work"
    body = "version: 1\ntargets:\n" + "".join([
        target_yaml("box", "labhost", work),
        target_yaml("box2", "labhost", tmp_path / "remote two", extra=f"    port: {ssh_server.port}\n"),
        target_yaml("badkey", "labhost-badkey", work),
        target_yaml("unknownkey", "labhost-unknown", work),
        target_yaml("noauth", "labhost-noauth", work),
        target_yaml("closed", "labhost-closed", work),
        target_yaml("odd", "labhost", tmp_path / "w d;touch pwned;$(touch pwned2)`touch pwned3`"),
    ])
    lab = make_lab(tmp_path / "lab", body)
    (lab / "notes.txt").write_text("untracked, not ignored: copied\n")
    (lab / "local.log").write_text("ignored: never copied\n")
    return lab


def run_remote(lab: Path, stage: str, target: str, **kw) -> int:
    spec = load_spec(root=lab)
    st = spec.stage(stage)
    argv = ["run", stage, "--target", target]
    return remote_run.run_remote(spec, target, argv, [st], None, {st.id: expand(st)}, **kw)


def records_of(lab: Path, stage: str) -> list[dict]:
    return read_records(lab, [stage])


@pytest.mark.ssh
@pytest.mark.parametrize("method", [
    None,
    pytest.param("rsync", marks=pytest.mark.skipif(shutil.which("rsync") is None,
                                                   reason="rsync is not installed here: the copy goes by tar")),
    pytest.param("tar", marks=pytest.mark.skipif(shutil.which("rsync") is None,
                                                 reason="without rsync here the automatic copy (None) is by tar")),
])
def test_full_round_trip(remote_lab, tmp_path, capsys, method):
    lab = remote_lab
    folder = tmp_path / "remote work" / treecopy.lab_id(lab)
    folder.mkdir(parents=True)
    (folder / "stale.py").write_text("left from an older sync\n")
    shipped = treecopy.tree_files(lab)
    code = run_remote(lab, "FAKE", "box", sync_method=method)
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    recs = records_of(lab, "FAKE")
    assert [r.case["n"] for r in recs] == [4, 8, 16]
    assert all(r.target == "box" and r.status == "pass" and r.arch == "cpu" for r in recs)
    assert all(r.code["commit"] and r.code["dirty"] is True for r in recs)  # notes.txt is untracked
    runs = read_runs(lab)
    assert len(runs) == 1
    (run,) = runs.values()
    assert run["target"] == "box" and run["interrupted"] is False and run["counts"] == {"pass": 3}
    assert "rejected" not in run
    # exactly what git would commit
    on_remote = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert on_remote == sorted(shipped)
    assert "notes.txt" in on_remote and "local.log" not in on_remote and "stale.py" not in on_remote
    assert not any("__pycache__" in p for p in on_remote)
    used = method or ("rsync" if shutil.which("rsync") else "tar")  # this machine is also the remote
    assert "box" in out.out and f"copied {len(shipped)} file(s) by {used}" in out.out
    assert "records: results/records/FAKE.jsonl" in out.out


@pytest.mark.ssh
def test_remote_without_rsync_is_copied_by_tar(remote_lab, tmp_path, monkeypatch):
    """No remote rsync: the local one is never called; tar."""
    if shutil.which("rsync", path="/usr/local/bin:/usr/bin:/bin"):
        pytest.skip("rsync is installed on the test remote (this machine)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "rsync-called"
    fake = bin_dir / "rsync"
    fake.write_text(f"#!/bin/sh\ntouch {shlex.quote(str(marker))}\nexit 12\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    t = targets.resolve_targets(remote_lab, "box")[0]
    res = treecopy.sync_tree(t, remote_lab)
    assert res.method == "tar" and res.why == "no rsync on box" and not marker.exists()
    folder = tmp_path / "remote work" / treecopy.lab_id(remote_lab)
    assert (folder / "stages.yaml").is_file() and (folder / "notes.txt").is_file()


@pytest.mark.ssh
def test_cli_run_and_split_across_two_targets(remote_lab, ssh_server):
    env = {"DSV4_LAB_SSH_CONFIG": str(ssh_server.config)}
    out = run_cli(remote_lab, "run", "FAKE", "--target", "box,box2", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    recs = records_of(remote_lab, "FAKE")
    by_target = {t: sorted(r.case["n"] for r in recs if r.target == t) for t in ("box", "box2")}
    assert by_target == {"box": [4, 16], "box2": [8]}
    runs = read_runs(remote_lab)
    assert sorted(r.get("shard") for r in runs.values()) == ["0/2", "1/2"]


@pytest.mark.ssh
def test_host_key_mismatch_is_refused(remote_lab, capsys):
    assert run_remote(remote_lab, "FAKE", "badkey") == 3
    err = capsys.readouterr().err
    assert "host key mismatch" in err and "known_hosts" in err
    assert "StrictHostKeyChecking=no" not in err
    assert records_of(remote_lab, "FAKE") == []
    assert target_check.check_cmd(remote_lab, "badkey") == 3
    err = capsys.readouterr().err
    assert "host key mismatch" in err and len(err.strip().splitlines()) == 1


@pytest.mark.ssh
def test_unknown_host_key_and_auth_failure(remote_lab, capsys):
    assert target_check.check_cmd(remote_lab, "unknownkey") == 3
    assert "not in your known_hosts" in capsys.readouterr().err
    assert target_check.check_cmd(remote_lab, "noauth") == 3
    err = capsys.readouterr().err
    assert "authentication failed" in err and "ssh-agent" in err


@pytest.mark.ssh
def test_unreachable_host_fails_fast(remote_lab, capsys):
    t0 = time.monotonic()
    assert run_remote(remote_lab, "FAKE", "closed") == 3
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Connection refused" in err
    assert target_check.check_cmd(remote_lab, "closed") == 3


@pytest.mark.ssh
def test_remote_crash_keeps_records_received(remote_lab, capsys):
    code = run_remote(remote_lab, "CRASH", "box")
    out = capsys.readouterr()
    assert code == 3, out.out + out.err
    recs = records_of(remote_lab, "CRASH")
    assert [r.case["n"] for r in recs] == [4] and recs[0].target == "box"
    (run,) = read_runs(remote_lab).values()
    assert run["interrupted"] is True and "exit code 137, SIGKILL" in run["lost"]
    assert "marked interrupted" in out.err


@pytest.mark.ssh
def test_stopping_a_remote_run_here_stops_it_there(remote_lab, ssh_server, tmp_path):
    """SIGTERM here: exit 143; the remote run and worker stop too."""
    sig, code = signal.SIGTERM, 143
    env = {**os.environ, "DSV4_LAB_ROOT": str(remote_lab), "PYTHONPATH": str(remote_lab),
           "DSV4_LAB_SSH_CONFIG": str(ssh_server.config), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    env.pop("DSV4_LAB_GIT", None)
    proc = subprocess.Popen([PY, "-m", "cli", "run", "SLOW", "--target", "box"], cwd=remote_lab, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    remote = []
    try:
        remote = remote_sides(proc, 90, b"harness.remote.remote_side\0run\0SLOW")  # with its worker up
        assert remote, "the remote run never started"
        workers = set().union(*(descendants(pid) for pid in remote))
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == code, out.decode() + err.decode()
        assert b"Traceback" not in out + err
        (run,) = read_runs(remote_lab).values()
        assert run["interrupted"] is True and "interrupted here" in run["lost"]
        assert_gone([*remote, *workers])
    finally:
        kill_all(proc, remote)


def _pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def remote_sides(proc, seconds: float, *marks: bytes) -> list[int]:
    """Pids with every mark and a child, polled until found or timeout."""
    found, deadline = [], time.monotonic() + seconds
    while not found and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
        found = [pid for pid in _pids() if all(m in _cmdline(pid) for m in marks) and descendants(pid)]
    return found


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "the remote run outlived the local one"


def kill_all(proc, pids) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


FAKE_REMOTE = '''\
#!{py}
"""Stands in for the remote python: holds the channel key (it reads it on stdin like the real
remote side), yet sends lines that must be rejected around one good record."""
import json
import sys

from harness.remote.channel import frame

key = sys.stdin.readline().strip()
out = sys.stdout.buffer
seq = 0


def send(obj):
    global seq
    seq += 1
    data = frame(key, seq, json.dumps(obj))
    out.write(data)
    out.flush()
    return data


def rec(i, n, stage="FAKE", run="R1"):
    return {{"v": 1, "id": f"{{run}}.{{i}}", "run": run, "t": "2026-01-01T00:00:00Z", "stage": stage,
            "arch": "cpu", "case": {{"n": n}}, "status": "pass", "metrics": {{"out": {{"cosine": 1.0}}}}}}


out.write(b"a login banner, not json {{\\n")
send({{"v": 1, "event": "start", "run": "R1", "cases": 2}})
out.write(b"@@dsv4-rec 3 " + b"x" * 70000 + b"\\n")
send(rec(1, 4, stage="../../evil"))
send(rec(2, 999))  # not in the matrix
send(rec(3, 8))  # in the matrix, but planned for the other shard
send(rec(1, 4, run="R2"))  # another run
good = send(rec(4, 4))
send(rec(5, 4))  # the same case again
out.write(good)  # a replay of an authentic frame
out.write(frame("0" * 64, seq + 1, json.dumps(rec(6, 16))))  # a frame under another key
send({{"v": 1, "event": "end", "run": "R1", "interrupted": False, "counts": {{"pass": 1}}}})
'''


def _add_liar(remote_lab, tmp_path) -> None:
    """Target `liar`: labhost, with FAKE_REMOTE as its python."""
    script = tmp_path / "fakepy"
    script.write_text(FAKE_REMOTE.format(py=PY))
    script.chmod(0o755)
    tfile = remote_lab / "targets.yaml"
    tfile.write_text(tfile.read_text() + target_yaml("liar", "labhost", tmp_path / "liar", str(script)))


@pytest.mark.ssh
def test_lines_outside_the_run_and_its_plan_are_rejected(remote_lab, tmp_path, capsys):
    _add_liar(remote_lab, tmp_path)
    code = run_remote(remote_lab, "FAKE", "liar", shard=(0, 2))  # plans n = 4 and n = 16
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    recs = records_of(remote_lab, "FAKE")
    assert len(recs) == 1 and recs[0].id == "R1.4" and recs[0].target == "liar" and recs[0].case == {"n": 4}
    assert "rejected 9 line(s)" in out.err and "line 1: not a record frame" in out.err
    assert "1 of 2 planned case(s) never arrived" in out.err
    assert not (tmp_path / "evil.jsonl").exists() and not list(tmp_path.rglob("evil.jsonl"))
    (run,) = read_runs(remote_lab).values()
    assert run["rejected"] == 9 and run["interrupted"] is False and run["run"] == "R1"


@pytest.mark.parametrize("lines, why, written", [
    (["start", "rec:R1.1:4", "rec:R1.2:999"], "not planned", 1),
    (["start", "rec:R1.1:4", "rec:R1.2:4"], "a second record", 1),
    (["start", "rec:R9.1:8"], "another run", 0),
    (["rec:R1.1:4"], "before the run's start", 0),
    (["start", "end", "rec:R1.1:4"], "after the run's end", 0),
    (["start", "start"], "a second start", 0),
])
def test_session_rejects_records_outside_the_run(tmp_path, lines, why, written):
    from harness.remote.remote_run import TargetRun, _Session, case_key

    lab = make_lab(tmp_path / "lab")
    spec = load_spec(root=lab)
    tr = TargetRun(_target(), None, {case_key("FAKE", "cpu", {"n": n}) for n in (4, 8, 16)})
    session = _Session(spec, [tr], ["run", "FAKE"])
    for line in lines:
        if line in ("start", "end"):
            session.on_line(tr, "event", {"v": 1, "event": line, "run": "R1", "interrupted": False})
        else:
            _, rid, n = line.split(":")
            session.on_line(tr, "record", {"v": 1, "id": rid, "run": rid.split(".")[0], "t": "x", "stage": "FAKE",
                                           "arch": "cpu", "case": {"n": int(n)}, "status": "pass"})
    session.close()
    assert tr.rejected == 1 and why in tr.first_reject, tr.first_reject
    assert len(read_records(lab, ["FAKE"])) == written


@pytest.mark.ssh
def test_unwritable_results_stop_the_run_in_one_line(remote_lab, tmp_path, capsys):
    _add_liar(remote_lab, tmp_path)
    (remote_lab / "results").mkdir(exist_ok=True)
    (remote_lab / "results" / "records").write_text("a file where the records folder belongs\n")
    code = run_remote(remote_lab, "FAKE", "liar", shard=(0, 2))
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    assert "cannot write" in out.err and "FAKE.jsonl" in out.err and "Traceback" not in out.err + out.out
    (run,) = read_runs(remote_lab).values()
    assert run["interrupted"] is True and "cannot write" in run["lost"]


def test_session_record_ids_and_unwritable_results(tmp_path):
    from harness.remote.remote_run import LocalWriteError, TargetRun, _Session, case_key

    lab = make_lab(tmp_path / "lab")
    spec = load_spec(root=lab)
    tr = TargetRun(_target(), None, {case_key("FAKE", "cpu", {"n": n}) for n in (4, 8)})
    session = _Session(spec, [tr], ["run", "FAKE"])
    session.on_line(tr, "event", {"v": 1, "event": "start", "run": "R1"})

    def rec(rid, n):
        return {"v": 1, "id": rid, "run": "R1", "t": "x", "stage": "FAKE", "arch": "cpu", "case": {"n": n},
                "status": "pass"}

    session.on_line(tr, "record", rec("R1.x[/]", 4))
    assert tr.rejected == 1 and "not RUN.N" in tr.first_reject
    (lab / "results" / "records").rmdir() if (lab / "results" / "records").is_dir() else None
    (lab / "results").mkdir(exist_ok=True)
    (lab / "results" / "records").write_text("a file where the records folder belongs\n")
    with pytest.raises(LocalWriteError, match=r"^cannot write .*FAKE.jsonl: "):
        session.on_line(tr, "record", rec("R1.1", 4))
    assert tr.records == [] and tr.seen == set()
    session.close()


@pytest.mark.ssh
def test_kernel_output_cannot_lose_or_forge_a_record(remote_lab, capsys):
    code = run_remote(remote_lab, "NOISY", "box")
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    recs = records_of(remote_lab, "NOISY")
    assert sorted(r.case["n"] for r in recs) == [4, 8, 16]  # n = 4 printed without a newline
    assert all(r.status == "pass" and r.target == "box" and r.run != "FORGED" for r in recs)
    (run,) = read_runs(remote_lab).values()
    assert "rejected" not in run and run["counts"] == {"pass": 3}
    assert "rejected" not in out.err


def lab_env(lab: Path) -> dict[str, str]:
    env = {**os.environ, "DSV4_LAB_ROOT": str(lab), "PYTHONPATH": str(lab)}
    env.pop("DSV4_LAB_GIT", None)
    return env


def remote_side(lab: Path, stage: str, key: str) -> tuple[subprocess.Popen, bytes, str]:
    """The remote side as ssh runs it: key on stdin, open until exit."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([PY, "-m", "harness.remote.remote_side", "run", stage, "--emit-jsonl"], cwd=lab,
                                env=lab_env(lab), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        proc.stdin.write((key + "\n").encode())
        proc.stdin.flush()
        stdout = proc.stdout.read()
        proc.wait(300)
        proc.stdin.close()
        err.seek(0)
        return proc, stdout, err.read().decode(errors="replace")


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(d.name)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p}
        todo += list(kids - out)
        out |= kids
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_remote_side_stops_when_its_stdin_ends(tmp_path):
    """ssh killed: the remote run and its worker stop at once."""
    lab = make_lab(tmp_path / "lab")
    key = new_key()
    mark = tmp_path / "mark"
    mark.mkdir()
    err = open(tmp_path / "stderr", "w+b")
    proc = subprocess.Popen([PY, "-m", "harness.remote.remote_side", "run", "SLOW", "--emit-jsonl"], cwd=lab,
                            env={**lab_env(lab), "SLOW_MARK": str(mark)}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=err)
    try:
        proc.stdin.write((key + "\n").encode())
        proc.stdin.flush()
        rx = Receiver(key)
        kind, start = parse_payload(rx.open(proc.stdout.readline().rstrip(b"\n"))[0], {"SLOW"})
        assert kind == "event" and start["event"] == "start"
        # the kernel reports its worker's pid
        deadline = time.monotonic() + 180
        while not any(mark.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        err.seek(0)
        assert any(mark.iterdir()), (f"no case started (run exit {proc.poll()}): "
                                     + err.read().decode(errors="replace")[-3000:])
        kids = {int(p.name.split(".")[0]) for p in mark.iterdir()}
        time.sleep(1)
        t0 = time.monotonic()
        proc.stdin.close()
        assert proc.wait(20) == 129  # SIGHUP
        rest = proc.stdout.read()
        assert time.monotonic() - t0 < 20
        deadline = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if alive(k)], "a worker outlived its run"
        frames = [parse_payload(rx.open(raw)[0], {"SLOW"}) for raw in rest.splitlines()]
        assert frames[-1][0] == "event" and frames[-1][1]["event"] == "end" and frames[-1][1]["interrupted"]
    finally:
        if proc.poll() is None:
            proc.kill()
        err.close()


def test_remote_side_keeps_its_channel_private(tmp_path):
    """Remote side: only authentic frames on stdout, prints to stderr, key not in env."""
    lab = make_lab(tmp_path / "lab")
    key = new_key()
    proc, stdout, err = remote_side(lab, "NOISY", key)
    assert proc.returncode == 0, err
    rx = Receiver(key)
    kinds = []
    for raw in stdout.splitlines():
        payload, why = rx.open(raw)
        assert why is None, (why, raw[:200])
        kinds.append(parse_payload(payload, {"NOISY"}))
    assert [k for k, _ in kinds] == ["event", "record", "record", "record", "event"]
    assert sorted(obj["case"]["n"] for k, obj in kinds if k == "record") == [4, 8, 16]
    assert "progress without a newlineraw write to fd 1, no newline" in err
    assert "FORGED" in err and "key in env: False" in err and key not in err


def test_remote_side_without_a_key_is_one_line(tmp_path):
    lab = make_lab(tmp_path / "lab")
    out = subprocess.run([PY, "-m", "harness.remote.remote_side", "run", "FAKE", "--emit-jsonl"], cwd=lab, env=lab_env(lab),
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("dsv4-lab: run --emit-jsonl: no channel key") and len(out.stderr.splitlines()) == 1
    out = run_cli(lab, "run", "FAKE", "--emit-jsonl")  # cli directly, stdin not a key either
    assert out.returncode == 2 and "no channel key" in out.stderr and "Traceback" not in out.stderr


def test_long_records_are_cut_to_fit_the_channel():
    from harness.remote.remote_side import fit_line

    rec = {"v": 1, "id": "R.1", "run": "R", "t": "2026-01-01T00:00:00Z", "stage": "FAKE", "arch": "cpu",
           "case": {"n": 4}, "status": "crash", "error": "E" * 30000, "trace": "T" * 90000}
    line = fit_line(json.dumps(rec))
    assert len(line.encode()) <= MAX_LINE_BYTES - 128
    back = json.loads(line)
    assert back["status"] == "crash" and back["case"] == {"n": 4}
    assert back["trace"].startswith("T" * 8000) and "cut to fit" in back["trace"]
    assert back["error"].startswith("E" * 4000)
    short = json.dumps({**rec, "error": "e", "trace": "t"})
    assert fit_line(short) == short


def test_channel_frames():
    from harness.remote.channel import Receiver, frame, new_key

    key = new_key()
    rx = Receiver(key)
    assert rx.open(frame(key, 1, '{"a": 1}').rstrip(b"\n")) == (b'{"a": 1}', None)
    assert "again or out of order" in rx.open(frame(key, 1, '{"a": 1}').rstrip(b"\n"))[1]
    assert "without this run's key" in rx.open(frame(new_key(), 2, "{}").rstrip(b"\n"))[1]
    assert "malformed" in rx.open(b"@@dsv4-rec x y")[1]
    assert "not a record frame" in rx.open(b'{"v": 1}')[1]
    assert rx.open(frame(key, 2, "{}").rstrip(b"\n")) == (b"{}", None)
    assert rx.open(frame(key, 4, "{}").rstrip(b"\n")) == (b"{}", None)  # 3 was lost before (too long)
    assert "out of order" in rx.open(frame(key, 3, "{}").rstrip(b"\n"))[1]
    with pytest.raises(ValueError):
        frame(key, 3, "two\nlines")


@pytest.mark.ssh
def test_workdir_with_spaces_and_shell_characters(remote_lab, tmp_path, capsys):
    code = run_remote(remote_lab, "FAKE", "odd")
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert len(records_of(remote_lab, "FAKE")) == 3
    odd = tmp_path / "w d;touch pwned;$(touch pwned2)`touch pwned3`"
    assert (odd / treecopy.lab_id(remote_lab) / "stages.yaml").is_file()
    for p in ("pwned", "pwned2", "pwned3"):
        assert not list(tmp_path.rglob(p)) and not (Path.home() / p).exists()


@pytest.mark.ssh
def test_check_reports_python_torch_cute_gpus_folder(remote_lab, capsys):
    code = target_check.check_cmd(remote_lab, "box")
    out = capsys.readouterr().out
    versions = {}
    for dist in ("torch", "nvidia-cutlass-dsl"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "missing"
    assert f"python       {sys.version.split()[0]}" in out
    assert f"torch        {versions['torch']}" in out
    assert f"CuTeDSL      {versions['nvidia-cutlass-dsl']}" in out
    assert "GPUs" in out and "writable" in out and "NOT writable" not in out
    assert code == (0 if "missing" not in versions.values() else 1)


@pytest.mark.ssh
def test_targets_list(remote_lab, capsys):
    assert targets.list_cmd(remote_lab) == 0
    out = capsys.readouterr().out
    assert "box" in out and "labhost" in out and "targets.yaml:3" in out
