"""Timing a launch: CUDA events around a CUDA graph of launches (or plain launches when a
graph cannot be captured), warm-up first, the median of many repetitions, and inputs rotated
over enough copies that the L2 cache cannot hold them all."""

from __future__ import annotations

import math
import statistics
from typing import Callable

L2_BYTES_GUESS = 64 << 20  # H100 50 MB, H200 60 MB; B200 126 MB (rounded up where unknown)


def rotations(bytes_per_set: int, l2_bytes: int = L2_BYTES_GUESS, cap: int = 64) -> int:
    """How many input/output sets to cycle through so the working set exceeds 3x L2."""
    if bytes_per_set <= 0:
        return 1
    return max(2, min(cap, math.ceil(3 * l2_bytes / bytes_per_set)))


def l2_bytes() -> int:
    """The current GPU's L2 size (the guess when torch does not say)."""
    import torch

    size = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    return int(size) if isinstance(size, int) and size > 0 else L2_BYTES_GUESS


def passes(n_sets: int, min_launches: int) -> int:
    """Passes over `n_sets` rotated sets a timed repetition makes to hold at least `min_launches`
        launches (fewer gaps and less event overhead per launch)."""
    return max(1, math.ceil(max(1, min_launches) / max(1, n_sets)))


def summarize(times_us: list[float]) -> dict:
    """Median, relative spread ((max - min) / median) and the 10th/90th percentiles of per-launch times."""
    if not times_us:
        raise ValueError("no repetitions to summarize")
    ts = sorted(times_us)
    med = statistics.median(ts)

    def pct(q: float) -> float:
        return ts[min(len(ts) - 1, max(0, round(q * (len(ts) - 1))))]

    return {"us": med, "spread": (ts[-1] - ts[0]) / max(med, 1e-9), "p10_us": pct(0.1), "p90_us": pct(0.9)}


def gpu_clocks() -> dict:
    """The current GPU's name and clocks (MHz) right now, via nvidia-smi (what is known; {} when not)."""
    import subprocess

    import torch

    out: dict = {}
    try:
        i = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(i)
        out["gpu_name"] = props.name
        bus = getattr(props, "pci_bus_id", None)
        domain = getattr(props, "pci_domain_id", 0)
        dev = getattr(props, "pci_device_id", 0)
        sel = ["-i", f"{domain:08x}:{bus:02x}:{dev:02x}.0"] if isinstance(bus, int) else []
        res = subprocess.run(["nvidia-smi", *sel, "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,"
                              "power.draw", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
        fields = res.stdout.strip().splitlines()[0].split(",") if res.returncode == 0 and res.stdout.strip() else []
        for key, text in zip(("sm_mhz", "sm_max_mhz", "mem_mhz", "temp_c", "power_w"), fields):
            try:
                v = float(text.strip())
            except ValueError:
                continue
            if math.isfinite(v):
                out[key] = v
    except Exception:  # clocks are a note on the number, never a reason to lose it
        pass
    return out


def bench(launches: list[Callable[[], None]], reps: int = 30, warmup: int = 3, min_launches: int = 1) -> dict:
    """Median µs of one launch.  `launches`: closures over distinct (rotated) argument sets; one
        repetition runs them all `passes(len(launches), min_launches)` times, as one CUDA graph where
        the launches allow it (else plain launches between events)."""
    timer = Timer(launches, warmup, min_launches)
    return {**summarize(timer.sample(reps)), "reps": reps, "rot": len(launches), "launches": timer.launches,
            "method": timer.method}


class Timer:
    """One kernel ready to time (warmed up, a repetition captured as a CUDA graph where possible):
        `sample(reps)` gives per-launch µs.  An A/B comparison holds two and asks each for a round
        in turn, so both see the same clocks."""

    def __init__(self, launches: list[Callable[[], None]], warmup: int = 3, min_launches: int = 1) -> None:
        import torch

        self._torch = torch
        rounds = passes(len(launches), min_launches)
        self.launches = len(launches) * rounds
        stream = torch.cuda.current_stream()
        for _ in range(warmup):
            for f in launches:
                f()
        torch.cuda.synchronize()

        self.method = "graph"
        graph = torch.cuda.CUDAGraph()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                with torch.cuda.graph(graph, stream=side):
                    for _ in range(rounds):
                        for f in launches:
                            f()
            stream.wait_stream(side)
            torch.cuda.synchronize()
            graph.replay()  # the first replay uploads the graph: keep it out of the numbers
            torch.cuda.synchronize()
            self._graph = graph
            self.run_once: Callable[[], None] = graph.replay
        except Exception:  # a launch path that cannot be captured: time plain launches
            self.method = "events"
            torch.cuda.synchronize()

            def run_once() -> None:
                for _ in range(rounds):
                    for f in launches:
                        f()
            self.run_once = run_once

    def sample(self, reps: int) -> list[float]:
        torch = self._torch
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.run_once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.launches)
        return times
