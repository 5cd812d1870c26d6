"""A/B statistics for two kernels timed interleaved: is B faster, slower, or no detectably different?

Input: per-round medians `a` and `b` of equal length, round i of A and of B timed back to back on
the same rotated inputs, so the rounds are *paired* (a clock change moves both).

The estimate is the ratio of medians, `median(b) / median(a)` (above 1: B is slower).  Its
interval is a **paired percentile bootstrap of the ratio of medians**: `resamples` times draw n
round indices with replacement (one seeded Generator) and take the ratio of the drawn rounds'
medians; the interval is the (1 - level)/2 and (1 + level)/2 quantiles.  Resampling whole rounds
keeps the pairing, so a drift shared by A and B does not widen it.

The verdict, at `threshold` (default 3 %) and the interval's level (default 95 %):
  slower                 the ratio is above 1 + threshold AND the interval lies above 1;
  faster                 the ratio is below 1 - threshold AND the interval lies below 1;
  no detectable change   anything else (noise on shared machines is of the threshold's order).

numpy only (tests/test_abtest.py proves its error rates; docs/BENCH.md how the lab uses it)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

DEFAULT_THRESHOLD = 0.03
DEFAULT_LEVEL = 0.95
DEFAULT_RESAMPLES = 2000
DEFAULT_ROUNDS = 40  # interleaved rounds per kernel: the median's noise ~ 1.25 σ / √40 ≈ 0.2 σ
MIN_ROUNDS = 5

SLOWER, FASTER, NO_CHANGE = "slower", "faster", "no detectable change"
METHOD = "paired bootstrap of the ratio of medians"


@dataclass(frozen=True)
class Comparison:
    """B against A: both medians (µs), ratio = b_us / a_us, its interval [lo, hi], the verdict."""

    a_us: float
    b_us: float
    ratio: float
    lo: float
    hi: float
    verdict: str
    threshold: float
    level: float
    rounds: int
    method: str = METHOD

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """One line: `B/A 1.052 [1.041, 1.063] slower (threshold 3 %, 95 % interval, 40 rounds)`."""
        return (f"B/A {self.ratio:.3f} [{self.lo:.3f}, {self.hi:.3f}] {self.verdict} "
                f"(threshold {self.threshold * 100:g} %, {self.level * 100:g} % interval, {self.rounds} rounds)")


def verdict(ratio: float, lo: float, hi: float, threshold: float = DEFAULT_THRESHOLD) -> str:
    """faster / slower / no detectable change (the module's rule: beyond the threshold AND the
    interval excluding 1)."""
    if ratio > 1 + threshold and lo > 1:
        return SLOWER
    if ratio < 1 - threshold and hi < 1:
        return FASTER
    return NO_CHANGE


def compare(a: Sequence[float], b: Sequence[float], threshold: float = DEFAULT_THRESHOLD,
            level: float = DEFAULT_LEVEL, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Comparison:
    """B against A from paired per-round medians (module doc). ValueError for samples that cannot
        be compared (unequal lengths, fewer than MIN_ROUNDS, a non-positive or non-finite time, a
        threshold or level out of range)."""
    import numpy as np

    if len(a) != len(b):
        raise ValueError(f"A has {len(a)} rounds and B {len(b)}: interleaved samples are paired")
    if len(a) < MIN_ROUNDS:
        raise ValueError(f"{len(a)} rounds: at least {MIN_ROUNDS} are needed for an interval")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in (*a, *b)):
        raise ValueError("every round's time must be a positive finite number of µs")
    if not (0 <= threshold < 1) or not (0 < level < 1) or resamples < 100:
        raise ValueError("threshold in [0, 1), level in (0, 1), resamples >= 100")
    xa = np.asarray(a, dtype=float)
    xb = np.asarray(b, dtype=float)
    a_us, b_us = float(np.median(xa)), float(np.median(xb))
    ratio = b_us / a_us
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(xa), size=(resamples, len(xa)))
    boot = np.median(xb[idx], axis=1) / np.median(xa[idx], axis=1)
    lo, hi = (float(q) for q in np.quantile(boot, [(1 - level) / 2, (1 + level) / 2]))
    return Comparison(a_us, b_us, ratio, lo, hi, verdict(ratio, lo, hi, threshold), threshold, level, len(xa))


def interleave(n_rounds: int, kernels: Sequence[str] = ("A", "B")) -> list[str]:
    """The timing order: AB BA AB … for `n_rounds` rounds, so neither kernel always runs on the warmer
        GPU."""
    order: list[str] = []
    for i in range(n_rounds):
        order += list(kernels) if i % 2 == 0 else list(reversed(kernels))
    return order


def interleaved(timers: "dict[str, Callable[[], float]]", rounds: int) -> dict[str, list[float]]:
    """Time each kernel `rounds` times in the `interleave` order (AB BA AB …; `timers[name]()` one
        round's median µs). Returns each kernel's per-round medians in round order (paired)."""
    names = list(timers)
    out: dict[str, list[float]] = {name: [] for name in names}
    for name in interleave(rounds, names):
        out[name].append(float(timers[name]()))
    return out
