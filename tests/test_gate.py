"""Gate decisions on synthetic records: pass, regression, improvement, stale, early stop, corrupt; hook."""

import io
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from harness.notebook import baselines

from harness.workflows import gate
from harness.notebook.baselines import Baseline, case_label
from harness.spec.identity import source_hash
from harness.notebook.records import Record
from harness.spec.spec import load_spec
from tests.conftest import baselines_text, run_cli, write_baselines, write_records


def add_hd_stage(lab: Path) -> None:
    """A fake stage with an hd axis and a GPU arch."""
    text = (lab / "stages.yaml").read_text()
    text += """
  HD:
    title: fake attention with hd
    dir: stages/fake
    kernels: {sm90: {module: stages.fake.cpu, entry: Add}, cpu: {module: stages.fake.cpu, entry: Add}}
    tensors: oracles.add:tensors
    inputs: oracles.add:make_inputs
    oracle: oracles.add:reference
    matrix: {hd: [64, 512], n: [16]}
    kernel_params: [n]
    tolerances: {out: {cosine_min: 0.99}}
"""
    (lab / "stages.yaml").write_text(text)


def rec(spec, stage: str, arch: str, case: dict, cos: float, status: str = "pass", i: int = 1, src=None) -> Record:
    st = spec.stages[stage]
    return Record(
        id=f"run{i}.{i}", run=f"run{i}", t="2026-11-21T00:00:00Z", stage=stage, arch=arch, case=case,
        status=status, metrics={"out": {"cosine": cos, "rel_l2": 1e-3, "max_abs": 1e-3, "nonfinite": 0, "unwritten": 0}},
        code={"commit": "x", "dirty": False, "src": src or source_hash(spec.root, st, arch)},
    )


def write(lab: Path, *records: Record) -> None:
    write_records(lab, records)


def base(spec, stage: str, arch: str, case: dict, cos: float, rid: str = "run1.1") -> Baseline:
    return Baseline(stage=stage, arch=arch, case=case_label(case), record=rid,
                    src=source_hash(spec.root, spec.stages[stage], arch),
                    metrics={"out": {"cosine": cos, "rel_l2": 1e-3, "max_abs": 1e-3}})


@pytest.fixture
def lab(fake_lab):
    add_hd_stage(fake_lab)
    return fake_lab


def decide(lab: Path, allow_run: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    code = gate.main(lab, allow_run=allow_run, out=out)
    return code, out.getvalue()


C64, C512 = {"hd": 64, "n": 16}, {"hd": 512, "n": 16}


def test_no_baselines_passes(lab):
    assert decide(lab)[0] == 0


def test_pass_when_fresh_results_hold(lab):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.9999), rec(spec, "HD", "sm_90a", C512, 0.9998, i=2))
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999), base(spec, "HD", "sm_90a", C512, 0.9998)])
    code, text = decide(lab)
    assert code == 0 and "2 baselined case(s) hold" in text


def test_regression_is_named_with_baseline_now_delta_record(lab):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.9999), rec(spec, "HD", "sm_90a", C512, 0.95, i=7))
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999), base(spec, "HD", "sm_90a", C512, 0.9998)])
    code, text = decide(lab)
    assert code == 1
    assert "REGRESSIONS" in text and "stage-HD sm_90a hd=512,n=16" in text and "out.cosine" in text
    assert "0.9998" in text and "0.95" in text and "-0.0498" in text and "run7.7" in text


def test_failed_status_is_a_regression(lab):
    spec = load_spec(root=lab)
    r = rec(spec, "HD", "sm_90a", C64, 0.9999, status="crash")
    r.error = "CUDA_ERROR_ILLEGAL_ADDRESS"
    write(lab, r)
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    code, text = decide(lab)
    assert code == 1 and "crash: CUDA_ERROR_ILLEGAL_ADDRESS" in text


def test_improvement_is_reported_with_the_accept_command(lab):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.99999))
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.999)])
    code, text = decide(lab)
    assert code == 0 and "improvements" in text
    assert "dsv4-lab baseline accept stage-HD --arch sm_90a --hd 64 --n 16" in text


