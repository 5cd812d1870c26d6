"""Stage E at topk up to 32768 on the CPU: idx windows, smem, refusals, sm100 scratch, compiles."""

import hashlib
import json

import pytest

from oracles import sparse_decode as sd
from stages.common import idx_windows as iw
from stages.common.device import SMEM_LIMIT
from stages.E_sparse_decode import sm100, sm90
from tests.conftest import e_sm90_builds

KEYS = 64


# -- the window protocol, on ints


def _simulate(tile_begin: int, tile_end: int, main_tiles: int, topk: int, extra_topk: int, window: int = iw.WINDOW_TILES):
    """The producer's window order: (list, position) per key; no buffer overwritten unread."""
    buf: list = [None] * (2 * window * KEYS)
    holds: list = [None, None]  # the window each buffer holds

    def position(tile: int, key: int):  # Kernel.list_position
        pos = tile * KEYS + key
        return ("main", pos) if tile < main_tiles else ("extra", pos - main_tiles * KEYS)

    def issue(w: int) -> None:
        assert holds[w % 2] in (None, w - 2), (w, holds)  # the buffer's window is behind every reader
        for j in range(window * KEYS):
            t_off, key = iw.window_tile(w, j, KEYS, window)
            tile = tile_begin + t_off
            if tile < tile_end:
                branch, pos = position(tile, key)
                if pos < (topk if branch == "main" else extra_topk):
                    buf[iw.window_slot(w, j, KEYS, window)] = (branch, pos)
        holds[w % 2] = w

    issue(0)
    issue(1)
    read = []
    for i in range(tile_end - tile_begin):
        if iw.boundary(i, window):
            w = i // window
            assert holds[w % 2] == w, (i, holds)  # the window of this tile has landed
            issue(w + 1)
        assert holds[(i // window) % 2] == i // window
        read.append([buf[iw.entry(i, key, KEYS, window)] for key in range(KEYS)])
    return read


@pytest.mark.parametrize("seg", [
    (0, 256, 256, 16384, 0),  # topk 16384, one sequence a segment: 16 windows
    (172, 256, 256, 16384, 0),  # from tile 172: windows count from it
    (0, 44, 20, 1250, 1500),  # window 1 crosses into the extra list
    (0, 48, 32, 2048, 1024),  # window 2 is the extra list
    (3, 36, 20, 1250, 1500),  # 33 tiles from tile 3: a last window of one tile
    (0, 512, 512, 32768, 0),  # the largest list
])
def test_every_tile_reads_its_own_entries_from_the_windows(seg):
    tile_begin, tile_end, main_tiles, topk, extra_topk = seg
    read = _simulate(*seg)
    for i, keys in enumerate(read):
        tile = tile_begin + i
        for key, got in enumerate(keys):
            pos = tile * KEYS + key
            want = ("main", pos) if tile < main_tiles else ("extra", pos - main_tiles * KEYS)
            if want[1] < (topk if want[0] == "main" else extra_topk):
                assert got == want, (i, key, got)
            # past a list nothing is copied nor taken


def test_a_window_offset_off_by_one_is_caught():
    """The simulation is not blind: reading at i mod 2W hands window 1 window 0's entries."""
    real = iw.entry
    try:
        iw.entry = lambda i, key, keys, window=iw.WINDOW_TILES: (i % window) * keys + key
        with pytest.raises(AssertionError):
            test_every_tile_reads_its_own_entries_from_the_windows((0, 256, 256, 16384, 0))
    finally:
        iw.entry = real


# -- the kernel's plan


def _old_smem(k: sm90.Kernel) -> int:
    """Shared memory asked before streaming: the segment's entries whole."""
    return 2 * (64 * 512 + 2 * 64 * 512 + 64 * 64) + 4 * k.sched.chunk * 64 + 4 * 64 + 4096


def test_segments_stream_only_past_two_windows_and_the_shared_memory_counts_the_windows():
    for config, splits, streamed in (("s2h128_m128bs256_x1024bs64", 1, False), ("s2h64_m2048bs64", 1, False),
                                     ("s2h64_m2112bs64", 1, True), ("s2h64_m16384bs256", 1, True),
                                     ("s2h64_m16384bs256", "auto", False), ("s1h128_m32768bs256", 1, True)):
        k = sm90.Kernel(b=1, config=config, kv_format="model1", splits=splits)
        assert k.streams == streamed == (k.sched.chunk > 32), config
        if streamed:
            assert k.staged_tiles == 2 * iw.WINDOW_TILES == 32
            assert k.smem_bytes == 204800 + 4 * 32 * 64 + 4352 == 217344
        else:
            assert k.staged_tiles == k.sched.chunk and k.smem_bytes == _old_smem(k), config  # as before
    # refused before; streamed it fits
    assert _old_smem(sm90.Kernel(b=1, config="s2h64_m16384bs256", kv_format="model1", splits=1)) == 274688 > SMEM_LIMIT


def test_without_streaming_topk_16384_is_refused_as_before(monkeypatch):
    """Staged whole, topk 16384 is refused with the issue's message."""
    monkeypatch.setattr(sm90, "streams", lambda chunk: False)
    monkeypatch.setattr(sm90, "staged_tiles", lambda chunk: chunk)
    monkeypatch.setattr(sm90, "staged_bytes", lambda chunk, keys: 4 * keys * chunk)
    with pytest.raises(ValueError, match="274688 bytes of shared memory needed, 232448 available"):
        sm90.Kernel(b=1, config="s2h64_m16384bs256", kv_format="model1", splits=1)


@pytest.mark.parametrize("config", ["s1h64_m32768bs64", "s2h128_m32768bs256_x32768bs64", "s1h64_m64bs64_x32768bs2"])
def test_every_list_up_to_32768_fits_and_longer_is_refused_in_one_line(config):
    k = sm90.Kernel(b=1, config=config, kv_format="model1", splits=1)
    assert k.streams and k.smem_bytes <= SMEM_LIMIT
    sm100.Kernel(b=1, config=config, kv_format="model1", splits="auto")
    over = config.replace("32768", "32832")
    for kernel, name in ((sm90.Kernel, "stage E sm90"), (sm100.Kernel, "stage E sm100")):
        with pytest.raises(ValueError) as e:
            kernel(b=1, config=over, kv_format="model1", splits=1)
        msg = str(e.value)
        assert msg.startswith(f"{name}: topk ") and "at most 32768 a list" in msg and "\n" not in msg, msg


def test_sm100_auto_scratch_is_capped():
    """sm100's "auto" at topk 16384 is capped to AUTO_SPLITS (32); short configs keep 18."""
    case = dict(b=2, config="s2h128_m16384bs256", kv_format="model1", scenario="sink", splits="auto")
    cap = sd.split_capacity(case)
    assert cap == sd.AUTO_SPLITS == 32
    o_part = next(t for t in sd.tensors(case) if t.name == "O_part")
    assert o_part.shape[0] == 32 and 32 * 2 * 2 * 128 * 512 * 4 <= 40 << 20  # 32 MiB, not 268 MB
    assert sd.split_capacity({**case, "config": "s2h128_m128bs256_x1024bs64"}) == 18
    assert sd.split_capacity({**case, "splits": 1}) == 1
    # sm90's persistent parts keep their own capacity
    b1 = dict(b=1, config="s1h128_m32768bs256", kv_format="model1", scenario="sink", splits="auto")
    k = sm90.Kernel(b=1, config=b1["config"], kv_format="model1", splits="auto")
    assert sd.split_capacity(b1) == max(32, k.splits) and k.splits <= sd.split_capacity(b1)


# -- compiled


def _sm90_ptx(tmp_path, monkeypatch, cases, fixture: str = ""):
    """PTX of E's sm90 kernel (or a fixture's) per (b, config, kv_format, splits)."""
    builds = e_sm90_builds(tmp_path, monkeypatch, [dict(b=b, config=config, kv_format=fmt, scenario="plain", splits=splits,
                                                        epilogue="bf16") for b, config, fmt, splits in cases], fixture)
    return dict(zip(cases, builds))


# sha256 of production configs' whole PTX, same before (67fc0d9) and after streaming.
# A deliberate change of E's default kernel changes them: update them and prove it on a GPU.
PRODUCTION_PTX = {
    (2, "s2h128_m128bs256_x1024bs64", "model1", "auto"): "f67903ff020471440cd92f79ae35873d63e85aa9429963286ccaeb5f0d3282c8",
    (64, "s2h64_m128bs256_x1024bs64", "model1", "auto"): "7338ca40c17315f3c1f64165699d2e01fea3d09de3da33f01c77d6e889480308",
}


def test_sm90_streams_topk_16384_and_32768_and_the_production_ptx_is_unchanged(project_root, tmp_path, monkeypatch):
    """topk 16384 / 32768 stream by cp.async, spills bounded; production PTX unchanged."""
    streamed = [(1, "s2h64_m16384bs256", "model1", 3), (1, "s1h128_m32768bs256", "model1", 1)]
    got = _sm90_ptx(tmp_path, monkeypatch, streamed + list(PRODUCTION_PTX))
    for key in streamed:
        ptx, res = got[key]
        assert ptx.count("@p cp.async.ca.shared.global") == 3, key  # windows 0, 1 and w + 1
        assert "cp.async.wait_group 1;" in ptx and "cp.async.wait_group 0;" in ptx, key
        assert "bar.sync \t10, 128;" in ptx and "bar.sync \t6, 128;" in ptx, key
        # the pair's producer spills a little: bounded
        assert res.get("spill", 0) <= (104 if "h128" in key[1] else 0), (key, res)
    for key, digest in PRODUCTION_PTX.items():
        ptx, _ = got[key]
        assert "cp.async.ca" not in ptx and "bar.sync \t10," not in ptx, key
        assert hashlib.sha256(ptx.encode()).hexdigest() == digest, key


def test_planted_stream_behind_reaches_the_compiled_e_kernel(project_root, tmp_path, monkeypatch):
    """wrong_e_window's `refill_source` hook reaches the kernel: the PTX differs."""
    key = (1, "s2h64_m16384bs256", "model1", 1)
    got = [_sm90_ptx(tmp_path / name, monkeypatch, [key], name)[key][0] for name in ("", "wrong_e_window")]
    bodies = [ptx.replace(ptx.split(".entry", 1)[1].split("(", 1)[0].strip(), "K") for ptx in got]
    assert bodies[0].count("cp.async.ca") == bodies[1].count("cp.async.ca") > 0
    assert bodies[0] != bodies[1]


_SM100 = """
    import json
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from harness.execution.compile import _fake_tensor
    from oracles.sparse_decode import split_capacity, tensors
    import stages.E_sparse_decode.sm100 as m
    out = {{}}
    for case in {cases!r}:
        k = m.Kernel(b=case["b"], config=case["config"], kv_format=case["kv_format"], splits=case["splits"])
        chosen = k.splits
        cute.compile(k, *[_fake_tensor(s) for s in tensors(case)], make_fake_stream())
        out[case["config"]] = [chosen, k.splits, split_capacity(case), int(k.smem_struct.size_in_bytes())]
    print("COMPILED", json.dumps(out))
"""


def test_sm100_compiles_topk_16384_and_32768_with_its_auto_splits_capped(tmp_path):
    """sm_100a builds topk 16384 / 32768; topk 32768 takes the scratch's 57 splits."""
    import os
    import subprocess
    import sys
    import textwrap

    from tests.conftest import ROOT

    cases = [dict(b=2, config="s2h128_m16384bs256", kv_format="model1", scenario="plain", splits="auto"),
             dict(b=1, config="s1h64_m32768bs64", kv_format="v4.1", scenario="plain", splits="auto")]
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_SM100).format(cases=cases)], cwd=tmp_path,
                       env={**os.environ, "CUTE_DSL_ARCH": "sm_100a", "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert "COMPILED" in out, out[-3000:]
    got = json.loads(out.split("COMPILED", 1)[1].strip().splitlines()[0])
    for config, (chosen, taken, cap, smem) in got.items():
        assert smem <= SMEM_LIMIT and taken == min(chosen, cap), (config, got)
    assert got["s2h128_m16384bs256"][2] == 32  # AUTO_SPLITS (sm90's parts need fewer there)
    chosen, taken, cap, _ = got["s1h64_m32768bs64"]
    assert chosen == 74 and cap == 57 == taken  # capped to the scratch


def test_the_planted_stream_one_window_behind_moves_o_past_the_bounds():
    """wrong_e_window on the oracle fails E's bounds: the GPU `fail` is the check's."""
    import torch

    case = dict(b=1, config="s2h64_m4096bs256", kv_format="model1", scenario="sink", splits=1)  # 64 tiles, 4 windows
    inputs = sd.make_inputs(case, seed=5)
    ref = sd.reference(inputs, case)
    idx = inputs["idx"]
    wrong = idx.clone()
    for i in range(2 * iw.WINDOW_TILES, 64):
        wrong[..., i * KEYS:(i + 1) * KEYS] = idx[..., (i - 16) * KEYS:(i - 15) * KEYS]
    bad = sd.reference({**inputs, "idx": wrong}, case)
    assert bool(torch.isfinite(bad["O"]).all())  # a wrong row, not a NaN
    cos = torch.nn.functional.cosine_similarity(bad["O"].flatten(), ref["O"].flatten(), dim=0).item()
    lse_rel = ((bad["LSE"] - ref["LSE"]).norm() / ref["LSE"].norm()).item()
    assert cos < 0.9999 and lse_rel > 1e-5, (cos, lse_rel)
