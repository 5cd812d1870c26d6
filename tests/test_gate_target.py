"""The gate without a GPU: the hook judges the index, proving stale cases over a real sshd."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.notebook import baselines
from harness.spec.identity import source_hash
from harness.notebook.records import read_records
from harness.spec.spec import load_spec
from harness.remote.targets import TargetError, load_targets, proof_target
from harness.workflows import gate
from tests.conftest import run_cli
from tests.ssh_fixtures import SshServer, make_lab, ssh_server  # noqa: F401  (fixture)
from tests.ssh_fixtures import run_cli as lab_cli
from tests.test_gate import C64, add_hd_stage, base, rec, write

GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
PY = sys.executable


def commit(lab: Path, env: dict, *paths: str, message: str = "change") -> subprocess.CompletedProcess:
    """`git add PATHS; git commit` with the hook."""
    if paths:
        subprocess.run(["git", "add", *paths], cwd=lab, check=True)
    return subprocess.run([*GIT, "commit", "-qm", message], cwd=lab, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def hooked_lab(fake_lab, tmp_path):
    """Fake lab, stage HD baselined, committed, hook installed."""
    lab = fake_lab
    add_hd_stage(lab)
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.9999))
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    subprocess.run(["git", "add", "-A"], cwd=lab, check=True)
    subprocess.run([*GIT, "commit", "-qm", "HD baselined"], cwd=lab, check=True)
    assert run_cli(["gate", "--install-hook"], cwd=lab).returncode == 0
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
           "DSV4_LAB_CACHE": str(tmp_path / "cache")}
    return lab, env


def edit_kernel(lab: Path, line: str = "A_CHANGE = 1") -> Path:
    kernel = lab / "stages" / "fake" / "cpu.py"
    with open(kernel, "a") as fh:
        fh.write(f"\n{line}\n")  # code, not a comment
    return kernel


def test_an_unstaged_kernel_edit_does_not_block_a_docs_commit(hooked_lab):
    lab, env = hooked_lab
    edit_kernel(lab)  # stays unstaged: not part of the commit
    (lab / "NOTES.md").write_text("docs only\n")
    r = commit(lab, env, "NOTES.md", message="docs")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "gate: pass" in r.stdout + r.stderr
    assert "A_CHANGE" in (lab / "stages" / "fake" / "cpu.py").read_text()  # the edit is left as it was
    assert subprocess.run(["git", "diff", "--quiet"], cwd=lab).returncode == 1


def test_a_staged_kernel_edit_is_refused_naming_the_target_way_in_one_line(hooked_lab):
    lab, env = hooked_lab
    kernel = edit_kernel(lab)
    (lab / "NOTES.md").write_text("docs\n")
    r = commit(lab, env, str(kernel), "NOTES.md", message="kernel")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    stale = [ln for ln in out.splitlines() if "stale" in ln]
    assert len(stale) == 1, out
    line = stale[0]
    assert "stage-HD sm_90a (1 case)" in line and "dsv4-lab run stage-HD --arch sm_90a" in line
    assert "this machine cannot run sm_90a — prove it on a target: dsv4-lab gate --target NAME" in line, line
    assert "(declare one in targets.yaml;" in line and "`proof_target: NAME` in " in line, line
    assert line.endswith("or on a machine that can: dsv4-lab run stage-HD --arch sm_90a"), line
    assert "xdg/dsv4-lab/targets.yaml makes the hook use it" in line, line
    # unstaged edit: the docs commit goes through
    subprocess.run(["git", "reset", "-q", "--", str(kernel)], cwd=lab, check=True)
    r = commit(lab, env, message="docs")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_staged_gate_judges_staged_baselines_and_names_declared_targets(hooked_lab):
    """A staged baseline dropped from the tree still holds; the stale line names the targets."""
    lab, env = hooked_lab
    (lab / "targets.yaml").write_text("version: 1\ntargets:\n  box:\n    ssh: gpu-box\n    workdir: /w\n"
                                      "    python: python3\n")
    subprocess.run(["git", "add", "targets.yaml"], cwd=lab, check=True)
    kernel = edit_kernel(lab)
    subprocess.run(["git", "add", str(kernel)], cwd=lab, check=True)
    baselines.save(lab, [])  # unstaged: the commit still holds the baseline
    r = run_cli(["gate", "--staged", "--no-run"], cwd=lab, env_extra=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "dsv4-lab gate --target box (declared: box;" in r.stdout, r.stdout
    # no baselines beside records: never a pass
    r = run_cli(["gate", "--no-run"], cwd=lab, env_extra=env)
    assert r.returncode == 1 and "no baselines, but the notebook has records" in r.stdout, r.stdout + r.stderr


def test_staged_outside_git_is_one_line(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "stages.yaml").write_text("version: 1\nstages: {}\n")
    r = run_cli(["gate", "--staged"], cwd=lab, env_extra={"DSV4_LAB_ROOT": str(lab),
                                                         "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "git" in r.stderr, r.stderr


# -- proof_target: validation

BOX = "  box:\n    ssh: gpu-box\n    workdir: /w\n    python: python3\n"


def user_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "xdg" / "dsv4-lab" / "targets.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def config_lab(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "targets.yaml").write_text("version: 1\ntargets:\n" + BOX)
    return lab


def test_proof_target_in_the_user_file(config_lab, tmp_path):
    assert proof_target(config_lab) is None
    user_file(tmp_path, "version: 1\nproof_target: box\n")
    assert proof_target(config_lab) == "box"
    assert set(load_targets(config_lab)) == {"box"}


@pytest.mark.parametrize("where, text, words", [
    ("user", "version: 1\nproof_target: nosuch\n", [":2: proof_target: no target 'nosuch' is declared (declared: box)"]),
    ("user", "version: 1\nproof_target: [box]\n", [":2: proof_target: expected a target name"]),
    ("user", "proof_target: local\n", [":1: proof_target: 'local' is not a target name"]),
    ("lab", "version: 1\nproof_target: box\ntargets:\n" + BOX, ["targets.yaml:2: proof_target: a personal setting",
                                                                "dsv4-lab/targets.yaml"]),
])
def test_bad_proof_target_is_one_line_with_file_line_key(config_lab, tmp_path, where, text, words):
    if where == "user":
        user_file(tmp_path, text)
    else:
        (config_lab / "targets.yaml").write_text(text)
    with pytest.raises(TargetError) as exc:
        proof_target(config_lab) if where == "user" else load_targets(config_lab)
    msg = str(exc.value)
    assert "\n" not in msg and " — " in msg, msg
    for w in words:
        assert w in msg, msg


def test_gate_with_a_bad_proof_target_or_target_is_one_line_exit_2(hooked_lab, tmp_path):
    lab, env = hooked_lab
    edit_kernel(lab)
    user_file(tmp_path, "version: 1\nproof_target: nosuch\n")
    r = run_cli(["gate"], cwd=lab, env_extra=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "proof_target" in r.stderr, r.stderr
    r = run_cli(["gate", "--target", "nosuch"], cwd=lab, env_extra=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--target nosuch: no such target" in r.stderr, r.stderr


# -- proving on a target: a real sshd


@pytest.fixture
def proof_lab(tmp_path, monkeypatch, ssh_server: SshServer):
    """A small lab with target `box` on the test sshd; FAKE baselined, committed, hooked."""
    monkeypatch.setenv("DSV4_LAB_SSH_CONFIG", str(ssh_server.config))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DSV4_LAB_GIT", raising=False)
    body = (f"version: 1\ntargets:\n  box:\n    ssh: labhost\n    workdir: {str(tmp_path / 'remote work')!r}\n"
            f"    python: {PY!r}\n  closed:\n    ssh: labhost-closed\n    workdir: /w\n    python: python3\n")
    lab = make_lab(tmp_path / "lab", body)
    env = {"DSV4_LAB_SSH_CONFIG": str(ssh_server.config), "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
           "DSV4_LAB_CACHE": str(tmp_path / "cache")}
    r = lab_cli(lab, "run", "FAKE", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = lab_cli(lab, "baseline", "accept", "stage-FAKE", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    subprocess.run(["git", "add", "-A"], cwd=lab, check=True)
    subprocess.run([*GIT, "commit", "-qm", "FAKE baselined"], cwd=lab, check=True)
    assert lab_cli(lab, "gate", "--install-hook", env=env).returncode == 0
    hook_env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(tmp_path)), **env}
    return lab, hook_env


def fake_src(lab: Path) -> str:
    spec = load_spec(root=lab)
    return source_hash(lab, spec.stages["FAKE"], "cpu")


@pytest.mark.ssh
def test_the_hook_proves_a_staged_edit_on_the_proof_target(proof_lab, tmp_path):
    """proof_target proves the staged edit on `box`; an unstaged broken edit is not copied."""
    lab, env = proof_lab
    user_file(tmp_path, "version: 1\nproof_target: box\n")
    kernel = lab / "stages" / "fake" / "cpu.py"
    good = kernel.read_text() + "\nSTAGED_CHANGE = 1\n"
    kernel.write_text(good)
    subprocess.run(["git", "add", str(kernel)], cwd=lab, check=True)
    staged_src = fake_src(lab)
    kernel.write_text(good.replace("out.copy_(a + b)", "out.copy_(a - b)"))  # unstaged, wrong
    before = len(read_records(lab, ["FAKE"]))
    r = commit(lab, env, message="kernel")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "proving 3 stale case(s) on box" in out and "gate: pass" in out and "proven on box" in out, out
    new = read_records(lab, ["FAKE"])[before:]
    assert sorted(x.case["n"] for x in new) == [4, 8, 16], out
    assert all(x.target == "box" and x.status == "pass" and x.code["src"] == staged_src for x in new), new
    assert all(x.code["dirty"] is True for x in new)  # HEAD plus the staged edit
    assert "out.copy_(a - b)" in kernel.read_text()  # the working tree is left as it was


@pytest.mark.ssh
def test_gate_target_proves_stale_cases_there_and_local_proves_here(proof_lab):
    lab, env = proof_lab
    kernel = lab / "stages" / "fake" / "cpu.py"
    kernel.write_text(kernel.read_text() + "\nA_CHANGE = 2\n")
    before = len(read_records(lab, ["FAKE"]))
    r = lab_cli(lab, "gate", "--target", "box", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    new = read_records(lab, ["FAKE"])[before:]
    assert len(new) == 3 and all(x.target == "box" and x.status == "pass" for x in new), r.stdout + r.stderr
    kernel.write_text(kernel.read_text() + "\nA_CHANGE = 3\n")
    r = lab_cli(lab, "gate", "--target", "local", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    newer = read_records(lab, ["FAKE"])[before + 3:]
    assert len(newer) == 3 and all(x.target in (None, "local") for x in newer), newer


def test_staged_gate_of_a_lab_in_a_subfolder_of_its_repository(fake_lab, tmp_path):
    """A lab below the repository's top: its staged baselines count."""
    import shutil

    add_hd_stage(fake_lab)
    spec = load_spec(root=fake_lab)
    write(fake_lab, rec(spec, "HD", "sm_90a", C64, 0.9999))
    baselines.save(fake_lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    repo = tmp_path / "repo"
    lab = repo / "labs" / "dsv4"
    shutil.copytree(fake_lab, lab, ignore=shutil.ignore_patterns(".git"))
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run([*GIT, "commit", "-qm", "lab"], cwd=repo, check=True)
    edit_kernel(lab)  # unstaged

    out = io.StringIO()
    assert gate.main(lab, allow_run=False, out=out, staged=True) == 0, out.getvalue()
    assert "1 baselined case(s) hold" in out.getvalue()
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    out = io.StringIO()
    assert gate.main(lab, allow_run=False, out=out, staged=True) == 1 and "stale" in out.getvalue()
    assert (lab / "results" / "baselines.yaml.xz").is_file() and not (lab / "results").is_symlink()


def test_a_staged_run_here_runs_the_staged_kernel_and_writes_records_to_the_lab(fake_lab):
    """No target: a stale case runnable here runs from the index's snapshot."""
    lab = fake_lab
    add_hd_stage(lab)
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "cpu", C64, 0.9999999, src="0ld0ld0ld0ld"))
    baselines.save(lab, [base(spec, "HD", "cpu", C64, 0.9999999)])
    kernel = edit_kernel(lab, "STAGED = 1")
    subprocess.run(["git", "add", "-A"], cwd=lab, check=True)
    staged_src = source_hash(lab, spec.stages["HD"], "cpu")
    kernel.write_text(kernel.read_text().replace("out.copy_(a + b)", "out.copy_(a - b)", 1))  # unstaged, wrong
    out = io.StringIO()
    assert gate.main(lab, allow_run=True, out=out, staged=True) == 0, out.getvalue()
    recs = read_records(lab, ["HD"])
    assert recs[-1].status == "pass" and recs[-1].code["src"] == staged_src and recs[-1].code["dirty"] is True
    assert (lab / "results" / "runs.jsonl").is_file()


