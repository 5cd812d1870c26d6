"""The command line a newcomer meets, in fresh processes on a throwaway lab."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.notebook import baselines
from harness.notebook.baselines import Baseline
from harness.notebook.records import Record, RecordWriter
from harness.spec.spec import load_spec
from tests.conftest import ROOT, has_gpu, lab_env, run_cli
from tests.test_gate import C64, C512, add_hd_stage, rec


def _one_line_usage_error(r: subprocess.CompletedProcess, *words: str) -> None:
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert "Traceback" not in text and "internal error" not in text, text
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("dsv4-lab"), r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


# -- help and --version


@pytest.mark.parametrize("args", [[], ["baseline"], ["new"], ["targets"]])
def test_bare_command_and_bare_groups_print_their_help_and_exit_0(fake_lab, args):
    r = run_cli(args, cwd=fake_lab)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"Usage: dsv4-lab {' '.join(args)}".rstrip() + " [OPTIONS] COMMAND"), r.stdout
    assert "Commands:" in r.stdout and "\n" in r.stdout.strip() and not r.stderr.strip()


def test_a_real_usage_error_is_still_exit_2(fake_lab):
    _one_line_usage_error(run_cli(["frob"], cwd=fake_lab), "No such command 'frob'")
    _one_line_usage_error(run_cli(["baseline", "frob"], cwd=fake_lab), "No such command 'frob'")


def test_version(fake_lab):
    from importlib import metadata

    r = run_cli(["--version"], cwd=fake_lab)
    assert r.returncode == 0 and not r.stderr.strip(), r.stdout + r.stderr
    assert r.stdout.startswith("dsv4-lab ") and f"nvidia-cutlass-dsl {metadata.version('nvidia-cutlass-dsl')}" in r.stdout
    assert "--version" in run_cli(["--help"], cwd=fake_lab).stdout


# -- options and filters


def test_an_unknown_option_is_named_with_the_closest_one_not_read_as_an_axis(fake_lab):
    _one_line_usage_error(run_cli(["run", "stage-OK", "--dry-run"], cwd=fake_lab), "no such option '--dry-run'",
                          "dsv4-lab run takes --all, --arch")
    _one_line_usage_error(run_cli(["run", "--dry-run"], cwd=fake_lab), "no such option '--dry-run'")
    _one_line_usage_error(run_cli(["run", "stage-OK", "--arhc", "sm_90a"], cwd=fake_lab),
                          "no such option '--arhc'", "did you mean --arch?")
    _one_line_usage_error(run_cli(["compile", "stage-OK", "--kep", "x"], cwd=fake_lab), "did you mean --keep?")
    _one_line_usage_error(run_cli(["history", "stage-BAD", "--mod", "ok"], cwd=fake_lab),
                          "no such option '--mod'", "did you mean --mode?")
    # with --all the first filter word is no stage name
    _one_line_usage_error(run_cli(["run", "--all", "--dry-run"], cwd=fake_lab), "no such option '--dry-run'")
    _one_line_usage_error(run_cli(["run", "--all", "--n", "16", "--arhc", "cpu"], cwd=fake_lab),
                          "no such option '--arhc'", "did you mean --arch?")
    _one_line_usage_error(run_cli(["run", "--n", "16"], cwd=fake_lab), "--n is an axis filter — name a stage first")
    # another stage's axis: the filter error
    _one_line_usage_error(run_cli(["run", "stage-OK", "--mode", "ok"], cwd=fake_lab), "stage-OK: no axis 'mode'")
    assert not (fake_lab / "results" / "records").exists() or not any((fake_lab / "results" / "records").iterdir())


def test_an_axis_flag_and_where_on_the_same_axis_are_refused(fake_lab):
    _one_line_usage_error(run_cli(["run", "stage-OK", "--n", "16", "--where", "n=32"], cwd=fake_lab),
                          "--n 16 and --where n=32 both filter n", "give n once (e.g. --n 16,32)")
    assert not (fake_lab / "results" / "records").exists() or not any((fake_lab / "results" / "records").iterdir())


def test_gpus_naming_a_gpu_this_machine_lacks_is_a_usage_error(fake_lab):
    r = run_cli(["run", "stage-OK", "--gpus", "99"], cwd=fake_lab)
    _one_line_usage_error(r, "--gpus 99: no GPU 99 on this machine")
    assert "run " not in r.stdout  # refused before a run starts
    assert not (fake_lab / "results" / "runs.jsonl").exists()


def test_dashboard_interval_must_be_positive(fake_lab):
    for value in ("-1", "0", "nan"):
        _one_line_usage_error(run_cli(["dashboard", "--watch", "--interval", value], cwd=fake_lab),
                              f"--interval {value}: must be a finite number of seconds > 0")


def test_show_and_note_of_an_unknown_id_are_one_line_on_stderr(fake_lab):
    r = run_cli(["show", "nosuchid"], cwd=fake_lab)
    _one_line_usage_error(r, "no record or run 'nosuchid'")
    assert not r.stdout.strip()
    r = run_cli(["note", "nosuchrun", "text"], cwd=fake_lab)
    _one_line_usage_error(r, "no run 'nosuchrun'")
    assert not r.stdout.strip()


# -- baselines


def test_baseline_show_lists_cases_in_matrix_order(fake_lab):
    """hd sorts by number, not text."""
    add_hd_stage(fake_lab)
    spec = load_spec(root=fake_lab)
    items = [Baseline("HD", "cpu", case, f"run1.{i}", "s", {"out": {"cosine": 0.999}})
             for i, case in enumerate(("hd=512,n=16", "hd=64,n=16"))]
    baselines.save(fake_lab, items)
    assert [b.case for b in baselines.load(fake_lab)] == ["hd=512,n=16", "hd=64,n=16"]  # the file: text order
    for args in (["baseline", "show", "stage-HD"], ["baseline", "show"]):
        out = run_cli(args, cwd=fake_lab).stdout
        assert "hd=64,n=16" in out and out.index("hd=64,n=16") < out.index("hd=512,n=16"), out
    assert spec.stages["HD"].matrix["hd"] == [64, 512]


@pytest.mark.skipif(has_gpu(), reason="the CPU machine's path: no Hopper here")
def test_accept_refuses_a_compile_only_baseline_for_an_arch_the_lab_gpus_run(fake_lab):
    from tests.test_baselines import _compiled, _write_records

    add_hd_stage(fake_lab)  # kernels sm90 and cpu
    spec = load_spec(root=fake_lab)
    _write_records(fake_lab, [_compiled(spec, "HD", C64, arch="sm_90a")])
    for extra in ([], ["--compile-only"]):
        r = run_cli(["baseline", "accept", "stage-HD", "--arch", "sm_90a", "--hd", "64", *extra], cwd=fake_lab)
        _one_line_usage_error(r, "sm_90a runs on Hopper", "only for archs no lab machine runs (sm_100a)",
                              "dsv4-lab run stage-HD --arch sm_90a")
        assert baselines.load(fake_lab) == []


# -- dashboard


def _dashboard_records(lab: Path) -> None:
    from harness.execution.compilerun import NOTE

    add_hd_stage(lab)
    text = (lab / "stages.yaml").read_text().replace(
        "kernels: {sm90: {module: stages.fake.cpu, entry: Add}, cpu:",
        "kernels: {sm90: {module: stages.fake.cpu, entry: Add}, sm100: {module: stages.fake.cpu, entry: Add}, cpu:")
    (lab / "stages.yaml").write_text(text)
    spec = load_spec(root=lab)
    w = RecordWriter(lab)
    for i, case in enumerate((C64, C512), 1):
        r = rec(spec, "HD", "sm_90a", case, 0.99999987, i=i)
        r.env = {"gpu": "NVIDIA H100 80GB HBM3", "host": "a-rather-long-gpu-host-name.example.org"}
        r.compile = {"regs": 168, "spill": 0, "smem": 232448}
        r.timing = {"us": 1234.56, "tflops": 612.0}
        w.write(r)
        src = load_spec(root=lab)
        from harness.spec.identity import source_hash

        w.write(Record(id=f"c.{i}", run="c", t="2026-11-21T00:00:00Z", stage="HD", arch="sm_100a", case=case,
                       status="compiled", compile={"regs": 231, "spill": 0, "smem": 230400}, note=NOTE,
                       code={"src": source_hash(src.root, src.stages["HD"], "sm_100a")}))
    w.close()
    baselines.save(lab, [Baseline("HD", "sm_90a", "hd=64,n=16", "run1.1", "s", {"out": {"cosine": 0.9999}})])


@pytest.mark.parametrize("columns", [80, 100, 120, 160])
def test_the_dashboard_is_one_row_per_stage_and_arch_and_cuts_no_number(fake_lab, columns):
    _dashboard_records(fake_lab)
    r = run_cli(["dashboard"], cwd=fake_lab, env_extra={"COLUMNS": str(columns)})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line.rstrip()) <= columns for line in lines), "\n".join(lines)
    assert "…" not in r.stdout
    rows = [line for line in lines if "sm_90a" in line or "sm_100a" in line or " cpu " in line]
    table = [line for line in rows if not line.startswith("○")]
    # one line per stage
    assert len([line for line in table if " cpu " in line]) == 3 and len(table) == 5, "\n".join(lines)
    assert len(lines) < 25, "\n".join(lines)
    hd90 = next(line for line in table if "sm_90a" in line)
    assert "0.9999999" in hd90 and "✓ 2/2" in hd90 and "H100" in hd90
    if columns >= 100:
        assert "1234.56" in hd90 and "H100 80GB HBM3" in hd90
    if columns >= 160:
        assert "H100 80GB HBM3 @ a-rather-long-gpu-host-name" in hd90 and "168r/0s/227K" in hd90


@pytest.mark.skipif(has_gpu(), reason="the CPU machine's wording")
def test_a_compile_only_row_says_what_run_says(fake_lab):
    """Compiled-only cases read like run ones on a CPU machine."""
    _dashboard_records(fake_lab)
    out = run_cli(["dashboard"], cwd=fake_lab).stdout
    row = next(line for line in out.splitlines() if "sm_100a" in line)
    assert "○ compiled, not run" in row and "nothing was run" not in out
    assert "sm_100a: compiled, not run: no GPU on this machine (needs sm_100)" in out, out


def test_ctrl_c_in_dashboard_watch_exits_130(fake_lab):
    """A real SIGINT, as Ctrl-C sends it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **lab_env(fake_lab, fake_lab.parent / "cache")}
    p = subprocess.Popen([sys.executable, "-m", "cli", "dashboard", "--watch", "--interval", "0.2"], cwd=fake_lab,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()  # the watch's first frame is out
        assert first.startswith("---"), first + p.stderr.read()
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = p.stderr.read()
    assert rc == 130, (rc, err)
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["run", "stage-A", "--shard", "3/2"], ["suite", "deepgemm", "--shard", "half"]])
def test_a_bad_shard_is_one_line_for_run_and_suite(argv):
    """`--shard i/n`: anything else is one line."""
    r = run_cli(argv, cwd=ROOT)
    err = (r.stdout + r.stderr).strip()
    assert r.returncode != 0 and f"--shard {argv[-1]}: expected i/n with 0 <= i < n" in err, err
    assert "Traceback" not in err
