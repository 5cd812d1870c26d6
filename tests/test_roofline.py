"""Roofline arithmetic, its calibration file and timing summary."""

import json
import math

import pytest

from harness.execution.roofline import Peaks, bound, calibration_file, read_peaks, roofline_fields
from harness.execution.timing import passes, rotations, summarize


def test_compute_bound():
    # D1 hd 128, m 8192, n 4096: 17.2 GFLOP; 6 MiB
    flops, nbytes = 4.0 * 8192 * 4096 * 128, (8192 * 128 * 2) * 2 + (4096 * 128 * 2) * 2 + 8192 * 4
    b = bound(flops, nbytes, peak_tflops=774.0, peak_gbps=4200.0)
    assert b.limiter == "compute"
    assert b.compute_us == pytest.approx(flops / 774e12 * 1e6)
    assert b.us == b.compute_us
    assert b.fraction(2 * b.us) == pytest.approx(0.5)


def test_memory_bound():
    b = bound(flops=1e6, nbytes=4.2e9, peak_tflops=774.0, peak_gbps=4200.0)  # 4.2 GB at 4.2 TB/s: 1000 µs
    assert b.limiter == "memory" and b.us == pytest.approx(1000.0)
    assert b.fraction(1250.0) == pytest.approx(0.8)


def test_fraction_above_one_is_reported_not_clipped():
    # faster than the calibrated peak: said
    assert bound(1e12, 0, 1000.0, 1000.0).fraction(500.0) == pytest.approx(2.0)


@pytest.mark.parametrize("args", [
    (float("nan"), 1, 1, 1), (-1, 1, 1, 1), (1, 1, 0, 1), (1, 1, 1, -5), (1, 1, float("inf"), 1),
])
def test_bound_refuses_nonsense(args):
    with pytest.raises(ValueError):
        bound(*args)


@pytest.mark.parametrize("us", [0.0, -1.0, float("nan"), float("inf")])
def test_fraction_refuses_nonsense_time(us):
    with pytest.raises(ValueError):
        bound(1e9, 1e6, 100.0, 100.0).fraction(us)


def test_read_peaks_newest_of_this_gpu(tmp_path):
    path = calibration_file(tmp_path)
    path.parent.mkdir(parents=True)
    lines = [
        {"gpu": "NVIDIA H200", "bf16_tflops": 700.0, "copy_gbps": 4000.0, "fp8_tflops": 1400.0},
        {"gpu": "NVIDIA H100 80GB HBM3", "bf16_tflops": 650.0, "copy_gbps": 3000.0},
        "not json",
        {"gpu": "NVIDIA H200", "bf16_tflops": -3, "copy_gbps": 4000.0},
        {"gpu": "NVIDIA H200", "bf16_tflops": 774.0, "copy_gbps": 4200.0},
    ]
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    warn: list[str] = []
    p = read_peaks(tmp_path, "NVIDIA H200", warn)
    # newest usable line wins
    assert p == Peaks("NVIDIA H200", 774.0, 4200.0, 1400.0)
    assert len(warn) == 2 and all("calibration.jsonl:" in w for w in warn)
    assert read_peaks(tmp_path, "NVIDIA B200") is None
    assert read_peaks(tmp_path / "nowhere", "NVIDIA H200") is None


def test_roofline_fields():
    peaks = Peaks("G", bf16_tflops=1000.0, copy_gbps=1000.0)
    f = roofline_fields(1e12, 1e6, 2000.0, peaks)  # bound 1000 µs, measured 2000 µs
    assert f == {"roofline": 0.5, "bound_us": 1000.0, "bound_by": "compute"}
    assert "not calibrated" in roofline_fields(1e12, 1e6, 2000.0, None)["roofline"]
    assert "fp8" in roofline_fields(1e12, 1e6, 2000.0, peaks, peak="fp8")["roofline"]
    assert all(isinstance(v, str) or math.isfinite(v) for v in f.values())


def test_timing_summary_and_passes():
    s = summarize([10.0, 11.0, 12.0, 13.0, 100.0])
    assert s["us"] == 12.0 and s["spread"] == pytest.approx(90 / 12) and s["p10_us"] == 10.0 and s["p90_us"] == 100.0
    assert passes(32, 20) == 1 and passes(2, 20) == 10 and passes(1, 1) == 1 and passes(3, 0) == 1
    with pytest.raises(ValueError):
        summarize([])
    # rotations push the working set past 3x L2
    assert rotations(6 << 20, l2_bytes=60 << 20) == 30 and rotations(1 << 30, l2_bytes=60 << 20) == 2


def test_the_read_peak_is_used_when_higher_and_named():
    both = Peaks("G", bf16_tflops=1000.0, copy_gbps=3000.0, read_gbps=3300.0)
    f = roofline_fields(0.0, 3.3e9, 1100.0, both)  # 3.3 GB at 3.3 TB/s: 1000 µs
    assert f["bound_us"] == 1000.0 and f["peak_gbps"] == 3300.0 and f["peak_by"] == "read" and f["roofline"] < 1
    assert "roofline_error" not in f
    low = Peaks("G", bf16_tflops=1000.0, copy_gbps=3000.0, read_gbps=2000.0)
    assert roofline_fields(0.0, 3e9, 2000.0, low)["peak_by"] == "copy"


def test_a_fraction_above_one_is_flagged_as_a_measurement_error():
    f = roofline_fields(0.0, 3.27e9, 1000.0, Peaks("G", bf16_tflops=1000.0, copy_gbps=3000.0))  # I2's 109 %
    assert f["roofline"] == pytest.approx(1.09) and "measurement error" in f["roofline_error"]
    assert f["roofline_error"].startswith("109% of the roofline")


def test_read_peaks_keeps_the_read_bandwidth(tmp_path):
    path = calibration_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"gpu": "G", "bf16_tflops": 700.0, "copy_gbps": 3000.0, "read_gbps": 3350.0}) + "\n")
    p = read_peaks(tmp_path, "G")
    assert p.read_gbps == 3350.0 and p.memory == (3350.0, "read")


def test_the_dashboard_flags_a_roofline_above_100_percent():
    from harness.workflows.dashboard import roofline_text
    from tests.test_bench import _bench_record

    over = _bench_record(roofline=1.04)
    assert roofline_text([over], "abc") == "104% ✗ >100%: a measurement error"
    assert roofline_text([over], "abc", compact=True) == "104%✗"
    assert roofline_text([_bench_record()], "abc", compact=True) == "31%"