def test_staged_without_stages_yaml_in_the_index_is_one_line(tmp_path):
    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "stages.yaml").write_text("version: 1\nstages: {}\n")
    subprocess.run(["git", "init", "-q"], cwd=lab, check=True)  # nothing staged yet
    r = run_cli(["gate", "--staged"], cwd=lab, env_extra={"DSV4_LAB_ROOT": str(lab)})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "stages.yaml: not in the git index" in r.stderr and "git add stages.yaml" in r.stderr, r.stderr


@pytest.mark.ssh
def test_an_unreachable_proof_target_leaves_the_case_stale_exit_3(proof_lab):
    lab, env = proof_lab
    kernel = lab / "stages" / "fake" / "cpu.py"
    kernel.write_text(kernel.read_text() + "\nA_CHANGE = 4\n")
    before = len(read_records(lab, ["FAKE"]))
    r = lab_cli(lab, "gate", "--target", "closed", env=env)
    assert r.returncode == 3, r.stdout + r.stderr
    stale = [ln for ln in r.stdout.splitlines() if "stale" in ln]
    assert len(stale) == 1 and "the proof on closed brought back no result (exit 3" in stale[0], r.stdout + r.stderr
    assert "cannot reach" in r.stderr or "closed" in r.stderr, r.stderr
    assert len(read_records(lab, ["FAKE"])) == before  # nothing proven, nothing recorded