def test_early_stop_on_the_small_case(lab):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.5))  # hd=512 has no fresh record at all
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999), base(spec, "HD", "sm_90a", C512, 0.9998)])
    code, text = decide(lab)
    assert code == 1 and "stopped at the first regression among the proven small cases" in text
    assert "stale" not in text  # it never looked at hd=512


def test_stale_without_a_device_names_stage_and_command(lab):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.9999, src="0ld0ld0ld0ld"))
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    code, text = decide(lab, allow_run=True)  # no sm_90 GPU here (CI): cannot run
    assert code == 1
    line = [ln for ln in text.splitlines() if "stale" in ln]
    assert len(line) == 1 and "stage-HD sm_90a (1 case)" in line[0] and "dsv4-lab run stage-HD --arch sm_90a" in line[0]


def test_stale_with_a_runnable_target_runs_the_cases(lab):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "cpu", C64, 0.9999, src="0ld0ld0ld0ld"))
    baselines.save(lab, [base(spec, "HD", "cpu", C64, 0.9999999)])
    code, text = decide(lab, allow_run=True)  # the cpu arch runs here: the gate runs it
    assert code == 0, text
    recs = [json.loads(x) for x in (lab / "results" / "records" / "HD.jsonl").read_text().splitlines()]
    assert recs[-1]["status"] == "pass" and recs[-1]["code"]["src"] == source_hash(spec.root, spec.stages["HD"], "cpu")


def test_changed_source_makes_results_stale(lab):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.9999))
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    assert decide(lab)[0] == 0
    with open(lab / "stages" / "fake" / "cpu.py", "a") as fh:
        fh.write("\nA_CHANGE = 1\n")  # code, not a comment
    code, text = decide(lab)
    assert code == 1 and "stale" in text


def test_corrupt_records_are_skipped_with_a_warning(lab, capsys):
    spec = load_spec(root=lab)
    path = lab / "results" / "records" / "HD.jsonl"
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.9999))
    with open(path, "a") as fh:
        fh.write('{"v": 1, "id": "broken\n')
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    code, _ = decide(lab)
    assert code == 0
    assert f"{path}:2: skipped a corrupt line" in capsys.readouterr().err


def test_invalid_baselines_file_is_one_line_exit_2(lab):
    write_baselines(lab, "version: 1\nbaselines:\n  A: [\n")
    r = run_cli(["gate"], cwd=lab)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "baselines.yaml.xz:4: not valid YAML" in r.stderr


def test_accept_takes_the_newest_passing_fresh_record(lab):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.99, i=1), rec(spec, "HD", "sm_90a", C64, 0.999, i=2),
          rec(spec, "HD", "sm_90a", C64, 0.2, status="fail", i=3))
    r = run_cli(["baseline", "accept", "stage-HD", "--arch", "sm_90a", "--hd", "64"], cwd=lab)
    assert r.returncode == 0, r.stdout + r.stderr
    (b,) = baselines.load(lab)
    assert b.record == "run2.2" and b.metrics["out"]["cosine"] == 0.999
    assert "HD:" in baselines_text(lab)
    r = run_cli(["baseline", "drop", "stage-HD", "--hd", "64"], cwd=lab)
    assert r.returncode == 0 and baselines.load(lab) == []


def test_the_gate_reads_back_only_as_far_as_it_needs(lab, capsys):
    """Newest first: a stale newer record is passed over; an older corrupt line is never read."""
    spec = load_spec(root=lab)
    path = lab / "results" / "records" / "HD.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"v": 1, "id": "broken\n')
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.9999, i=1), rec(spec, "HD", "sm_90a", C64, 0.2, i=2, src="0ld0ld0ld0ld"))
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    code, text = decide(lab)
    assert code == 0 and "1 baselined case(s) hold" in text, text
    assert "skipped" not in capsys.readouterr().err
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.5, i=3))  # the newest fresh one decides
    assert decide(lab)[0] == 1


# -- the hook


