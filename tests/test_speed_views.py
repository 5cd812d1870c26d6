"""Speed in `history --speed` and the dashboard's Δ speed column."""

from harness.notebook.records import Record, RecordWriter
from tests.conftest import run_cli
from tests.test_speed_baselines import _bench, slab  # noqa: F401  (slab: the fixture)


def _accept(lab) -> None:
    r = run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=lab)
    assert r.returncode == 0, r.stdout + r.stderr


def test_history_speed_shows_us_across_commits_against_the_baseline(slab):
    _bench(slab, "r1.1", 4096, 40.0)
    _accept(slab)
    _bench(slab, "r2.1", 4096, 44.0)
    _bench(slab, "r3.1", 4096, 30.0, gpu="NVIDIA H200")  # another model: no Δ
    w = RecordWriter(slab)
    src = next(iter(__import__("json").loads(l)["code"]["src"] for l in
                    (slab / "results" / "records" / "OK.jsonl").read_text().splitlines()))
    w.write(Record(id="r4.1", run="r4", t="2026-11-27T06:00:00Z", stage="OK", arch="cpu", case={"n": 4096, "mode": "ok"},
                   status="pass", note="bench", code={"commit": "abc123", "src": src},
                   timing={"us": 42.0, "gpu_name": "NVIDIA H100 80GB HBM3"},
                   compare={"rev": "HEAD~1", "commit": "0123456789ab", "verdict": "slower", "ratio": 1.05}))
    w.close()
    env = {"COLUMNS": "200"}
    r = run_cli(["history", "stage-OK", "--speed", "--n", "4096"], cwd=slab, env_extra=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "baseline 40.00 µs on NVIDIA H100 80GB HBM3, r1.1" in out
    assert "+10.0%" in out and "44.00" in out and "30.00" in out and "H200" in out
    assert "slower ×1.050 vs 01234567" in out and "µs (lower is better)" in out
    r = run_cli(["history", "stage-OK", "--speed", "--n", "1000"], cwd=slab)
    assert r.returncode == 1 and "dsv4-lab bench stage-OK" in r.stdout


def test_dashboard_shows_delta_speed_and_marks_it_stale(slab):
    _bench(slab, "r1.1", 4096, 40.0)
    env = {"COLUMNS": "250"}
    assert "Δ speed" not in run_cli(["dashboard"], cwd=slab, env_extra=env).stdout  # no speed baseline: no column
    _accept(slab)
    _bench(slab, "r2.1", 4096, 38.0)
    out = run_cli(["dashboard"], cwd=slab, env_extra=env).stdout
    assert "Δ speed" in out and "-5.0%" in out and "-5.0%⚠" not in out, out
    kernel = slab / "stages" / "fake" / "cpu.py"
    kernel.write_text(kernel.read_text() + "\nCHANGED = 1\n")
    out = run_cli(["dashboard"], cwd=slab, env_extra=env).stdout
    assert "-5.0%⚠" in out, out
