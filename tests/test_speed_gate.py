"""`gate --speed`: unchanged sources hold, changed ones need an A/B on the baseline's GPU model."""

import pytest

from harness.notebook.records import Record
from harness.notebook.speedbaselines import SpeedBaseline
from harness.workflows.speedgate import verdicts
from tests.conftest import has_gpu, run_cli
from tests.test_speed_baselines import _bench, slab  # noqa: F401  (slab: the fixture)


def test_no_speed_baselines_guard_nothing_and_never_pass(slab):
    r = run_cli(["gate", "--speed"], cwd=slab)
    assert r.returncode == 1 and "no speed baselines" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(has_gpu(), reason="the no-GPU answer")
def test_unchanged_source_holds_and_a_changed_one_needs_the_gpu(slab):
    _bench(slab, "r1.1", 4096, 50.0)
    assert run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab).returncode == 0
    r = run_cli(["gate", "--speed"], cwd=slab)
    assert r.returncode == 0 and "1 speed baseline(s) hold" in r.stdout, r.stdout + r.stderr
    kernel = slab / "stages" / "fake" / "cpu.py"
    kernel.write_text(kernel.read_text() + "\nCHANGED = 1\n")
    r = run_cli(["gate", "--speed"], cwd=slab)
    assert r.returncode == 1 and r.stdout.count("\n") == 1, r.stdout + r.stderr
    assert "1 speed-baselined shape(s) changed source" in r.stdout and "NVIDIA H100 80GB HBM3 (cpu)" in r.stdout
    assert "no GPU here" in r.stdout
    r = run_cli(["gate", "--speed", "--staged"], cwd=slab)
    assert r.returncode == 2 and "takes none of" in r.stderr


def _rec(case: dict, compare: dict | None, status: str = "pass") -> Record:
    return Record(id="r.1", run="r", t="t", stage="OK", arch="sm_90a", case=case, status=status, note="bench",
                  compare=compare, error=None if compare else "tree: wrong result")


def test_a_slower_verdict_fails_and_no_verdict_is_unproven():
    block = {"rev": "abc", "commit": "abc", "a_us": 100.0, "b_us": 105.0, "ratio": 1.05, "lo": 1.03, "hi": 1.07,
             "threshold": 0.03}
    bs = [SpeedBaseline("OK", "sm_90a", f"n={n}", "r", "s", "abc", 100.0) for n in (1, 2, 3, 4)]
    recs = [_rec({"n": 1}, {**block, "verdict": "slower"}), _rec({"n": 2}, {**block, "verdict": "no detectable change"}),
            _rec({"n": 3}, None, "fail")]
    slower, unproven = verdicts(recs, bs)
    assert len(slower) == 1 and "n=1" in slower[0] and "×1.050" in slower[0] and "3 % threshold" in slower[0]
    assert [u.split(":")[0] for u in unproven] == ["stage-OK sm_90a n=3", "stage-OK sm_90a n=4"]
    assert "wrong result" in unproven[0] and "not compared" in unproven[1]
