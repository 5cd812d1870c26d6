"""Speed baselines (issue 29 item 1): `baseline accept STAGE --speed` keeps, per bench shape, the
median µs, its spread, the peers' ratios and the GPU from the newest fresh bench record, in
results/speed_baselines.yaml beside results/baselines.yaml.xz (which is left exactly as it was)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.notebook import speedbaselines
from harness.notebook.baselines import BaselineError
from harness.notebook.records import Record, RecordWriter
from harness.spec.identity import source_hash
from harness.spec.spec import load_spec
from tests.conftest import run_cli, write_baselines
from tests.test_bench import LAB
from harness.core.labels import case_label

N4096 = case_label({"n": 4096, "mode": "ok"})


def _bench(lab: Path, rid: str, n: int, us: float, src: str | None = None, status: str = "pass",
           gpu: str = "NVIDIA H100 80GB HBM3", dirty: bool = False) -> None:
    spec = load_spec(root=lab)
    w = RecordWriter(lab)
    w.write(Record(id=rid, run=rid.split(".")[0], t="2026-11-27T05:00:00Z", stage="OK", arch="cpu",
                   case={"n": n, "mode": "ok"}, status=status, note="bench", metrics={"out": {"cosine": 1.0}},
                   code={"commit": "abc123", "dirty": dirty,
                         "src": src or source_hash(lab, spec.stages["OK"], "cpu")},
                   timing={"us": us, "spread": 0.021, "p10_us": us * 0.99, "p90_us": us * 1.01, "reps": 30,
                           "gpu_name": gpu, "sm_mhz": 1980.0, "mem_mhz": 2619.0, "power_w": 412.5,
                           "peer_torch_sdpa_us": us * 1.2, "peer_torch_sdpa_ratio": 1.2,
                           "peer_fa4": "not installed (pip install flash-attn-4)"}))
    w.close()


@pytest.fixture
def slab(fake_lab) -> Path:
    (fake_lab / "stages.yaml").write_text(LAB)
    return fake_lab


def test_accept_speed_keeps_median_spread_peers_and_gpu(slab):
    _bench(slab, "r1.1", 4096, 50.0)
    _bench(slab, "r2.1", 4096, 40.0)  # the newest fresh one is taken
    _bench(slab, "r3.1", 4096, 10.0, src="0ld50urce")  # stale: never
    _bench(slab, "r3.2", 1000, 9.0, status="fail")  # failed: never
    path = write_baselines(slab, "# kept\nversion: 1\nbaselines: {}\n")
    before = path.read_bytes()
    r = run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "r2.1" in r.stdout and "40.00 µs" in r.stdout and case_label({"n": 1000, "mode": "ok"}) not in r.stdout and "1 bench shape(s) have no passing" in r.stdout  # the shape with no pass is named
    (b,) = speedbaselines.load(slab)
    assert (b.stage, b.arch, b.case, b.record, b.commit, b.us) == ("OK", "cpu", N4096, "r2.1", "abc123", 40.0)
    assert b.spread == 0.021 and b.reps == 30 and b.peers == {"torch_sdpa": 1.2}
    assert b.gpu == {"name": "NVIDIA H100 80GB HBM3", "sm_mhz": 1980.0, "mem_mhz": 2619.0, "power_w": 412.5}
    assert path.read_bytes() == before  # the correctness baselines: untouched
    r = run_cli(["baseline", "show", "--speed"], cwd=slab)
    assert r.returncode == 0 and "40.00 µs" in r.stdout and "H100" in r.stdout, r.stdout + r.stderr


def test_accept_speed_adds_and_loses_nothing(slab):
    _bench(slab, "r1.1", 4096, 50.0)
    _bench(slab, "r1.2", 1000, 12.0)
    assert run_cli(["baseline", "accept", "stage-OK", "--speed", "--n", "4096"], cwd=slab).returncode == 0
    assert [b.case for b in speedbaselines.load(slab)] == [N4096]
    assert run_cli(["baseline", "accept", "stage-OK", "--speed", "--n", "1000"], cwd=slab).returncode == 0
    assert sorted(b.case for b in speedbaselines.load(slab)) == sorted([case_label({"n": 1000, "mode": "ok"}), N4096])


def test_accept_speed_without_a_bench_record_takes_nothing(slab):
    r = run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab)
    assert r.returncode == 1 and "dsv4-lab bench stage-OK" in r.stdout, r.stdout + r.stderr
    assert not (slab / "results" / "speed_baselines.yaml").exists()


def test_bad_filter_for_speed_is_one_line(slab):
    r = run_cli(["baseline", "accept", "stage-OK", "--speed", "--n", "77"], cwd=slab)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "4096, 1000" in r.stderr, r.stderr


@pytest.mark.parametrize("text,where", [
    ("version: 1\nspeed:\n  OK:\n    cpu:\n      n=16: {record: r, src: s, us: -1}\n", ":5: speed.OK.cpu.n=16.us"),
    ("version: 1\nspeed:\n  OK:\n    cpu:\n      n=16: {record: r, src: s, us: 1, gpu: 3}\n", ":5: speed.OK.cpu.n=16.gpu"),
    ("version: 2\n", ":1: version"),
    ("version: 1\nspeed: {}\nspeed: {}\n", "duplicate key"),
])
def test_a_bad_speed_file_is_one_line_and_accept_overwrites_nothing(slab, text, where):
    path = slab / "results" / "speed_baselines.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    with pytest.raises(BaselineError) as exc:
        speedbaselines.load(slab)
    assert where in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    _bench(slab, "r1.1", 4096, 50.0)
    r = run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab)
    assert r.returncode == 2 and "speed_baselines.yaml" in r.stderr and path.read_text() == text


def test_compared_only_on_the_same_gpu_model():
    b = speedbaselines.SpeedBaseline("E", "sm_90a", "x", "r", "s", "c", 100.0, gpu={"name": "NVIDIA H100 80GB HBM3"})
    assert speedbaselines.same_gpu(b, "NVIDIA H100 80GB HBM3")
    assert not speedbaselines.same_gpu(b, "NVIDIA H200") and not speedbaselines.same_gpu(b, None)
    assert speedbaselines.delta(b, 105.0) == pytest.approx(0.05)


def test_a_baseline_from_a_dirty_tree_says_so(slab):
    _bench(slab, "r1.1", 4096, 50.0, dirty=True)
    r = run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab)
    assert r.returncode == 0 and "uncommitted changes" in r.stdout, r.stdout + r.stderr
    (b,) = speedbaselines.load(slab)
    assert b.dirty and "dirty: true" in (slab / "results" / "speed_baselines.yaml").read_text()
