"""The roofline: the fastest a kernel could run on this GPU, from its FLOPs and bytes and the
GPU's measured peaks (`dsv4-lab calibrate`, results/calibration.jsonl).

    compute time  = flops / peak_flops
    memory time   = bytes / peak_bandwidth      (inputs read once, outputs written once; the
                                                 higher calibrated bandwidth — `peak_by`)
    bound         = max(compute time, memory time)
    fraction      = bound / measured time        (1.0: at the roofline)

A fraction above 1 is a measurement error, said so in `roofline_error`.  No torch, no GPU."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.paths import results_dir


@dataclass(frozen=True)
class Peaks:
    """A GPU's measured ceilings."""

    gpu: str
    bf16_tflops: float
    copy_gbps: float
    fp8_tflops: float | None = None
    read_gbps: float | None = None  # read-only streaming (calibrations before issue 29 have none)

    def tflops(self, peak: str) -> float | None:
        return self.fp8_tflops if peak == "fp8" else self.bf16_tflops

    @property
    def memory(self) -> tuple[float, str]:
        """The memory peak the roofline uses and which measurement it is: the higher of the
        read-only streaming bandwidth and the copy's (read + write)."""
        if self.read_gbps is not None and self.read_gbps > self.copy_gbps:
            return self.read_gbps, "read"
        return self.copy_gbps, "copy"


@dataclass(frozen=True)
class Bound:
    compute_us: float
    memory_us: float

    @property
    def us(self) -> float:
        return max(self.compute_us, self.memory_us)

    @property
    def limiter(self) -> str:
        return "compute" if self.compute_us >= self.memory_us else "memory"

    def fraction(self, measured_us: float) -> float:
        """bound / measured: the share of the roofline the measured time reaches."""
        if not (math.isfinite(measured_us) and measured_us > 0):
            raise ValueError(f"measured time {measured_us!r} µs is not a positive number")
        return self.us / measured_us


def bound(flops: float, nbytes: float, peak_tflops: float, peak_gbps: float) -> Bound:
    """The roofline bound of `flops` and `nbytes` at the given peaks (TFLOP/s, GB/s)."""
    for name, v in (("flops", flops), ("bytes", nbytes)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} {v!r} is not a non-negative number")
    for name, v in (("peak TFLOP/s", peak_tflops), ("peak GB/s", peak_gbps)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} {v!r} is not a positive number")
    return Bound(compute_us=flops / (peak_tflops * 1e12) * 1e6, memory_us=nbytes / (peak_gbps * 1e9) * 1e6)


def calibration_file(root: Path) -> Path:
    return results_dir(root) / "calibration.jsonl"


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def read_peaks(root: Path, gpu: str, warn: list[str] | None = None) -> Peaks | None:
    """The newest calibration of GPU `gpu` (None: never calibrated); an unusable line is skipped with a
        warning in `warn`."""
    from harness.core.jsonl import read_bytes  # a regular file only (harness/core/safeio.py)

    path = calibration_file(root)
    data = read_bytes(path, warn)
    if data is None:
        return None
    found: Peaks | None = None
    for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            if warn is not None:
                warn.append(f"{path.name}:{i}: not JSON — line skipped")
            continue
        if not isinstance(d, dict) or d.get("gpu") != gpu:
            continue
        if not (_positive(d.get("bf16_tflops")) and _positive(d.get("copy_gbps"))):
            if warn is not None:
                warn.append(f"{path.name}:{i}: bf16_tflops / copy_gbps missing or not positive — line skipped")
            continue
        fp8 = d.get("fp8_tflops")
        read = d.get("read_gbps")
        found = Peaks(gpu=gpu, bf16_tflops=float(d["bf16_tflops"]), copy_gbps=float(d["copy_gbps"]),
                      fp8_tflops=float(fp8) if _positive(fp8) else (found.fp8_tflops if found else None),
                      read_gbps=float(read) if _positive(read) else None)
    return found


def roofline_fields(flops: float | None, nbytes: float, us: float, peaks: Peaks | None, peak: str = "bf16") -> dict:
    """The record's roofline keys for a measured time: fraction, bound µs and what limits it; or
    a one-line `roofline` string saying why there is no fraction."""
    if peaks is None:
        return {"roofline": "not calibrated (run dsv4-lab calibrate on this GPU)"}
    tf = peaks.tflops(peak)
    if tf is None:
        return {"roofline": f"no {peak} peak calibrated (run dsv4-lab calibrate --fp8)"}
    gbps, by = peaks.memory
    b = bound(flops or 0.0, nbytes, tf, gbps)
    out: dict[str, Any] = {"roofline": round(b.fraction(us), 4), "bound_us": round(b.us, 3), "bound_by": b.limiter}
    if peaks.read_gbps is not None:  # a calibration that measured both: say which one the bound used
        out.update(peak_gbps=gbps, peak_by=by)
    if out["roofline"] > 1.0:
        out["roofline_error"] = (f"{out['roofline']:.0%} of the roofline: faster than the calibrated peak "
                                 f"({b.limiter}) — a measurement error (recalibrate: dsv4-lab calibrate; or the "
                                 "stage counts bytes or flops it does not move)")
    return out
