"""quad_store.py: the quad transpose as numpy lanes; its accumulator layout vs CuTe's."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stages.common.quad_store import accumulator_coordinate, quad_transpose

ROOT = Path(__file__).resolve().parents[1]


def _lanes(words):
    """quad_transpose for a quad's 4 threads: value k of every word is thread k's."""
    q = np.arange(4)
    return quad_transpose(words, q, lambda v, bit: v[q ^ bit], np.where)


def test_transpose_gives_each_thread_one_group():
    # thread s holds word i = 100·s + i
    words = [np.array([100 * s + i for s in range(4)]) for i in range(4)]
    got = _lanes(words)
    for i in range(4):  # after: word i of thread s is thread i's word s
        assert list(got[i]) == [100 * i + s for s in range(4)]


def test_transpose_is_not_the_identity_on_any_lane():
    words = [np.array([100 * s + i for s in range(4)]) for i in range(4)]
    got = _lanes(words)
    moved = sum(int(got[i][s] != words[i][s]) for i in range(4) for s in range(4))
    assert moved == 12  # only the diagonal stays


def test_transpose_takes_four_words():
    with pytest.raises(ValueError):
        _lanes([np.zeros(4)] * 3)


def test_coordinates_of_a_quad_tile_16_contiguous_bytes():
    # word (h, g) of the quad: 8 consecutive columns
    for h in (0, 1):
        for g in (0, 5, 31):
            cols = sorted(accumulator_coordinate(t, 4 * g + 2 * h + e)[1] for t in range(4) for e in (0, 1))
            rows = {accumulator_coordinate(t, 4 * g + 2 * h + e)[0] for t in range(4) for e in (0, 1)}
            assert cols == list(range(8 * g, 8 * g + 8)) and rows == {8 * h}


_LAYOUT_PROBE = """
import cutlass
import cutlass.cute as cute
from stages.E_sparse_decode.sm90 import Kernel
from stages.common.quad_store import check_accumulator_layout

@cute.jit
def trace():
    k = Kernel(b=2, config="s1h64_m64bs64", kv_format="model1", splits=1)
    _, pv_mma = k.tiled_mmas(cutlass.BFloat16)
    check_accumulator_layout(pv_mma, (64, 512), [0, 1, 2, 3, 5, 31, 45, 128, 131, 255], 256)
    print("FITS")
    try:  # a wrong column split is caught
        check_accumulator_layout(pv_mma, (64, 512), [128], 128)
    except ValueError as e:
        print("REFUSED", e)

trace()
"""


def test_accumulator_layout_matches_cute(tmp_path):
    """E's P·V accumulator is where accumulator_coordinate says; a wrong one refused."""
    pytest.importorskip("cutlass")
    probe = tmp_path / "probe.py"
    probe.write_text(_LAYOUT_PROBE)
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-2000:]
    assert "FITS" in out and "REFUSED" in out and "thread 128" in out, out[-2000:]
