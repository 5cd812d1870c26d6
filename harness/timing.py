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


def bench(launches: list[Callable[[], None]], reps: int = 30, warmup: int = 3) -> dict:
    """Median µs of one launch. `launches` are closures over distinct (rotated) argument sets;
    one repetition runs each once."""
    import torch

    stream = torch.cuda.current_stream()
    for _ in range(warmup):
        for f in launches:
            f()
    torch.cuda.synchronize()

    method = "graph"
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, stream=side):
                for f in launches:
                    f()
        stream.wait_stream(side)
        torch.cuda.synchronize()
        run_once = graph.replay
    except Exception:  # a launch path that cannot be captured: time plain launches
        method = "events"
        torch.cuda.synchronize()

        def run_once() -> None:
            for f in launches:
                f()

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(launches))
    return {"us": statistics.median(times), "spread": (max(times) - min(times)) / max(statistics.median(times), 1e-9),
            "reps": reps, "rot": len(launches), "method": method}
