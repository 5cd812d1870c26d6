"""`bench --compare REV` on the CPU: interleaving, both checked, `compare`, no-GPU answer."""

import dataclasses
import subprocess

import numpy as np
import pytest

from harness.execution import abtest
from harness.execution.abbench import compare_block, compare_line
from harness.execution.executor import ABJob, CaseExecutor
from harness.notebook.records import Record, RecordWriter, read_records
from tests.conftest import has_gpu, run_cli
from tests.test_bench import LAB, _job  # lab_path: a conftest fixture


class DriftingGPU:
    """A fake GPU whose clock slows 10 % over the run, plus 1 % noise."""

    def __init__(self, rounds: int, seed: int = 0) -> None:
        self.t, self.n = 0, 2 * rounds
        self.rng = np.random.default_rng(seed)
        self.order: list[str] = []

    def timer(self, name: str, base_us: float):
        def one_round() -> float:
            self.order.append(name)
            clock = 1 + 0.10 * self.t / self.n
            self.t += 1
            return base_us * clock * (1 + self.rng.normal(0, 0.01))
        return one_round


def test_interleaved_rounds_are_paired_and_beat_a_drifting_clock():
    gpu = DriftingGPU(40)
    got = abtest.interleaved({"A": gpu.timer("A", 100.0), "B": gpu.timer("B", 100.0)}, 40)
    assert gpu.order[:6] == ["A", "B", "B", "A", "A", "B"] and len(got["A"]) == len(got["B"]) == 40
    assert abtest.compare(got["A"], got["B"]).verdict == abtest.NO_CHANGE
    # timed one after the other on the same clock:
    gpu = DriftingGPU(40)
    a = [gpu.timer("A", 100.0)() for _ in range(40)]
    b = [gpu.timer("B", 100.0)() for _ in range(40)]
    assert abtest.compare(a, b).verdict == abtest.SLOWER  # what the interleaving saves the lab from
    gpu = DriftingGPU(40, seed=1)
    got = abtest.interleaved({"A": gpu.timer("A", 100.0), "B": gpu.timer("B", 106.0)}, 40)
    assert abtest.compare(got["A"], got["B"]).verdict == abtest.SLOWER


def test_both_kernels_are_checked_in_one_process(lab_path):
    b = _job("ok")
    out = CaseExecutor(lab_path).run(ABJob(a=_job("ok"), b=b, rounds=10))
    assert out["status"] == "pass" and out["a"] == {"status": "pass"}, out
    assert "timing" not in out  # a CPU kernel is checked, never timed
    wrong = dataclasses.replace(_job("ok"), case={**b.case, "mode": "wrong"})
    out = CaseExecutor(lab_path).run(ABJob(a=wrong, b=_job("ok"), rounds=10))
    assert out["status"] == "fail" and out["error"].startswith("REV:") and out["a"]["status"] == "fail", out
    out = CaseExecutor(lab_path).run(ABJob(a=_job("ok"), b=_job("unwritten"), rounds=10))
    assert out["status"] == "fail" and out["error"].startswith("tree:"), out


def test_the_compare_block_is_recorded_and_read_back(fake_lab):
    rng = np.random.default_rng(3)
    a = list(100 * (1 + rng.normal(0, 0.01, 40)))
    b = list(105 * (1 + rng.normal(0, 0.01, 40)))
    c = abtest.compare(a, b)
    block = compare_block("HEAD~1", "0123456789abcdef0123", c, {"A": a, "B": b})
    assert len(block["a_rounds"]) == len(block["b_rounds"]) == 40
    again = abtest.compare(block["a_rounds"], block["b_rounds"])  # the verdict can be re-derived from the record
    assert again.verdict == c.verdict and again.ratio == pytest.approx(c.ratio, rel=1e-4)
    assert block["commit"] == "0123456789ab" and block["verdict"] == "slower" and block["rev"] == "HEAD~1"
    assert set(block) >= {"a_us", "b_us", "ratio", "lo", "hi", "threshold", "level", "rounds", "method"}
    rec = Record(id="r.1", run="r", t="2026-11-27T05:00:00Z", stage="OK", arch="sm_90a", case={"n": 4096},
                 status="pass", note="bench", code={"src": "abc"}, timing={"us": c.b_us}, compare=block)
    w = RecordWriter(fake_lab)
    w.write(rec)
    w.close()
    (back,) = read_records(fake_lab, ["OK"], bench=True)
    assert back.compare == block
    line = compare_line(back)
    assert "HEAD~1 " in line and "slower" in line and f"{c.ratio:.3f}" in line


@pytest.mark.skipif(has_gpu(), reason="the no-GPU answer")
def test_compare_without_a_gpu_takes_rev_then_times_nothing_and_fails(fake_lab):
    (fake_lab / "stages.yaml").write_text(LAB)
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "bench block"],
                   cwd=fake_lab, check=True)
    r = run_cli(["bench", "stage-OK", "--compare", "HEAD~1", "--n", "4096"], cwd=fake_lab)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "taken into a temporary tree" in r.stdout and "no GPU here: nothing was timed" in r.stdout
    assert "n=4096" in r.stdout and "n=1000" not in r.stdout
    r = run_cli(["bench", "stage-OK", "--compare", "no-such-rev"], cwd=fake_lab)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--compare no-such-rev: not a commit" in r.stderr
    r = run_cli(["bench", "stage-OK", "--compare", "HEAD", "--peers"], cwd=fake_lab)
    assert r.returncode == 2 and "give one" in r.stderr


def test_speed_tolerance_in_the_bench_block(fake_lab):
    from tests.test_bench import error, load

    assert load(fake_lab).stages["OK"].bench_plan.speed_tolerance == 0.03
    text = LAB.replace("      check_rows: 64\n", "      check_rows: 64\n      speed_tolerance: 0.05\n")
    assert load(fake_lab, text).stages["OK"].bench_plan.speed_tolerance == 0.05
    msg = error(fake_lab, text.replace("0.05", "5"))
    assert "bench.speed_tolerance" in msg and "0.005 to 0.5" in msg, msg
