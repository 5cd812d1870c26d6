"""SSH targets: targets.yaml validation, the ssh argv and quoting, and remote runs against a
real OpenSSH server on 127.0.0.1 (tests/ssh_fixtures.py) with CPU-only fake stages."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
import time
from importlib import metadata
from io import BytesIO
from pathlib import Path

import pytest

from harness import remote, targets
from harness.matrix import expand
from harness.records import MAX_LINE_BYTES, read_records, read_runs
from harness.spec import load_spec
from harness.remote import explain_ssh_failure, parse_line, read_lines, remote_path, remote_run_args, ssh_argv
from harness.targets import Target, TargetError, load_targets, load_targets_file
from tests.ssh_fixtures import SshServer, make_lab, run_cli, ssh_server  # noqa: F401  (fixture)

PY = sys.executable


# ---------------------------------------------------------------------------------------
# targets.yaml: validation (no ssh needed).


def write_targets(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def lab_dir(tmp_path, monkeypatch) -> Path:
    """An empty lab folder, with the per-user targets file isolated under tmp."""
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


@pytest.mark.parametrize("body, where, words", [
    ("    password: hunter2\n", "targets.yaml:8: targets.b200.password:", ["ssh key", "ssh-agent"]),
    ("    ssh_options: {PasswordAuthentication: 'yes'}\n", "targets.yaml:8: targets.b200.ssh_options.PasswordAuthentication:",
     ["ssh key", "ssh-agent"]),
    ("    ssh_options: {StrictHostKeyChecking: 'no'}\n", "targets.yaml:8: targets.b200.ssh_options.StrictHostKeyChecking:",
     ["known_hosts"]),
    ("    ssh_options: {UserKnownHostsFile: /dev/null}\n", "targets.yaml:8: targets.b200.ssh_options.UserKnownHostsFile:",
     ["known_hosts"]),
    ("    ssh_options: {ProxyCommand: nc}\n", "targets.yaml:8: targets.b200.ssh_options.ProxyCommand:", ["ssh/config"]),
    ("    ssh_options: {ForwardAgent: 'yes'}\n", "targets.yaml:8: targets.b200.ssh_options.ForwardAgent:", ["allowed"]),
    ("    colour: red\n", "targets.yaml:8: targets.b200.colour:", ["unknown key", "allowed"]),
    ("    gpus: [0, 0]\n", "targets.yaml:8: targets.b200.gpus:", ["repeated"]),
    ("    port: 70000\n", "targets.yaml:8: targets.b200.port:", ["port"]),
    ("    api_token: abc\n", "targets.yaml:8: targets.b200.api_token:", ["secret"]),
])
def test_bad_entries_are_one_line_with_file_line_key(lab_dir, body, where, words):
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
    assert msg.startswith(where), msg
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


def test_unknown_target_is_a_target_error(lab_dir):
    write_targets(lab_dir / "targets.yaml", GOOD)
    with pytest.raises(TargetError, match="--target h100: no such target"):
        targets.resolve_targets(lab_dir, "b200,h100")
    with pytest.raises(TargetError, match="local"):
        targets.resolve_targets(lab_dir, "b200,local")


# ---------------------------------------------------------------------------------------
# The ssh argv and the remote command (no ssh needed).


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
    cmd = remote.remote_run_command(t, tmp_path, ["run", "FAKE", "--where", "n=4; rm -rf /"])
    assert "'n=4; rm -rf /'" in cmd
    assert cmd.startswith("cd '/w d;$(x)/dsv4-lab-")
    assert "DSV4_LAB_GIT=abc123:1" in cmd
    assert cmd.endswith("; exit $?")
    words = shlex.split(cmd.split(" && ")[-1].removesuffix("; exit $?"))
    assert words[:3] == ["python", "-m", "cli"] and words[-1] == "n=4; rm -rf /"


def test_read_lines_bounds_every_line():
    big = b"x" * (MAX_LINE_BYTES + 10)
    stream = BytesIO(b"ok\n" + big + b"\nafter\npartial")
    got = list(read_lines(stream, MAX_LINE_BYTES))
    assert got[0] == (b"ok", None)
    assert got[1][0] is None and "longer than" in got[1][1]
    assert got[2] == (b"after", None)
    assert got[3][0] is None and "incomplete" in got[3][1]


def test_parse_line_rejects_bad_records():
    good = {"v": 1, "id": "R.1", "run": "R", "t": "x", "stage": "FAKE", "arch": "cpu", "case": {"n": 4},
            "status": "pass"}
    assert parse_line(json.dumps(good).encode(), {"FAKE"})[0] == "record"
    for bad, why in [
        (b"{nope", "not JSON"),
        (json.dumps({**good, "stage": "../../etc"}).encode(), "unknown stage"),
        (json.dumps({**good, "status": "great"}).encode(), "unknown status"),
        (json.dumps({**good, "metrics": [1]}).encode(), "metrics"),
        (b'{"v": 1, "cosine": NaN}', "non-finite"),
        (json.dumps({"event": "boom", "run": "R"}).encode(), "control event"),
    ]:
        kind, reason = parse_line(bad, {"FAKE"})
        assert kind == "reject" and why in reason, (bad, reason)


def test_explain_ssh_failure():
    t = _target(ssh="gpu", port=None)
    changed = "@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\nHost key verification failed.\n"
    msg = explain_ssh_failure(t, changed)
    assert "host key mismatch" in msg and "known_hosts" in msg and "Never disable" in msg
    assert "StrictHostKeyChecking=no" not in msg
    assert "authentication failed" in explain_ssh_failure(t, "me@gpu: Permission denied (publickey).")
    assert "cannot reach gpu" in explain_ssh_failure(t, "ssh: connect to host gpu port 22: Connection refused")


# ---------------------------------------------------------------------------------------
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
    return remote.run_remote_and_report(spec, target, argv, {st.id: expand(st)}, **kw)


def records_of(lab: Path, stage: str) -> list[dict]:
    return read_records(lab, [stage])


@pytest.mark.ssh
@pytest.mark.parametrize("method", ["rsync", "tar"])
def test_full_round_trip(remote_lab, tmp_path, capsys, method):
    lab = remote_lab
    folder = tmp_path / "remote work" / remote.lab_id(lab)
    folder.mkdir(parents=True)
    (folder / "stale.py").write_text("left from an older sync\n")
    shipped = remote.tree_files(lab)
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
    # the remote folder is exactly what git would commit
    on_remote = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert on_remote == sorted(shipped)
    assert "notes.txt" in on_remote and "local.log" not in on_remote and "stale.py" not in on_remote
    assert not any("__pycache__" in p for p in on_remote)
    assert "box" in out.out and "copied" in out.out


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
    assert remote.check_cmd(remote_lab, "badkey") == 3
    err = capsys.readouterr().err
    assert "host key mismatch" in err and len(err.strip().splitlines()) == 1


@pytest.mark.ssh
def test_unknown_host_key_and_auth_failure(remote_lab, capsys):
    assert remote.check_cmd(remote_lab, "unknownkey") == 3
    assert "not in your known_hosts" in capsys.readouterr().err
    assert remote.check_cmd(remote_lab, "noauth") == 3
    err = capsys.readouterr().err
    assert "authentication failed" in err and "ssh-agent" in err


@pytest.mark.ssh
def test_unreachable_host_fails_fast(remote_lab, capsys):
    t0 = time.monotonic()
    assert run_remote(remote_lab, "FAKE", "closed") == 3
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Connection refused" in err
    assert remote.check_cmd(remote_lab, "closed") == 3


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


FAKE_REMOTE = '''\
#!{py}
"""Stands in for the remote python: prints bad lines around one good record."""
import json
print(json.dumps({{"v": 1, "event": "start", "run": "R1", "cases": 1}}))
print("this is not json {{")
print(json.dumps({{"pad": "x" * 70000}}))
print(json.dumps({{"v": 1, "id": "R1.1", "run": "R1", "t": "2026-01-01T00:00:00Z", "stage": "../../evil",
                  "arch": "cpu", "case": {{"n": 4}}, "status": "pass"}}))
print(json.dumps({{"v": 1, "id": "R1.2", "run": "R1", "t": "2026-01-01T00:00:00Z", "stage": "FAKE", "arch": "cpu",
                  "case": {{"n": 4}}, "status": "pass", "metrics": {{"out": {{"cosine": 1.0}}}}}}))
print(json.dumps({{"v": 1, "event": "end", "run": "R1", "interrupted": False, "counts": {{"pass": 1}}}}))
'''


@pytest.mark.ssh
def test_malformed_and_oversized_lines_are_rejected(remote_lab, tmp_path, capsys):
    script = tmp_path / "fakepy"
    script.write_text(FAKE_REMOTE.format(py=PY))
    script.chmod(0o755)
    tfile = remote_lab / "targets.yaml"
    tfile.write_text(tfile.read_text() + target_yaml("liar", "labhost", tmp_path / "liar", str(script)))
    code = run_remote(remote_lab, "FAKE", "liar")
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    recs = records_of(remote_lab, "FAKE")
    assert len(recs) == 1 and recs[0].id == "R1.2" and recs[0].target == "liar"
    assert "rejected 3 line(s)" in out.err and "line 2: not JSON" in out.err
    assert not (tmp_path / "evil.jsonl").exists() and not list(tmp_path.rglob("evil.jsonl"))
    (run,) = read_runs(remote_lab).values()
    assert run["rejected"] == 3 and run["interrupted"] is False


@pytest.mark.ssh
def test_workdir_with_spaces_and_shell_characters(remote_lab, tmp_path, capsys):
    code = run_remote(remote_lab, "FAKE", "odd")
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert len(records_of(remote_lab, "FAKE")) == 3
    odd = tmp_path / "w d;touch pwned;$(touch pwned2)`touch pwned3`"
    assert (odd / remote.lab_id(remote_lab) / "stages.yaml").is_file()
    for p in ("pwned", "pwned2", "pwned3"):
        assert not list(tmp_path.rglob(p)) and not (Path.home() / p).exists()


@pytest.mark.ssh
def test_check_reports_python_torch_cute_gpus_folder(remote_lab, capsys):
    code = remote.check_cmd(remote_lab, "box")
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