def test_hook_install_is_idempotent_and_refuses_a_foreign_hook(lab):
    r = run_cli(["gate", "--install-hook"], cwd=lab)
    assert r.returncode == 0, r.stderr
    hook = lab / ".git" / "hooks" / "pre-commit"
    assert gate.HOOK_MARK in hook.read_text() and hook.stat().st_mode & stat.S_IXUSR
    assert run_cli(["gate", "--install-hook"], cwd=lab).returncode == 0
    hook.write_text("#!/bin/sh\necho mine\n")
    r = run_cli(["gate", "--install-hook"], cwd=lab)
    assert r.returncode == 2 and "not written by dsv4-lab" in r.stderr and "mine" in hook.read_text()
    assert run_cli(["gate", "--install-hook", "--force"], cwd=lab).returncode == 0
    assert gate.HOOK_MARK in hook.read_text()


def test_hook_refuses_a_commit_that_regresses(lab, tmp_path):
    spec = load_spec(root=lab)
    write(lab, rec(spec, "HD", "sm_90a", C64, 0.5))
    baselines.save(lab, [base(spec, "HD", "sm_90a", C64, 0.9999)])
    assert run_cli(["gate", "--install-hook"], cwd=lab).returncode == 0
    from tests.conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(os.sys.executable).parent}:{os.environ['PATH']}"}
    (lab / "x.txt").write_text("x")
    subprocess.run(["git", "add", "-A"], cwd=lab, check=True)  # the hook judges what is staged
    r = subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-m", "x"], cwd=lab, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "REGRESSIONS" in r.stdout + r.stderr


# -- a broken sm_100a build is refused without a GPU


def test_hook_refuses_a_commit_that_breaks_the_sm100_build_of_d1(tmp_path, monkeypatch):
    """D1 sm_100a compile-only: a harmless commit passes; one breaking sm100.py is refused."""
    monkeypatch.delenv("DSV4_LAB_ROOT", raising=False)
    monkeypatch.setenv("DSV4_LAB_CACHE", str(tmp_path / "cache"))
    from tests.conftest import ROOT

    lab = tmp_path / "lab"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    import shutil

    for name in filter(None, files):
        src = ROOT / name
        if src.is_file() and not name.startswith(("tests/", "results/")):
            (lab / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, lab / name)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=lab, check=True)
    r = run_cli(["compile", "stage-D1", "--arch", "sm_100a", "--hd", "64", "--n", "128"], cwd=lab)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_cli(["baseline", "accept", "stage-D1", "--arch", "sm_100a", "--hd", "64", "--n", "128"], cwd=lab)
    assert r.returncode == 0 and "(compile-only)" in r.stdout, r.stdout + r.stderr
    subprocess.run(["git", "add", "-A"], cwd=lab, check=True)
    subprocess.run([*git, "commit", "-qm", "lab"], cwd=lab, check=True)
    assert run_cli(["gate", "--install-hook"], cwd=lab).returncode == 0
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "DSV4_LAB_CACHE": str(tmp_path / "cache")}

    (lab / "NOTES.txt").write_text("a harmless change\n")
    subprocess.run(["git", "add", "NOTES.txt"], cwd=lab, check=True)
    r = subprocess.run([*git, "commit", "-qm", "notes"], cwd=lab, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    kernel = lab / "stages" / "D1_headdim" / "sm100.py"
    good = kernel.read_text()

    def commit_broken(text: str) -> str:
        kernel.write_text(text)
        subprocess.run(["git", "add", str(kernel)], cwd=lab, check=True)
        r = subprocess.run([*git, "commit", "-qm", "break D1"], cwd=lab, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode != 0, r.stdout + r.stderr
        return r.stdout + r.stderr

    # no longer builds: refused
    out = commit_broken(good + "\n_planted = name_that_does_not_exist\n")
    assert "REGRESSIONS" in out and "stage-D1 sm_100a hd=64,n=128,m=128" in out and "compile_error" in out, out
    assert "stages/D1_headdim/sm100.py:" in out and "NameError" in out, out
    assert "gate 1/1" in out and "hd=64,n=128,m=128" in out.split("gate 1/1", 1)[1], out  # a line per recompiled case
    # a syntax error is refused even before
    out = commit_broken(good + "\ndef broken(:\n    pass\n")
    assert "stages/D1_headdim/sm100.py:" in out and "does not parse" in out, out
    head = subprocess.run(["git", "log", "--oneline"], cwd=lab, capture_output=True, text=True).stdout
    assert "break D1" not in head
