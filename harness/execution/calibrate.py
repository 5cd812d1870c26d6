"""`dsv4-lab calibrate`: this GPU's ceilings, measured and recorded — dense bf16 tensor-core
throughput, FP8 when asked (torch._scaled_mm), and memory bandwidth two ways (a device copy, a
read-only sum; the roofline uses the higher).  One line per calibration in
results/calibration.jsonl with the GPU's name, clocks and driver."""

from __future__ import annotations

import json
from pathlib import Path

from harness.execution.roofline import calibration_file

MATMUL = 8192  # M = N = K: 1.1 TFLOP per product, a few ms on an H100
COPY_BYTES = 1 << 30  # 1 GiB each way: far past any L2


def measure(fp8: bool = False, reps: int = 20) -> dict:
    """The peaks of the current GPU (needs one)."""
    import torch

    from harness.core.environment import gpu_environment
    from harness.execution.timing import bench, gpu_clocks

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(MATMUL, MATMUL, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(MATMUL, MATMUL, device=dev, dtype=torch.bfloat16, generator=g)
    c = torch.empty(MATMUL, MATMUL, device=dev, dtype=torch.bfloat16)
    flops = 2.0 * MATMUL ** 3
    mm = bench([lambda: torch.matmul(a, b, out=c)], reps=reps, warmup=3, min_launches=5)
    out: dict = {"bf16_tflops": round(flops / (mm["us"] * 1e-6) / 1e12, 1), "bf16_spread": round(mm["spread"], 4),
                 "matmul": f"{MATMUL}^3 bf16 torch.matmul"}
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()  # B column-major
        one = torch.ones((), device=dev, dtype=torch.float32)
        t8 = bench([lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)], reps=reps, warmup=3,
                   min_launches=5)
        out.update(fp8_tflops=round(flops / (t8["us"] * 1e-6) / 1e12, 1), fp8_spread=round(t8["spread"], 4))
    del a, b, c
    src = torch.randint(-100, 100, (COPY_BYTES,), dtype=torch.int8, device=dev, generator=g)
    dst = torch.empty_like(src)
    cp = bench([lambda: dst.copy_(src)], reps=reps, warmup=3, min_launches=5)
    out.update(copy_gbps=round(2 * COPY_BYTES / (cp["us"] * 1e-6) / 1e9, 1), copy_spread=round(cp["spread"], 4),
               copy=f"{COPY_BYTES >> 20} MiB device copy, read + write counted")
    del src, dst
    ro = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device=dev)
    total = torch.empty((), dtype=torch.float32, device=dev)
    rd = bench([lambda: torch.sum(ro, out=total)], reps=reps, warmup=3, min_launches=5)
    out.update(read_gbps=round(COPY_BYTES / (rd["us"] * 1e-6) / 1e9, 1), read_spread=round(rd["spread"], 4),
               read=f"{COPY_BYTES >> 20} MiB read-only stream (torch.sum of fp32), bytes read counted")
    del ro
    env = gpu_environment()
    clocks = gpu_clocks()
    return {"gpu": env.get("gpu", clocks.get("gpu_name", "?")), "cc": env.get("cc"), "driver": env.get("driver"),
            "cuda": env.get("cuda"), "torch": env.get("torch"), "host": env.get("host"),
            **{k: v for k, v in clocks.items() if k != "gpu_name"}, **out}


def main(root: Path, fp8: bool = False) -> int:
    """Measure and record; 1 with one line when there is no GPU here (nothing was measured)."""
    from rich.console import Console

    from harness.core.notebooklock import lock_path
    from harness.notebook.records import Appender, now_iso

    console = Console(highlight=False, markup=False)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        console.print("no GPU here: nothing was measured (run dsv4-lab calibrate on the GPU machine)")
        return 1
    rec = {"t": now_iso(), **measure(fp8=fp8)}
    rec = {k: v for k, v in rec.items() if v is not None}
    path = calibration_file(root)
    a = Appender(path, lock_path(path.parent))
    try:
        a.write(json.dumps(rec, separators=(",", ":"), allow_nan=False))
    finally:
        a.close()
    fp8_text = f", fp8 {rec['fp8_tflops']} TFLOP/s" if "fp8_tflops" in rec else ""
    console.print(f"{rec['gpu']}: bf16 {rec['bf16_tflops']} TFLOP/s{fp8_text}, copy {rec['copy_gbps']} GB/s, "
                  f"read {rec.get('read_gbps', '?')} GB/s "
                  f"(SM clock {rec.get('sm_mhz', '?')} of {rec.get('sm_max_mhz', '?')} MHz) — recorded in "
                  f"{path.relative_to(root) if path.is_relative_to(root) else path}")
    return 0
