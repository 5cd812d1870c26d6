"""oracles/mqa_fused.py equals oracles/indexer.py mqa_logits."""

import json
import time

import pytest
import torch

from oracles.indexer import mqa_logits
from oracles.mqa_fused import BK, BR, MAX_OFFSET, model_logits, mqa_logits_fused, row_chunks


def _case(rows, keys, h, d, seed, device="cpu"):
    """Random q, k, w, ranges with the edge cases."""
    g = torch.Generator().manual_seed(seed)
    q, k, w = torch.randn(rows, h, d, generator=g), torch.randn(keys, d, generator=g), torch.randn(rows, h, generator=g)
    ks = torch.randint(-5, keys, (rows,), generator=g)
    ke = ks + torch.randint(0, keys // 2 + 8, (rows,), generator=g)
    ke[::7] = ks[::7]  # empty rows
    ks[:4] = torch.tensor([0, keys - 3, 0, keys // 2])[:rows]  # all keys, the last 3, the first 40,
    ke[:4] = torch.tensor([keys, keys + 9, 40, keys // 3])[:rows]  # ks > ke
    ks[BR:2 * BR], ke[BR:2 * BR] = 0, 40  # CTAs past key 40 compute nothing
    args = [t.to(torch.float64).to(device) for t in (q, k, w)] + [t.to(torch.int32).to(device) for t in (ks, ke)]
    j = torch.arange(keys, device=device)
    return args, (args[3][:, None] <= j) & (j < args[4][:, None])


def _check(got, want):
    got = torch.as_tensor(got, device=want.device)
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and bool((got[inf] < 0).all()), "−inf positions differ"
    assert not torch.isnan(got).any()
    if (~inf).any():
        err = (got[~inf] - want[~inf]).abs().max().item()
        assert err <= 1e-12 * want[~inf].abs().max().item(), err


@pytest.mark.parametrize("h,d,rows,keys", [(8, 32, BR + 6, 2 * BK + 44), (16, 64, 9, BK - 5)])
def test_the_tiling_model_equals_mqa_logits(h, d, rows, keys):
    """The kernel's index math in numpy: every element written, −inf where the reference has it."""
    args, valid = _case(rows, keys, h, d, seed=h + d)
    want = mqa_logits(*args[:3], valid)
    assert torch.isinf(want).any() and (~torch.isinf(want)).any()
    _check(model_logits(*[a.numpy() for a in args]), want)


def test_row_chunks_keep_offsets_32_bit():
    assert row_chunks(8192, 131072, 64, 128) == [(0, 8192)]
    chunks = row_chunks(70000, 65536, 64, 128)
    assert [r0 for r0, _ in chunks] == list(range(0, 70000, 32704)) and sum(n for _, n in chunks) == 70000
    assert all(r0 % BR == 0 and n * 65536 <= MAX_OFFSET for r0, n in chunks)


def test_it_compiles_for_sm90_without_spills(tmp_path):
    """Every (h, d) the suites use compiles for sm_90a; no spill, no stack."""
    from tests.conftest import traced

    r = traced("""
        import json, pathlib, sys
        from harness.execution.compile import ptxas_resources
        from oracles.mqa_fused import compiled
        for h in (32, 64):
            for d in (32, 64, 128):
                p = pathlib.Path(sys.argv[0]).parent / f"{h}_{d}.ptx"
                ptx = compiled(h, d).__ptx__  # the text, or the dumped file's path
                p.write_text(ptx if "\\n" in ptx else pathlib.Path(ptx).read_text())
                print(json.dumps(ptxas_resources(p, "sm_90a")))
    """, tmp_path, arch="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    res = [json.loads(line) for line in r.stdout.splitlines()]
    if not res[0]:
        pytest.skip("no ptxas here: compiled, resources unchecked")
    assert all(x["spill"] == 0 and x["stack"] == 0 and x["regs"] <= 255 for x in res), res


@pytest.mark.gpu
@pytest.mark.parametrize("h", [32, 64])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_fused_equals_mqa_logits_on_the_gpu(h, d):
    for seed, (rows, keys) in enumerate([(5, 77), (BR + 3, 3 * BK + 17), (700, 2600)]):
        args, valid = _case(rows, keys, h, d, seed, "cuda")
        if seed == 0:  # misaligned views: the dispatcher realigns them
            args = [torch.cat([t[:1], t])[1:] for t in args]
        _check(mqa_logits_fused(*args), mqa_logits(*args[:3], valid))


@pytest.mark.gpu
def test_fused_in_row_chunks(monkeypatch):
    """Past 32-bit offsets the dispatcher launches chunks of rows (forced here)."""
    import oracles.mqa_fused

    args, valid = _case(5 * BR + 9, 3 * BK + 17, 32, 64, 7, "cuda")
    monkeypatch.setattr(oracles.mqa_fused, "MAX_OFFSET", 2 * BR * 32 * 64 + 5)  # h · d > keys
    _check(mqa_logits_fused(*args), mqa_logits(*args[:3], valid))


@pytest.mark.gpu
def test_fused_timing_big_case():
    """Prints the fused kernel's and the reference's times."""
    s, s_kv, h, d = 2048, 65536, 64, 128
    q, k, w = (torch.randn(*shape, device="cuda", dtype=torch.float64) for shape in ((s, h, d), (s_kv, d), (s, h)))
    ke = torch.arange(s_kv - s + 1, s_kv + 1, device="cuda", dtype=torch.int32)
    ks = torch.zeros_like(ke)
    mqa_logits_fused(q[:1], k[:1], w[:1], ks[:1], ke[:1])  # compile
    got, flop = {}, 2 * h * d * float((ke - ks).sum())
    for name, fn in (("fused", lambda: mqa_logits_fused(q, k, w, ks, ke)),
                     ("mqa_logits", lambda: mqa_logits(q, k, w, torch.arange(s_kv, device="cuda") < ke[:, None]))):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got[name] = fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"{name}: {dt:.3f} s, {flop / dt / 1e12:.2f} TFLOP/s (valid pairs)")
    _check(got["fused"], got["mqa_logits"])
