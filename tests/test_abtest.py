"""abtest.py: the A/B verdict's error rates on synthetic samples (shared drift, own noise)."""

import numpy as np
import pytest

from harness.execution import abtest


def _samples(rng: np.random.Generator, slowdown: float, own_sd: float, rounds: int = abtest.DEFAULT_ROUNDS,
             drift_sd: float = 0.03, us: float = 100.0) -> tuple[list[float], list[float]]:
    drift = 1 + rng.normal(0, drift_sd, rounds)
    a = us * drift * (1 + rng.normal(0, own_sd, rounds))
    b = us * (1 + slowdown) * drift * (1 + rng.normal(0, own_sd, rounds))
    return list(a), list(b)


@pytest.mark.parametrize("change, own_sd, rng_seed, n, want, least", [
    (0.0, 0.01, 1, 200, abtest.NO_CHANGE, 190), (0.0, 0.02, 1, 200, abtest.NO_CHANGE, 190),  # A/A: 95 %
    (0.05, 0.01, 2, 200, abtest.SLOWER, 190), (0.05, 0.02, 2, 200, abtest.SLOWER, 190),  # planted 5 % slowdown: 95 %
    (-0.05, 0.01, 3, 50, abtest.FASTER, 48)])  # planted 5 % speedup
def test_verdict_error_rates(change, own_sd, rng_seed, n, want, least):
    rng = np.random.default_rng(rng_seed)
    verdicts = [abtest.compare(*_samples(rng, change, own_sd), resamples=500, seed=i).verdict for i in range(n)]
    assert verdicts.count(want) >= least, {v: verdicts.count(v) for v in set(verdicts)}


def test_never_slower_or_faster_when_the_interval_holds_one():
    rng = np.random.default_rng(4)
    for i in range(300):  # the rule holds every time
        a, b = _samples(rng, float(rng.uniform(-0.1, 0.1)), float(rng.uniform(0.005, 0.2)),
                        rounds=int(rng.integers(5, 30)), drift_sd=float(rng.uniform(0, 0.1)))
        c = abtest.compare(a, b, resamples=200, seed=i)
        assert c.lo <= c.hi
        if c.lo <= 1 <= c.hi:
            assert c.verdict == abtest.NO_CHANGE, c
        if c.verdict == abtest.SLOWER:
            assert c.lo > 1 and c.ratio > 1 + c.threshold
    assert abtest.verdict(1.2, 0.99, 1.4) == abtest.NO_CHANGE
    assert abtest.verdict(1.02, 1.01, 1.03) == abtest.NO_CHANGE  # real but under the threshold
    assert abtest.verdict(1.05, 1.01, 1.09) == abtest.SLOWER


def test_seeded_and_reported():
    rng = np.random.default_rng(5)
    a, b = _samples(rng, 0.05, 0.01)
    c1, c2 = abtest.compare(a, b, seed=7), abtest.compare(a, b, seed=7)
    assert c1 == c2
    assert c1.a_us == pytest.approx(float(np.median(a))) and c1.ratio == pytest.approx(c1.b_us / c1.a_us)
    d = c1.to_dict()
    assert set(d) >= {"a_us", "b_us", "ratio", "lo", "hi", "verdict", "threshold", "level", "rounds", "method"}
    assert "slower" in c1.line() and "[" in c1.line()


@pytest.mark.parametrize("a,b", [([1.0] * 10, [1.0] * 9), ([1.0] * 3, [1.0] * 3), ([1.0] * 9 + [float("nan")], [1.0] * 10),
                                 ([1.0] * 9 + [0.0], [1.0] * 10)])
def test_refuses_samples_it_cannot_compare(a, b):
    with pytest.raises(ValueError):
        abtest.compare(a, b)


def test_interleave_alternates_who_goes_first():
    assert abtest.interleave(3) == ["A", "B", "B", "A", "A", "B"]
