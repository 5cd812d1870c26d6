"""Speed baselines: `accept --speed` keeps median, spread, ratios, GPU."""

import lzma
from pathlib import Path

import pytest

from harness.notebook import speedbaselines
from harness.notebook.baselines import BaselineError
from harness.notebook.records import Record, RecordWriter
from harness.spec.identity import source_hash
from harness.spec.spec import load_spec
from tests.conftest import ROOT, run_cli, write_baselines
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


def _xz(text: str) -> bytes:
    return lzma.compress(text.encode(), format=lzma.FORMAT_XZ)


def _speed_text(lab: Path) -> str:
    return lzma.decompress(speedbaselines.speed_file(lab).read_bytes()).decode()


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
    assert not speedbaselines.speed_file(slab).exists() and not speedbaselines.old_speed_file(slab).exists()


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
    path = speedbaselines.speed_file(slab)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(_xz(text))
    with pytest.raises(BaselineError) as exc:
        speedbaselines.load(slab)
    assert where in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    _bench(slab, "r1.1", 4096, 50.0)
    r = run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab)
    assert r.returncode == 2 and "speed_baselines.yaml.xz:" in r.stderr and path.read_bytes() == _xz(text)


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
    assert b.dirty and "dirty: true" in _speed_text(slab)


# -- the xz file, and the old plain one

ONE = "version: 1\nspeed:\n  OK:\n    cpu:\n      n=8: {record: r0.1, src: s, commit: c, us: 7.0, gpu: {}}\n"


def test_a_corrupt_speed_xz_file_is_one_line(slab):
    speedbaselines.speed_file(slab).parent.mkdir(exist_ok=True)
    speedbaselines.speed_file(slab).write_bytes(_xz(ONE)[:-9])
    with pytest.raises(BaselineError, match=r"^results/speed_baselines\.yaml\.xz:1: not a readable xz file .*"
                                            r"git checkout results/speed_baselines\.yaml\.xz$"):
        speedbaselines.load(slab)


def test_an_old_plain_speed_file_is_read_and_the_next_accept_compresses_and_removes_it(slab):
    old = speedbaselines.old_speed_file(slab)
    old.parent.mkdir(exist_ok=True)
    old.write_text(ONE)
    (kept,) = speedbaselines.load(slab)
    assert kept.us == 7.0 and not speedbaselines.speed_file(slab).exists()  # reading writes nothing
    _bench(slab, "r1.1", 4096, 50.0)
    assert run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab).returncode == 0
    assert not old.exists() and speedbaselines.speed_file(slab).read_bytes().startswith(b"\xfd7zXZ\x00")
    assert sorted(b.case for b in speedbaselines.load(slab)) == sorted(["n=8", N4096]) and "r0.1" in _speed_text(slab)


@pytest.mark.parametrize("same", [True, False])
def test_the_speed_xz_and_an_old_plain_one_at_once_are_one_line_naming_both(slab, same):
    new, old = speedbaselines.speed_file(slab), speedbaselines.old_speed_file(slab)
    new.parent.mkdir(exist_ok=True)
    new.write_bytes(_xz(ONE))
    old.write_text(ONE if same else ONE.replace("n=8", "n=9"))
    before = (new.read_bytes(), old.read_bytes())
    with pytest.raises(BaselineError) as exc:
        speedbaselines.load(slab)
    text = str(exc.value)
    assert "\n" not in text and text.startswith("results/speed_baselines.yaml.xz and results/speed_baselines.yaml: "
                                                "both present"), text
    assert ("both hold the same 1 speed baselines" if same else "they differ (1 and 1 speed baselines)") in text, text
    with pytest.raises(BaselineError, match="both present"):
        speedbaselines.save(slab, [], [])
    _bench(slab, "r1.1", 4096, 50.0)
    r = run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "both present" in r.stderr, r.stdout + r.stderr
    assert (new.read_bytes(), old.read_bytes()) == before


def test_the_real_speed_baselines_round_trip_to_the_same_text(tmp_path):
    lab = tmp_path / "lab"
    (lab / "results").mkdir(parents=True)
    speedbaselines.speed_file(lab).write_bytes(speedbaselines.speed_file(ROOT).read_bytes())
    real = speedbaselines.load(lab)
    text = _speed_text(lab)
    assert len(real) > 10
    speedbaselines.save(lab, real, real)
    assert speedbaselines.load(lab) == real and _speed_text(lab) == text


def test_drop_gone_also_drops_the_speed_baselines_of_shapes_the_bench_block_lost(slab):
    _bench(slab, "r1.1", 4096, 50.0)
    _bench(slab, "r1.2", 1000, 12.0)
    write_baselines(slab, "version: 1\nbaselines: {}\n")
    assert run_cli(["baseline", "accept", "stage-OK", "--speed"], cwd=slab).returncode == 0
    r = run_cli(["baseline", "drop", "stage-OK", "--gone"], cwd=slab)  # the bench block still has both
    assert r.returncode == 0 and "speed" not in r.stdout, r.stdout + r.stderr
    assert len(speedbaselines.load(slab)) == 2
    (slab / "stages.yaml").write_text(LAB.replace("n: [4096, 1000]", "n: [4096]"))
    r = run_cli(["baseline", "drop", "stage-OK", "--gone"], cwd=slab)
    assert r.returncode == 0 and "dropped 1 speed baseline(s) of stage-OK" in r.stdout, r.stdout + r.stderr
    assert [b.case for b in speedbaselines.load(slab)] == [N4096]
