"""`dsv4-lab profile` on the CPU: the ncu command line, the raw-page parser, the profile block."""

import os
import shutil
from pathlib import Path

import pytest

from harness.execution import ncuprofile as profile
from harness.notebook.records import Record, RecordWriter
from tests.conftest import FIXTURES, run_cli
from tests.test_bench import LAB

RAW = (FIXTURES / "ncu" / "raw_page.csv").read_text()


def test_the_ncu_command_profiles_one_ranged_launch_with_the_fixed_metrics():
    cmd = profile.ncu_command("/opt/ncu", Path("/t/job.pkl"), Path("/t/out.json"), python="/usr/bin/python3")
    assert cmd[:8] == ["/opt/ncu", "--csv", "--page", "raw", "--print-units", "base", "--nvtx", "--nvtx-include"]
    assert cmd[8] == "dsv4/" and cmd[cmd.index("--launch-count") + 1] == "1"
    metrics = cmd[cmd.index("--metrics") + 1].split(",")
    assert "gpu__time_duration.sum" in metrics and "launch__registers_per_thread" in metrics
    assert "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio" in metrics
    assert len(metrics) == len(set(metrics)) == len(profile.METRICS) + len(profile.STALL_REASONS)
    assert cmd[-5:] == ["/usr/bin/python3", "-m", "harness.execution.ncuprofile", "/t/job.pkl", "/t/out.json"]


def test_parse_the_raw_page():
    p = profile.parse_csv(RAW)
    assert p["kernel"] == "kernel_cutlass_kernel_stagesEsm90FlashDecode_0"
    assert p["duration_us"] == pytest.approx(412.736)  # nanoseconds, thousands separators
    assert (p["sm_pct"], p["mem_pct"], p["occupancy_pct"], p["l2_hit_pct"]) == (61.02, 85.31, 18.73, 42.17)
    assert p["regs"] == 168 and p["dram_bytes"] == 1_234_567_890 + 12_345_678
    assert list(p["stalls"]) == ["long_scoreboard", "barrier", "wait", "math_pipe_throttle", "short_scoreboard"]
    assert p["stalls"]["long_scoreboard"] == 3.91
    text = "\n".join(profile.lines(p))
    assert "412.74 µs" in text and "168 registers" in text and "long_scoreboard 3.91" in text


def test_parse_other_units_and_bad_output():
    usec = RAW.replace('"nsecond"', '"usecond"').replace('"412,736"', '"412.736"')
    assert profile.parse_csv(usec)["duration_us"] == pytest.approx(412.736)
    for text, says in [("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission", "performance counters"),
                       ("==PROF== Disconnected\n==WARNING== No kernels were profiled.", "No kernels were profiled"),
                       (RAW.replace("lts__t_sector_hit_rate.pct", "lts__other"), "no column lts__t_sector_hit_rate")]:
        with pytest.raises(profile.ProfileError) as exc:
            profile.parse_csv(text)
        assert says in str(exc.value) and "\n" not in str(exc.value)


def test_the_profile_block_is_recorded_and_shown(fake_lab):
    p = profile.parse_csv(RAW)
    w = RecordWriter(fake_lab)
    w.write(Record(id="r9.1", run="r9", t="2026-11-27T05:00:00Z", stage="OK", arch="sm_90a", case={"n": 4096},
                   status="pass", note="bench", code={"src": "abc"}, profile=p))
    w.close()
    r = run_cli(["show", "r9.1"], cwd=fake_lab)
    assert r.returncode == 0 and "profile (ncu): kernel_cutlass" in r.stdout and "L2 hit 42.2 %" in r.stdout, r.stdout


def test_without_ncu_profile_says_so_in_one_line(fake_lab):
    (fake_lab / "stages.yaml").write_text(LAB)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not (Path(d) / "ncu").exists())
    r = run_cli(["profile", "stage-OK", "--n", "4096"], cwd=fake_lab, env_extra={"PATH": path})
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "ncu (Nsight Compute) is not on PATH" in r.stderr
    assert "n=4096" in r.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the no-GPU answer")
def test_with_ncu_but_no_gpu_nothing_is_profiled(fake_lab, tmp_path):
    (fake_lab / "stages.yaml").write_text(LAB)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ncu").write_text("#!/bin/sh\nexit 1\n")
    (fake / "ncu").chmod(0o755)
    r = run_cli(["profile", "stage-OK"], cwd=fake_lab, env_extra={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 1 and "no GPU here: nothing was profiled" in r.stderr and "the first of 2" in r.stdout


def test_profile_compare_side_by_side_and_shown(fake_lab):
    a = profile.parse_csv(RAW)
    b = {**a, "duration_us": 433.37, "regs": 176, "stalls": {"barrier": 2.5}}
    text = "\n".join(profile.side_by_side(a, b, "HEAD~1"))
    assert "HEAD~1" in text.splitlines()[0] and "+5.0%" in text and "stalls tree: barrier 2.50" in text
    assert "stalls HEAD~1: long_scoreboard 3.91" in text
    w = RecordWriter(fake_lab)
    w.write(Record(id="r8.1", run="r8", t="2026-11-27T05:00:00Z", stage="OK", arch="sm_90a", case={"n": 4096},
                   status="pass", note="bench", code={"src": "abc"}, profile=b,
                   compare={"rev": "HEAD~1", "commit": "0123456789ab", "status": "pass", "profile": a}))
    w.close()
    r = run_cli(["show", "r8.1"], cwd=fake_lab)
    assert r.returncode == 0 and "+5.0%" in r.stdout and "stalls HEAD~1" in r.stdout, r.stdout


def test_profile_compare_without_ncu_takes_rev_then_says_so(fake_lab):
    import subprocess

    (fake_lab / "stages.yaml").write_text(LAB)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "bench"], cwd=fake_lab,
                   check=True)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if not (Path(d) / "ncu").exists())
    r = run_cli(["profile", "stage-OK", "--compare", "HEAD~1"], cwd=fake_lab, env_extra={"PATH": path})
    assert r.returncode == 1 and "taken into a temporary tree" in r.stdout and "ncu (Nsight Compute)" in r.stderr
    r = run_cli(["profile", "stage-OK", "--compare", "nope"], cwd=fake_lab, env_extra={"PATH": path})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--compare nope: not a commit" in r.stderr


def test_a_duration_in_a_unit_the_lab_does_not_know_is_an_error_not_a_factor_of_one():
    """Unknown units are a ProfileError (never taken as µs)."""
    text = (FIXTURES / "ncu" / "raw_page.csv").read_text()
    want = profile.parse_csv(text)["duration_us"]
    assert abs(want - 412.736) < 1e-6
    short = text.replace('"nsecond"', '"ns"').replace('"byte","byte"', '"B","B"')
    assert profile.parse_csv(short)["duration_us"] == want
    with pytest.raises(profile.ProfileError, match="fortnight"):
        profile.parse_csv(text.replace('"nsecond"', '"fortnight"'))
